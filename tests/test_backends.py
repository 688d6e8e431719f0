"""The backend registry: the choice of implementation, its reasons, and the ops it covers."""

import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src import backends
from jattn._src.hardware import has_cuda

OPS = ("flex_attention", "flex_decode", "matmul", "bmm", "mm_plus_mm", "b2b_matmul",
       "mixed_matmul", "scaled_matmul")


def test_every_op_runs_on_xla_and_the_triton_kernels_and_some_also_on_mosaic_gpu():
    for op in OPS:
        expected = {"xla", "pallas_triton", "interpret"}
        if op in ("flex_attention", "matmul", "bmm", "scaled_matmul", "mixed_matmul"):
            expected.add("pallas_mosaic_gpu")
        assert set(backends.implementations(op)) == expected, op


def test_argument_wins_over_environment(monkeypatch):
    monkeypatch.setenv("JATTN_IMPLEMENTATION", "interpret")
    assert backends.resolve("matmul", "xla").name == "xla"
    assert backends.resolve("matmul").name == "interpret"


def test_platform_default(monkeypatch):
    monkeypatch.delenv("JATTN_IMPLEMENTATION", raising=False)
    expected = "pallas_triton" if has_cuda() else "xla"
    assert backends.resolve("flex_attention").name == expected
    assert backends.resolve("flex_attention", platform="cpu").name == "xla"


def test_unknown_names_raise(monkeypatch):
    with pytest.raises(ValueError, match="implementation='triton' is not an implementation"):
        backends.resolve("matmul", "triton")
    monkeypatch.setenv("JATTN_IMPLEMENTATION", "cuda")
    with pytest.raises(ValueError, match="JATTN_IMPLEMENTATION='cuda' is not an implementation"):
        backends.resolve("matmul")


def test_gpu_backend_named_for_the_cpu_raises():
    with pytest.raises(ValueError, match="needs a CUDA GPU.*Use implementation='xla'"):
        backends.resolve("flex_attention", "pallas_triton", platform="cpu")


def test_environment_backend_that_cannot_run_here_falls_back_with_a_reason(monkeypatch):
    monkeypatch.setenv("JATTN_IMPLEMENTATION", "pallas_triton")
    with backends.recording() as seen, pytest.warns(UserWarning, match="cannot run on cpu"):
        backends._warned_env.clear()
        assert backends.resolve("matmul", platform="cpu").name == "xla"
    assert "skipped pallas_triton (from JATTN_IMPLEMENTATION): it needs a CUDA GPU" in str(
        seen[0])


def test_unsupported_call_falls_back_or_raises_when_named(monkeypatch):
    op = "test_op"
    backends.register(backends.Implementation(op, backends.XLA))
    backends.register(backends.Implementation(
        op, backends.INTERPRET, unsupported=lambda head_dim, **_: (
            f"head dim {head_dim} is not supported" if head_dim > 256 else None)))
    monkeypatch.setitem(backends.DEFAULT_ORDER, "cpu", ("interpret", "xla"))
    monkeypatch.delenv("JATTN_IMPLEMENTATION", raising=False)
    assert backends.resolve(op, platform="cpu", head_dim=64).name == "interpret"
    with backends.recording() as seen:
        assert backends.resolve(op, platform="cpu", head_dim=512).name == "xla"
    assert str(seen[0]) == ("test_op: xla (platform default (cpu))\n"
                            "  skipped interpret: head dim 512 is not supported")
    with pytest.raises(ValueError, match="implementation='interpret' cannot run this call: "
                                         "head dim 512 is not supported"):
        backends.resolve(op, "interpret", platform="cpu", head_dim=512)


def test_explain_names_the_implementation_of_each_op(monkeypatch):
    monkeypatch.delenv("JATTN_IMPLEMENTATION", raising=False)
    q = jnp.asarray(np.ones((1, 2, 64, 16)), jnp.float32)

    def calls():
        return (jattn.flex_attention(q, q, q),
                jattn.matmul(q[0, 0], q[0, 0].T, implementation="interpret"))

    calls()  # eager calls made before are reported too (not replayed from their plans)
    text = jattn.explain(calls)
    default = "pallas_triton" if has_cuda() else "xla"
    assert text.splitlines() == [f"flex_attention: {default} (platform default "
                                 f"({'gpu' if has_cuda() else 'cpu'}))",
                                 "matmul: interpret (argument)"]
