"""The GEMM through XLA (`jnp.dot`), with the same operands and options as the Pallas kernel."""

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


def matmul(a: jax.Array, b: jax.Array, bias: jax.Array | None, captures: Sequence[Any], *,
           out_dtype, transpose_a: bool = False, transpose_b: bool = False,
           epilogue: TracedFunction | None = None, save_preact: bool = False):
    """Same contract as `pallas_triton.matmul` with split_k == 1; epilogue traced at [M, N]."""
    # bf16/f16 products are exact in float32, so upcasting first is the same math, and it also
    # runs where XLA has no mixed-precision batched dot (the CPU backend, under bmm's vmap).
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    acc = jnp.dot(a.T if transpose_a else a, b.T if transpose_b else b,
                  preferred_element_type=jnp.float32)
    return apply_epilogue(acc, bias, captures, epilogue, out_dtype, save_preact)


def mm_plus_mm(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array,
               bias: jax.Array | None, captures: Sequence[Any], *, out_dtype,
               epilogue: TracedFunction | None = None, save_preact: bool = False):
    """Same contract as `pallas_triton.mm_plus_mm`; epilogue traced at [M, N]."""
    acc = sum(jnp.dot(x.astype(jnp.float32), y.astype(jnp.float32),
                      preferred_element_type=jnp.float32) for x, y in ((a, b), (c, d)))
    return apply_epilogue(acc, bias, captures, epilogue, out_dtype, save_preact)


def b2b(a: jax.Array, b: jax.Array, c: jax.Array, captures: Sequence[Any], *, side: str,
        fn: TracedFunction | None = None):
    """Same contract as `pallas_triton_b2b.b2b`; fn traced at the whole intermediate."""
    f32 = lambda x: x.astype(jnp.float32)
    x, y = (a, b) if side == "left" else (b, c)
    inner = jnp.dot(f32(x), f32(y), preferred_element_type=jnp.float32)
    if fn is not None:
        inner = fn(captures, inner)[0]
    inner = f32(inner.astype(a.dtype))  # the kernel feeds the rounded values to the 2nd product
    x, y = (inner, c) if side == "left" else (a, inner)
    return jnp.dot(f32(x), f32(y), preferred_element_type=jnp.float32).astype(a.dtype)


def scaled_matmul(a: jax.Array, b: jax.Array, scale_a: jax.Array, scale_b: jax.Array,
                  bias: jax.Array | None, *, out_dtype):
    """Same contract as `pallas_triton.scaled_matmul`.

    fp8 values are exact in float32 and so are their products, so upcasting first is the
    kernel's math (fp32 accumulation), and runs where XLA has no fp8 dot.
    """
    acc = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                  preferred_element_type=jnp.float32)
    return apply_epilogue(acc * scale_a * scale_b, bias, (), None, out_dtype, False)


def mixed_matmul(a: jax.Array, qweight: jax.Array, scales: jax.Array, *, bits: int,
                 group_size: int | None, out_dtype):
    """Same contract as `pallas_triton_mixed.mixed_matmul` with split_k == 1.

    The weight is dequantised in float32 and multiplied at full float32 precision: the kernel's
    math (exact integer widening, fp32 accumulation, scales in fp32) up to summation order.
    """
    w = quantize.dequantize_weight(qweight, scales, bits=bits, group_size=group_size)
    return jnp.dot(a.astype(jnp.float32), w, precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32).astype(out_dtype)
