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
