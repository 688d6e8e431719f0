"""The back-to-back GEMM kernel in Pallas, lowered to Triton.

side="left", out = fn(a @ b) @ c with a [M, K], b [K, P], c [P, N]: one program owns
`block_out` rows of the output and holds all N columns of them in an fp32 accumulator. It walks
the intermediate width P in `block_inner` chunks; for each chunk it computes
S = a[rows] @ b[:, chunk] (K walked in `block_k` steps), applies fn to the fp32 S, rounds it to
the input dtype and adds S @ c[chunk, :] into the accumulator. fn is elementwise, so chunks are
independent and the [M, P] intermediate never leaves the chip, whatever P is.

side="right", out = a @ fn(b @ c) with a [M, P], b [P, K], c [K, N], is the mirror image: a
program owns `block_out` output columns, holds all M rows, and adds a[:, chunk] @ fn(S) for
S = b[chunk, :] @ c[:, cols].

Ragged M, N, K and P are masked explicitly (the GPU neither pads nor masks a partial block).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jattn._src.gemm.config import B2B_MAX_HELD, B2BConfig, b2b_held_width
from jattn._src.pallas_triton.captured_loads import call_in_kernel
from jattn._src.pallas_triton.masked import both, bounds, load, store
from jattn._src.tiling import cdiv
from jattn._src.user_functions import TracedFunction


def _dot(x, y):
    return jnp.dot(x, y, preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------

def _b2b_kernel(a_ref, b_ref, c_ref, *refs, left: bool, outer: int, held_size: int, k: int,
                inner: int, config: B2BConfig, fn: TracedFunction | None, num_captures: int):
    capture_refs, out_ref = refs[:num_captures], refs[num_captures]
    bo, bj, bk = config.block_out, config.block_inner, config.block_k
    held = out_ref.shape[1] if left else out_ref.shape[0]
    out_axis, held_axis = (0, 1) if left else (1, 0)

    # ---- masks of this program's output block (static where nothing is ragged) ----------------
    o0 = pl.program_id(0) * bo
    out_mask = bounds(o0, bo, outer if outer % bo else None, out_axis)
    held_mask = bounds(0, held, held_size if held_size != held else None, held_axis)
    k_bound, p_bound = (k if k % bk else None), (inner if inner % bj else None)
    k_steps = cdiv(k, bk)

    def fixed(k0):
        """The first product's operand that stays put across chunks: a's rows, or c's columns."""
        k_mask = bounds(k0, bk, k_bound, 1 if left else 0)
        if left:
            return load(a_ref, (slice(None), pl.ds(k0, bk)), both(out_mask, k_mask))
        return load(c_ref, (pl.ds(k0, bk), slice(None)), both(k_mask, out_mask))

    def moving(k0, j0):
        """b's [block_k, block_inner] (left) or [block_inner, block_k] (right) tile."""
        k_mask = bounds(k0, bk, k_bound, 0 if left else 1)
        j_mask = bounds(j0, bj, p_bound, 1 if left else 0)
        index = (pl.ds(k0, bk), pl.ds(j0, bj)) if left else (pl.ds(j0, bj), pl.ds(k0, bk))
        return load(b_ref, index, both(k_mask, j_mask))

    def product(x, y):
        return _dot(x, y) if left else _dot(y, x)

    # One K step (the common small-K case): the fixed operand is loaded once, not per chunk.
    hoisted = fixed(0) if k_steps == 1 else None

    def first_product(j0):
        if hoisted is not None:
            return product(hoisted, moving(0, j0))

        def k_step(step, s):
            k0 = pl.multiple_of(step * bk, bk)
            return s + product(fixed(k0), moving(k0, j0))

        return lax.fori_loop(0, k_steps, k_step,
                             jnp.zeros((bo, bj) if left else (bj, bo), jnp.float32))

    # ---- walk the intermediate in chunks: S -> fn -> round -> second product -------------------
    def chunk(step, acc):
        j0 = pl.multiple_of(step * bj, bj)
        s = first_product(j0)
        if fn is not None:
            s = call_in_kernel(fn, capture_refs, s)[0]
        j_mask = bounds(j0, bj, p_bound, 1 if left else 0)
        if j_mask is not None:  # fn(0) on the padding may be nonzero, even inf: drop it
            s = jnp.where(j_mask, s, 0.0)
        s = s.astype(b_ref.dtype)
        if left:
            c = load(c_ref, (pl.ds(j0, bj), slice(None)),
                     both(bounds(j0, bj, p_bound, 0), held_mask))
            return acc + _dot(s, c)
        a = load(a_ref, (slice(None), pl.ds(j0, bj)), both(held_mask, bounds(j0, bj, p_bound, 1)))
        return acc + _dot(a, s)

    acc = jnp.zeros((bo, held) if left else (held, bo), jnp.float32)
    acc = lax.fori_loop(0, cdiv(inner, bj), chunk, acc)
    store(out_ref, ..., acc.astype(out_ref.dtype), both(out_mask, held_mask))


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------

def b2b(a: jax.Array, b: jax.Array, c: jax.Array, captures: Sequence[Any], *, side: str,
        config: B2BConfig, fn: TracedFunction | None = None, interpret: bool = False):
    """fn(a @ b) @ c (side="left") or a @ fn(b @ c) ("right"), on 2-D operands, one kernel.

    left: a [M, K], b [K, P], c [P, N]; right: a [M, P], b [P, K], c [K, N]; all one dtype.
    fn (traced at the [block_out, block_inner] tile, [block_inner, block_out] for "right")
    sees the fp32 intermediate; its result is rounded to the input dtype before the second
    product. The held output side (N for left, M for right) must be <= B2B_MAX_HELD.
    Returns out [M, N] of the input dtype.
    """
    left = side == "left"
    m, n = a.shape[0], c.shape[1]
    k, inner = (a.shape[1], b.shape[1]) if left else (b.shape[1], a.shape[1])
    outer, held_size = (m, n) if left else (n, m)
    held = b2b_held_width(held_size)
    bo, bj, bk = config.block_out, config.block_inner, config.block_k
    # Whole-operand blocks span whole steps: windows past the end are masked on the GPU, and
    # the interpreter pads the block instead of rejecting the window.
    k_span, p_span = cdiv(k, bk) * bk, cdiv(inner, bj) * bj
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0, 0))
    if left:
        in_specs = [pl.BlockSpec((bo, k_span), lambda i: (i, 0)), whole((k_span, p_span)),
                    whole((p_span, held))]
        out_spec = pl.BlockSpec((bo, held), lambda i: (i, 0))
    else:
        in_specs = [whole((held, p_span)), whole((p_span, k_span)),
                    pl.BlockSpec((k_span, bo), lambda i: (0, i))]
        out_spec = pl.BlockSpec((held, bo), lambda i: (0, i))
    in_specs += [pl.BlockSpec(x.shape, lambda i, nd=jnp.ndim(x): (0,) * nd) for x in captures]

    kernel = functools.partial(_b2b_kernel, left=left, outer=outer, held_size=held_size, k=k,
                               inner=inner, config=config, fn=fn, num_captures=len(captures))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
        grid=(cdiv(outer, bo),),
        in_specs=in_specs,
        out_specs=out_spec,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name=f"jattn_b2b_{side}",
    )(a, b, c, *captures)


# ------------------------------------------------------------------------------------------------
# The op's entry points (gemm/protocols.py B2BBackend)
# ------------------------------------------------------------------------------------------------

def holds(held_size: int) -> bool:
    """B2BBackend.holds: the held side, padded to a power of two, within B2B_MAX_HELD."""
    return b2b_held_width(held_size) <= B2B_MAX_HELD


def b2b_product(a: jax.Array, b: jax.Array, c: jax.Array, captures: Sequence[Any], *, side: str,
                config: B2BConfig, fn_tile: TracedFunction | None = None, fn_full=None,
                interpret: bool = False):
    """B2BBackend.b2b_product: the kernel, fn traced at its tile."""
    del fn_full
    return b2b(a, b, c, captures, side=side, config=config, fn=fn_tile, interpret=interpret)
