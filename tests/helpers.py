"""Shared test helpers: random inputs, the tolerance rule, gradients, determinism, lowering."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src.hardware import has_cuda


def random(rng: np.random.Generator, shape: Sequence[int], dtype=jnp.float32,
           scale: float = 1.0) -> jax.Array:
    """Standard normal values (times scale) of `dtype`; never zeros, which hide indexing bugs."""
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)


def _truncate_to_tf32(x: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFE000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


class References(tuple):
    """Several equally valid low-precision references; the tolerance takes the worst."""

    def map(self, fn: Callable[[Any], Any]) -> References:
        return References(fn(x) for x in self)


def map_reference(fn: Callable[[Any], Any], reference: Any) -> Any:
    """fn applied to a reference, or to each of several (see `References`)."""
    return reference.map(fn) if isinstance(reference, References) else fn(reference)


def low_precision(fn: Callable[..., Any], *args: Any) -> Any:
    """fn at the precision the kernels compute in, the `reference` of `assert_close`.

    On the CPU that is fn itself. On the GPU, float32 dots are TF32 in the kernels, while XLA
    picks TF32 for some shapes and full float32 for others (matrix-vector): there each result
    leaf holds both XLA's own result and fn on inputs cut to TF32's 10 mantissa bits.
    """
    if not has_cuda():
        return _jitted_where_possible(fn, args)
    plain = fn(*args)  # (op by op: XLA's choice of TF32 per dot is what the References cover)
    truncated = fn(*jax.tree.map(
        lambda x: _truncate_to_tf32(x) if jnp.asarray(x).dtype == jnp.float32 else x, args))
    return jax.tree.map(lambda x, y: References((x, y)), plain, truncated)


def _jitted_where_possible(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    """fn(*args) jitted (one compile, where op by op compiles every op), or op by op for a
    reference that reads values in Python."""
    try:
        return jax.jit(fn)(*args)
    except jax.errors.JAXTypeError:
        return fn(*args)


def golden(fn: Callable[..., Any], *args: Any) -> Any:
    """fn evaluated with every floating input cast to float64 on the CPU (numpy outputs)."""
    with jax.enable_x64(True):
        cpu = jax.devices("cpu")[0]

        def to64(x):
            x = jax.device_put(x, cpu)
            return x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x

        with jax.default_device(cpu):
            out = _jitted_where_possible(fn, jax.tree.map(to64, args))
            return jax.tree.map(lambda y: np.asarray(y, np.float64), out)


def assert_close(actual: Any, gold: Any, reference: Any, *, what: str = "output") -> None:
    """The STYLE.md rule: |actual - golden| <= 2 |reference - golden| + noise, as max norms.

    `reference` is the oracle run in the same low precision as `actual`; the noise term (a few
    float32 ulps of the golden's scale) covers results the low-precision reference gets exact.
    8 ulps: the xla implementation's float32 dK at one query (online softmax over 45 keys, E=80)
    measured 7.5 ulps on one CPU machine, where the dense float32 reference happened to get 1.5.
    """
    def as64(x):
        return np.asarray(jnp.asarray(x, jnp.float32), np.float64)

    actual, gold = as64(actual), np.asarray(gold, np.float64)
    references = reference if isinstance(reference, References) else (reference,)
    assert actual.shape == gold.shape, f"{what}: shape {actual.shape} != golden {gold.shape}"
    assert not np.isnan(actual).any() or np.isnan(gold).any(), f"{what}: NaN in result"
    err = np.abs(actual - gold).max(initial=0.0)
    ref_err = max(np.abs(as64(r) - gold).max(initial=0.0) for r in references)
    noise = 8 * np.finfo(np.float32).eps * max(1.0, np.abs(gold).max(initial=0.0))
    assert err <= 2 * ref_err + noise, (
        f"{what}: max error {err:.3g} exceeds 2 x reference error {ref_err:.3g} + {noise:.2g}")


def random_cotangent_vjp(fn: Callable[..., Any], args: Sequence[Any], cotangent: Any):
    """Gradients of fn at args pulled back from a fixed random cotangent (never `.sum()`)."""
    _, vjp = jax.vjp(fn, *args)
    return vjp(cotangent)


def assert_gradients_close(ours: Callable[..., Any], reference: Callable[..., Any],
                           args: Sequence[Any], cotangent: Any, names: Sequence[str]) -> None:
    """Gradients of ours at args from a random cotangent against the reference's (float64
    golden, low-precision tolerance); each has its argument's dtype and shape."""
    pulled_back = lambda *x: random_cotangent_vjp(reference, x[:-1], x[-1])
    grads = jax.jit(lambda *x: random_cotangent_vjp(ours, x, cotangent))(*args)
    gold = golden(pulled_back, *args, cotangent)
    low = low_precision(pulled_back, *args, cotangent)
    for name, arg, g, g64, g_low in zip(names, args, grads, gold, low):
        assert g.dtype == jnp.asarray(arg).dtype and g.shape == jnp.shape(arg)
        assert_close(g, g64, g_low, what=f"d{name}")


def assert_bitwise_equal_runs(fn: Callable[[], Any]) -> None:
    """Two runs of fn give bitwise identical results."""
    first, second = fn(), fn()
    for x, y in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@contextlib.contextmanager
def _abstract_cuda_device(devices: int = 1):
    """jax >= 0.11 lowers for CUDA on a CPU machine only inside an abstract H100 mesh (of
    `devices` along axis "x")."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    try:
        device = AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
        mesh = AbstractMesh((devices,), ("x",), (AxisType.Explicit,), abstract_device=device)
    except TypeError:  # jax 0.10 needs (and accepts) no abstract device
        yield
        return
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_cuda(fn: Callable[..., Any], *args: Any, devices: int = 1) -> str:
    """StableHLO text of fn lowered for CUDA, Pallas kernels through the Triton lowering.

    Runs on a CPU machine: it checks what the Triton lowering rejects (non-power-of-two tensors,
    unsupported primitives) without a GPU. Triton's own PTX compile is not run. On the CPU,
    fn runs inside an abstract mesh of `devices` GPUs along axis "x" (for shard_map(mesh=None)).
    """
    if has_cuda():
        return jax.jit(fn).lower(*args).as_text()
    with _abstract_cuda_device(devices):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
