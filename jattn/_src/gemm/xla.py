"""The GEMM family through XLA (`jnp.dot`): each op's entry points (gemm/protocols.py), with
the same math as the Pallas kernels. XLA chooses its own tiles: the config, the tile-traced
epilogue and `interpret` go unused."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.gemm import quantize
from jattn._src.user_functions import TracedFunction


def apply_epilogue(acc: jax.Array, bias: jax.Array | None, captures: Sequence[Any],
                   epilogue: TracedFunction | None, out_dtype, save_preact: bool):
    """Bias, epilogue and cast on a whole fp32 [M, N] product (also the split-K combine).

    Returns out, or (out, preact) with the fp32 pre-epilogue values if save_preact.
    """
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    preact = acc
    if epilogue is not None:
        m, n = acc.shape
        rows = lax.broadcasted_iota(jnp.int32, (m, 1), 0)
        cols = lax.broadcasted_iota(jnp.int32, (1, n), 1)
        acc = epilogue(captures, acc, rows, cols)[0]
    out = acc.astype(out_dtype)
    return (out, preact) if save_preact else out


def matmul_product(a: jax.Array, b: jax.Array, bias: jax.Array | None, captures: Sequence[Any],
                   *, config=None, out_dtype, transpose_a: bool = False,
                   transpose_b: bool = False, epilogue_tile=None,
                   epilogue_full: TracedFunction | None = None, save_preact: bool = False,
                   interpret: bool = False):
    """MatmulBackend.matmul_product; the epilogue traced at [M, N]."""
    del config, epilogue_tile, interpret
    # bf16/f16 products are exact in float32, so upcasting first is the same math, and it also
    # runs where XLA has no mixed-precision batched dot (the CPU backend, under bmm's vmap).
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    acc = jnp.dot(a.T if transpose_a else a, b.T if transpose_b else b,
                  preferred_element_type=jnp.float32)
    return apply_epilogue(acc, bias, captures, epilogue_full, out_dtype, save_preact)


def mm_plus_mm_product(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array,
                       bias: jax.Array | None, captures: Sequence[Any], *, config=None,
                       out_dtype, epilogue_tile=None,
                       epilogue_full: TracedFunction | None = None, save_preact: bool = False,
                       interpret: bool = False):
    """MmPlusMmBackend.mm_plus_mm_product; the epilogue traced at [M, N]."""
    del config, epilogue_tile, interpret
    acc = sum(jnp.dot(x.astype(jnp.float32), y.astype(jnp.float32),
                      preferred_element_type=jnp.float32) for x, y in ((a, b), (c, d)))
    return apply_epilogue(acc, bias, captures, epilogue_full, out_dtype, save_preact)


def holds(held_size: int) -> bool:
    """B2BBackend.holds: XLA holds any output side."""
    del held_size
    return True


def b2b_product(a: jax.Array, b: jax.Array, c: jax.Array, captures: Sequence[Any], *, side: str,
                config=None, fn_tile=None, fn_full: TracedFunction | None = None,
                interpret: bool = False):
    """B2BBackend.b2b_product; fn traced at the whole intermediate."""
    del config, fn_tile, interpret
    f32 = lambda x: x.astype(jnp.float32)
    x, y = (a, b) if side == "left" else (b, c)
    inner = jnp.dot(f32(x), f32(y), preferred_element_type=jnp.float32)
    if fn_full is not None:
        inner = fn_full(captures, inner)[0]
    inner = f32(inner.astype(a.dtype))  # the kernel feeds the rounded values to the 2nd product
    x, y = (inner, c) if side == "left" else (a, inner)
    return jnp.dot(f32(x), f32(y), preferred_element_type=jnp.float32).astype(a.dtype)


def scaled_product(a: jax.Array, b: jax.Array, scale_a: jax.Array, scale_b: jax.Array,
                   bias: jax.Array | None, *, config=None, out_dtype,
                   use_fast_accum: bool = False, interpret: bool = False):
    """ScaledBackend.scaled_product.

    fp8 values are exact in float32 and so are their products, so upcasting first is the
    kernel's math (fp32 accumulation; use_fast_accum is a knob of the tensor cores), and runs
    where XLA has no fp8 dot.
    """
    del config, use_fast_accum, interpret
    acc = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                  preferred_element_type=jnp.float32)
    return apply_epilogue(acc * scale_a * scale_b, bias, (), None, out_dtype, False)


def mixed_product(a: jax.Array, qweight: jax.Array, scales: jax.Array, *, bits: int,
                  group_size: int | None, config=None, out_dtype, interpret: bool = False):
    """MixedBackend.mixed_product.

    The weight is dequantised in float32 and multiplied at full float32 precision: the kernel's
    math (exact integer widening, fp32 accumulation, scales in fp32) up to summation order.
    """
    del config, interpret
    w = quantize.dequantize_weight(qweight, scales, bits=bits, group_size=group_size)
    return jnp.dot(a.astype(jnp.float32), w, precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32).astype(out_dtype)
