"""A dense GEMM oracle for tests: plain jnp, in whatever precision its inputs have."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.gemm.quantize import dequantize_weight


def matmul_reference(a: jax.Array, b: jax.Array, *, bias: jax.Array | None = None,
                     epilogue: Callable[..., jax.Array] | None = None,
                     epilogue_takes_indices: bool = False, out_dtype=None) -> jax.Array:
    """epilogue(a @ b + bias) with broadcast leading dims, accumulated in float32 or better.

    Float64 inputs (under `jax.enable_x64`) give the float64 golden value tests compare against.
    """
    acc_dtype = jnp.promote_types(a.dtype, jnp.float32)
    acc = jnp.matmul(a, b, preferred_element_type=acc_dtype)
    if bias is not None:
        acc = acc + bias.astype(acc_dtype)
    if epilogue is not None:
        if epilogue_takes_indices:
            m, n = acc.shape[-2:]
            rows = lax.broadcasted_iota(jnp.int32, (m, 1), 0)
            cols = lax.broadcasted_iota(jnp.int32, (1, n), 1)
            acc = epilogue(acc, rows, cols)
        else:
            acc = epilogue(acc)
    return acc.astype(out_dtype or a.dtype)


def mm_plus_mm_reference(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array, *,
                         bias: jax.Array | None = None,
                         epilogue: Callable[..., jax.Array] | None = None,
                         out_dtype=None) -> jax.Array:
    """epilogue(a @ b + c @ d + bias), accumulated in float32 or better (float64 golden)."""
    acc_dtype = jnp.promote_types(a.dtype, jnp.float32)
    acc = (jnp.matmul(a, b, preferred_element_type=acc_dtype)
           + jnp.matmul(c, d, preferred_element_type=acc_dtype))
    if bias is not None:
        acc = acc + bias.astype(acc_dtype)
    if epilogue is not None:
        acc = epilogue(acc)
    return acc.astype(out_dtype or a.dtype)


def b2b_reference(a: jax.Array, b: jax.Array, c: jax.Array,
                  fn: Callable[[jax.Array], jax.Array] | None = None, *,
                  side: str = "left") -> jax.Array:
    """fn(a @ b) @ c ("left") or a @ fn(b @ c) ("right").

    The intermediate is accumulated in float32 or better, passed through fn, rounded to the
    input dtype (as the kernel feeds it to the second product), then multiplied.
    """
    acc_dtype = jnp.promote_types(a.dtype, jnp.float32)
    fn = fn or (lambda x: x)
    if side == "left":
        inner = fn(jnp.matmul(a, b, preferred_element_type=acc_dtype)).astype(a.dtype)
        out = jnp.matmul(inner, c, preferred_element_type=acc_dtype)
    else:
        inner = fn(jnp.matmul(b, c, preferred_element_type=acc_dtype)).astype(a.dtype)
        out = jnp.matmul(a, inner, preferred_element_type=acc_dtype)
    return out.astype(a.dtype)


def scaled_matmul_reference(a: jax.Array, b: jax.Array, scale_a: jax.Array, scale_b: jax.Array,
                            *, bias: jax.Array | None = None, out_dtype=jnp.bfloat16):
    """(a @ b) * scale_a[:, None] * scale_b[None, :] + bias, cast to out_dtype.

    a [M, K] and b [K, N] of any float dtype (fp8 is upcast exactly); scale_a is a scalar or
    [M], scale_b a scalar or [N]. Accumulates in float32, or float64 for the golden value.
    """
    acc_dtype = jnp.promote_types(scale_a.dtype, jnp.float32)
    acc = jnp.matmul(a.astype(acc_dtype), b.astype(acc_dtype), preferred_element_type=acc_dtype)
    row = scale_a.reshape(-1, 1) if scale_a.size > 1 else scale_a.reshape(())
    col = scale_b.reshape(1, -1) if scale_b.size > 1 else scale_b.reshape(())
    acc = acc * row.astype(acc_dtype) * col.astype(acc_dtype)
    if bias is not None:
        acc = acc + bias.astype(acc_dtype)
    return acc.astype(out_dtype)


def mixed_matmul_reference(a: jax.Array, qweight: jax.Array, scales: jax.Array, *, bits: int,
                           group_size: int | None = None) -> jax.Array:
    """a @ W with W = q · scales dequantised to a's dtype first ("dequantise, then dot").

    In bf16/f16 the weight is rounded before the product (what a user without the fused kernel
    gets); float64 inputs give the exact golden value.
    """
    w = dequantize_weight(qweight, scales, bits=bits, group_size=group_size, dtype=a.dtype)
    acc = jnp.matmul(a, w, preferred_element_type=jnp.promote_types(a.dtype, jnp.float32))
    return acc.astype(a.dtype)
