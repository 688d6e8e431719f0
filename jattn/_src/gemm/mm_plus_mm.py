"""mm_plus_mm: a @ b + c @ d in one kernel, with matmul's bias and epilogue, and its custom_vjp."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn._src.backends import Implementation
from jattn._src.gemm.api import Epilogue, Options, check_operands, make_options, random_operand
from jattn._src.gemm.config import MatmulConfig
from jattn._src.precision import applied as precision_applied
from jattn._src.programs import jitted

_OP = "mm_plus_mm"


def _product(options: Options, a, b, c, d, bias, captures, *, save_preact=False):
    with precision_applied(options.precision):
        return _unscoped_product(options, a, b, c, d, bias, captures, save_preact=save_preact)


def _unscoped_product(options: Options, a, b, c, d, bias, captures, *, save_preact=False):
    return options.implementation.module.mm_plus_mm_product(
        a, b, c, d, bias, captures, config=options.config, out_dtype=options.out_dtype,
        epilogue_tile=options.epilogue_tile, epilogue_full=options.epilogue_full,
        save_preact=save_preact, interpret=options.implementation.backend.interpret)


class _Residuals(NamedTuple):
    operands: tuple[jax.Array, jax.Array, jax.Array, jax.Array]
    bias: jax.Array | None
    captures: tuple[Any, ...]
    preact: jax.Array | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mm_plus_mm(options: Options, a, b, c, d, bias, captures):
    return _product(options, a, b, c, d, bias, captures)


def _mm_plus_mm_fwd(options: Options, a, b, c, d, bias, captures):
    operands = (a, b, c, d)
    if options.epilogue_full is None:
        out, preact = _product(options, *operands, bias, captures), None
    else:
        out, preact = _product(options, *operands, bias, captures, save_preact=True)
    return out, _Residuals(operands, bias, captures, preact)


def _mm_plus_mm_bwd(options: Options, res: _Residuals, d_out):
    # Each half is an ordinary product: d(a@b)/da = dZ bᵀ, d/db = aᵀ dZ; likewise for c, d.
    d_preact, d_captures = options.preact_cotangent(res.preact, res.captures, d_out)
    grads = []
    for x, y in (res.operands[:2], res.operands[2:]):
        d_z = d_preact.astype(x.dtype)
        grads.append(options.backward_product(d_z, y, x.dtype, transpose_b=True))
        grads.append(options.backward_product(x, d_z, y.dtype, transpose_a=True))
    d_bias = None if res.bias is None else d_preact.sum(axis=0).astype(res.bias.dtype)
    return (*grads, d_bias, d_captures)


_mm_plus_mm.defvjp(_mm_plus_mm_fwd, _mm_plus_mm_bwd)


def mm_plus_mm(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array, *,
               bias: jax.Array | None = None, epilogue: Epilogue | None = None, out_dtype=None,
               config: MatmulConfig | str | None = None,
               implementation: str | None = None, precision: str | None = None) -> jax.Array:
    """epilogue(a @ b + c @ d + bias), both products in one float32 accumulator, one kernel.

    Each program walks a's K1 columns against b, then c's K2 columns against d, into the same
    output tile: a@b + c@d never makes an HBM round trip.

    Args:
      a: [..., M, K1] bfloat16, float16 or float32; leading dims are flattened into M.
      b: [K1, N], same dtype as `a`.
      c: [..., M, K2], same leading dims and dtype as `a`; K2 may differ from K1.
      d: [K2, N], same dtype as `a`.
      bias, epilogue, out_dtype, implementation, precision: as in `jattn.matmul`.
      config: as in `jattn.matmul` (a config is chosen for the [M, K1 + K2] @ [K1 + K2, N]
        product), except that split_k must be 1; cached and heuristic configs run unsplit.

    Returns:
      [..., M, N] of out_dtype. Differentiable in a, b, c, d, bias and captured arrays
      (custom_vjp: dA = dZ·Bᵀ, dB = Aᵀ·dZ, dC = dZ·Dᵀ, dD = Cᵀ·dZ through `jattn.matmul`'s
      kernel, dZ from `jax.vjp` of the epilogue).

    Example::

        a, b = jnp.ones((64, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)  # K1 = 32
        c, d = jnp.ones((64, 48), jnp.bfloat16), jnp.ones((48, 16), jnp.bfloat16)  # K2 = 48
        out = jattn.mm_plus_mm(a, b, c, d, epilogue=jax.nn.relu, out_dtype=jnp.float32)
        print(out.shape, out.dtype, out[0, 0])  # (64, 16) float32 80.0
    """
    a, b, c, d = (jnp.asarray(x) for x in (a, b, c, d))
    check_operands(_OP, a, b, b_max_ndim=2)
    check_operands(_OP, c, d, b_max_ndim=2, names=("c", "d"))
    if a.dtype != c.dtype:
        raise TypeError(f"{_OP}: `a` and `c` must have the same dtype, got {a.dtype} and "
                        f"{c.dtype}; cast one of them.")
    if a.shape[:-1] != c.shape[:-1]:
        raise ValueError(f"{_OP}: `a` {a.shape} and `c` {c.shape} must agree in every dim but "
                         "the last ([..., M, K1] and [..., M, K2]).")
    if b.shape[1] != d.shape[1]:
        raise ValueError(f"{_OP}: `b` {b.shape} and `d` {d.shape} must have the same number of "
                         "columns N.")
    *lead, k1 = a.shape
    m, n, k2 = math.prod(lead), b.shape[1], c.shape[-1]

    def runs(implementation: Implementation):  # config="autotune" times mm_plus_mm itself
        operands = [random_operand(shape, a.dtype, seed)
                    for seed, shape in enumerate(((m, k1), (k1, n), (m, k2), (k2, n)))]

        def make_run(config: MatmulConfig):
            tuned = Options(implementation, config, a.dtype, None, None)
            run = jax.jit(lambda *xs: _product(tuned, *xs, None, ()))
            return lambda: run(*operands)

        return make_run

    options, captures = make_options(_OP, m, n, k1 + k2, a.dtype, bias, epilogue, out_dtype,
                                     config, implementation, split_k=False, runs=runs,
                                     precision=precision)
    out = jitted(_mm_plus_mm, options)(a.reshape(m, k1), b, c.reshape(m, k2), d, bias,
                                      captures)
    return out.reshape(*lead, n)
