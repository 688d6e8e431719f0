"""The equations torch evaluates between directly launched kernels (interop/_direct.py), on
the CPU: torch's results match JAX's, and a program holding anything else is left to JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from interop import _direct
from jattn._src.pallas_triton import launch


def _between_kernels(x, y, d):
    """What a backward's prologue and a broadcast batch's sum do: dtype casts, products, sums
    and maxima, a select on -inf, broadcasts, literals and reshapes."""
    delta = jnp.sum(x.astype(jnp.float32) * y.astype(jnp.float32), axis=-1) - d
    base2 = jnp.where(d == -jnp.inf, 0.0, d * 1.4426950408889634)
    zeros = jnp.zeros(delta.shape, jnp.float32)
    spread = jnp.broadcast_to(delta[:, None], (2, 5, 3)).reshape(10, 3)
    return delta + zeros, base2, spread, -jnp.max(x, axis=(0, 2)).astype(jnp.bfloat16)


def test_torch_computes_what_jax_does():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4), np.float32)
    y = rng.standard_normal((2, 3, 4), np.float32).astype(jnp.bfloat16)
    d = np.array([[0.5, -np.inf, 2.0], [1.0, 3.0, -np.inf]], np.float32)
    program = launch.kernel_program(_between_kernels, x, y, d, evaluable=_direct._evaluable)
    assert program is not None and all(step.launch is None for step in program.steps)
    tensors = [torch.from_numpy(x), torch.from_numpy(y.astype(np.float32)).to(torch.bfloat16),
               torch.from_numpy(d)]
    got = _direct._run(program, tensors, index=-1)
    expected = jax.jit(_between_kernels)(x, y, d)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == _direct._TORCH_DTYPES[np.dtype(e.dtype)]
        np.testing.assert_allclose(g.float().numpy(), np.asarray(e, np.float32), rtol=1e-6)


def test_a_program_with_an_equation_torch_does_not_evaluate_goes_through_jax():
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    assert launch.kernel_program(jnp.exp, x, evaluable=_direct._evaluable) is None
    integers = jax.ShapeDtypeStruct((4,), jnp.int32)  # torch's integer sums widen to int64
    assert launch.kernel_program(jnp.sum, integers, evaluable=_direct._evaluable) is None
    assert launch.kernel_program(jnp.sum, x, evaluable=_direct._evaluable) is not None


class _RecordedLaunch:
    """A kernel's stand-in: records the addresses it is given, writes nothing."""

    def __init__(self, alignment, outputs):
        self.alignment, self.outputs, self.calls = alignment, outputs, []

    def __call__(self, operands, outputs, stream, device):
        self.calls.append(list(operands))
        return True


def test_each_tensor_is_checked_and_copied_once_however_many_kernels_read_it(monkeypatch):
    """Two kernels read a contiguous tensor, a strided one, one at an odd address and a
    broadcast equation's result: the contiguous one is read in place, each other one is
    copied once (both kernels get the same copy), and the first kernel's output is read in
    place by the second."""
    monkeypatch.setattr(_direct, "_current_stream", lambda index: 0)
    f32 = np.dtype(np.float32)
    first = _RecordedLaunch(16, [((4, 4), f32)])
    second = _RecordedLaunch(16, [((4, 4), f32)])
    program = launch.KernelProgram(steps=(
        launch.Step((2,), (3,), name="broadcast_in_dim",
                    params={"broadcast_dimensions": (1,), "shape": (4, 4)},
                    avals=(((4, 4), f32),)),
        launch.Step((0, 1, 2, 3), (4,), first),
        launch.Step((0, 1, 2, 3, 4), (5,), second),
    ), results=(4, 5), slots=6)
    contiguous = torch.randn(4, 4)
    strided = torch.randn(4, 4).t()
    odd = torch.zeros(4 * 4 + 1)[1:]
    got = _direct._run(program, [contiguous, strided, odd[:4]], index=0)
    [a, b] = first.calls + second.calls
    assert a[0] == b[0] == contiguous.data_ptr()
    assert a[1] == b[1] != strided.data_ptr()  # one copy, read by both
    assert a[2] == b[2] != odd.data_ptr() and a[2] % 16 == 0
    assert a[3] == b[3]  # the expanded row, copied once
    assert b[4] == got[0].data_ptr() and got[0].is_contiguous()
