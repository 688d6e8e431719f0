"""The GEMM kernel in Pallas, lowered to Triton.

One program computes one [block_m, block_n] output tile (or, with split_k, its share of the K
range). Tiles are walked in groups of `group_m` rows so that neighbouring programs reuse the same
B columns from L2. Operands stay whole in global memory and tiles are loaded at computed offsets;
ragged edges are masked explicitly, since a partial BlockSpec block is neither padded nor masked
on the GPU.
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

from jattn._src.gemm.config import MatmulConfig
from jattn._src.user_functions import TracedFunction


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------------
# Tile helpers
# ------------------------------------------------------------------------------------------------

def _grouped_tile(tile: jax.Array, tiles_m: int, tiles_n: int, group_m: int):
    """Maps a linear program id to (row tile, column tile), walking `group_m` rows at a time."""
    tiles_per_group = group_m * tiles_n
    first_m = (tile // tiles_per_group) * group_m
    rows_in_group = jnp.minimum(tiles_m - first_m, group_m)
    within = tile % tiles_per_group
    return first_m + within % rows_in_group, within // rows_in_group


def _bounds_mask(start, size: int, bound: int | None, axis: int):
    """[size, 1] or [1, size] mask of start + i < bound; None when no bound applies."""
    if bound is None:
        return None
    shape = (size, 1) if axis == 0 else (1, size)
    return start + lax.broadcasted_iota(jnp.int32, shape, axis) < bound


def _and(x, y):
    if x is None:
        return y
    return x if y is None else x & y


def _load_tile(ref, row0, rows: int, col0, cols: int, row_bound, col_bound):
    """ref[row0:row0+rows, col0:col0+cols]; elements at or past a bound read as 0.

    A bound of None means the window never passes the end on that axis (known statically), so
    the load stays unmasked.
    """
    index = (pl.ds(row0, rows), pl.ds(col0, cols))
    mask = _and(_bounds_mask(row0, rows, row_bound, 0), _bounds_mask(col0, cols, col_bound, 1))
    if mask is None:
        return ref[index]
    return plgpu.load(ref.at[index], mask=mask, other=0)


def _store_tile(ref, row0, col0, value, row_bound, col_bound, lead=()):
    """ref[*lead, row0:row0+rows, col0:col0+cols] = value, skipping elements past a bound."""
    rows, cols = value.shape
    index = (*lead, pl.ds(row0, rows), pl.ds(col0, cols))
    mask = _and(_bounds_mask(row0, rows, row_bound, 0), _bounds_mask(col0, cols, col_bound, 1))
    if mask is None:
        ref[index] = value
    else:
        plgpu.store(ref.at[index], value, mask=mask)


def _load_bias(bias_ref, n0, bn: int, n_bound):
    """bias[n0:n0+bn] as a [1, bn] fp32 row."""
    index = pl.ds(n0, bn)
    if n_bound is None:
        bias = bias_ref[index]
    else:
        mask = n0 + lax.broadcasted_iota(jnp.int32, (bn,), 0) < n_bound
        bias = plgpu.load(bias_ref.at[index], mask=mask, other=0)
    return bias.astype(jnp.float32)[None, :]


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------

def _matmul_kernel(a_ref, b_ref, *refs, m: int, n: int, k: int, config: MatmulConfig,
                   transpose_a: bool, transpose_b: bool, has_bias: bool, num_captures: int,
                   epilogue: TracedFunction | None, save_preact: bool):
    bias_ref = refs[0] if has_bias else None
    capture_refs = refs[int(has_bias):int(has_bias) + num_captures]
    out_refs = refs[int(has_bias) + num_captures:]
    bm, bn, bk, split_k = config.block_m, config.block_n, config.block_k, config.split_k

    # ---- which tile, which K range --------------------------------------------------------------
    pid_m, pid_n = _grouped_tile(pl.program_id(0), _cdiv(m, bm), _cdiv(n, bn), config.group_m)
    m0 = pl.multiple_of(pid_m * bm, bm)
    n0 = pl.multiple_of(pid_n * bn, bn)
    m_bound = m if m % bm else None
    n_bound = n if n % bn else None
    full_k_steps, k_tail = divmod(k, bk)

    def load_a(k0, k_bound):
        if transpose_a:  # A is stored [K, M]
            return _load_tile(a_ref, k0, bk, m0, bm, k_bound, m_bound)
        return _load_tile(a_ref, m0, bm, k0, bk, m_bound, k_bound)

    def load_b(k0, k_bound):
        if transpose_b:  # B is stored [N, K]
            return _load_tile(b_ref, n0, bn, k0, bk, n_bound, k_bound)
        return _load_tile(b_ref, k0, bk, n0, bn, k_bound, n_bound)

    def k_step(step, acc, k_bound=None):
        # A static start past the end would be rejected at trace time, so the tail's is traced.
        k0 = jnp.int32(step * bk) if isinstance(step, int) else pl.multiple_of(step * bk, bk)
        dims = (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))
        return acc + lax.dot_general(load_a(k0, k_bound), load_b(k0, k_bound), dims,
                                     preferred_element_type=jnp.float32)

    # ---- main loop: whole K steps unmasked, then the ragged tail --------------------------------
    acc = jnp.zeros((bm, bn), jnp.float32)
    if split_k == 1:
        acc = lax.fori_loop(0, full_k_steps, k_step, acc)
        if k_tail:
            acc = k_step(full_k_steps, acc, k_bound=k)
    else:
        steps_per_split = _cdiv(_cdiv(k, bk), split_k)
        first = pl.program_id(1) * steps_per_split
        acc = lax.fori_loop(first, jnp.minimum(first + steps_per_split, full_k_steps), k_step, acc)
        if k_tail:
            owns_tail = (first <= full_k_steps) & (full_k_steps < first + steps_per_split)
            acc = lax.cond(owns_tail, lambda a: k_step(full_k_steps, a, k_bound=k),
                           lambda a: a, acc)
        _store_tile(out_refs[0], m0, n0, acc, m_bound, n_bound, lead=(pl.program_id(1),))
        return

    # ---- epilogue on the fp32 tile ----------------------------------------------------------------
    if has_bias:
        acc = acc + _load_bias(bias_ref, n0, bn, n_bound)
    out_ref = out_refs[0]
    if save_preact:
        _store_tile(out_refs[1], m0, n0, acc, m_bound, n_bound)
    if epilogue is not None:
        rows = m0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        cols = n0 + lax.broadcasted_iota(jnp.int32, (1, bn), 1)
        captures = [ref[...] for ref in capture_refs]
        acc = epilogue(captures, acc, rows, cols)[0]
    _store_tile(out_ref, m0, n0, acc.astype(out_ref.dtype), m_bound, n_bound)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------

def matmul(a: jax.Array, b: jax.Array, bias: jax.Array | None, captures: Sequence[Any], *,
           config: MatmulConfig, out_dtype, transpose_a: bool = False, transpose_b: bool = False,
           epilogue: TracedFunction | None = None, save_preact: bool = False,
           interpret: bool = False):
    """op(a) @ op(b) (+ bias[None, :]) then epilogue, on 2-D operands.

    a: [M, K] ([K, M] if transpose_a); b: [K, N] ([N, K] if transpose_b); bias: [N] or None.
    Returns out [M, N] of out_dtype, plus the fp32 pre-epilogue values if save_preact (kept
    in fp32 for the backward: the epilogue's derivative at a rounded input loses precision).
    With config.split_k > 1, bias and epilogue must be None and the result is the fp32 partial
    sums [split_k, M, N], to be added by the caller.
    """
    m = a.shape[1] if transpose_a else a.shape[0]
    k = a.shape[0] if transpose_a else a.shape[1]
    n = b.shape[0] if transpose_b else b.shape[1]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if config.split_k > 1 and (bias is not None or epilogue is not None or save_preact):
        raise ValueError("split_k > 1 returns partial sums: apply bias and epilogue after.")

    # The interpreter cannot take a window larger than a whole dimension (the GPU's masked loads
    # can), so there, dims smaller than their block are zero-padded. The kernel keeps the true
    # sizes, so masks and results are the same; outputs are cut back below.
    def fit(x, blocks):
        if not interpret:
            return x
        return jnp.pad(x, [(0, max(0, blk - dim)) for dim, blk in zip(x.shape, blocks)])

    a = fit(a, (bk, bm) if transpose_a else (bm, bk))
    b = fit(b, (bn, bk) if transpose_b else (bk, bn))
    out_m, out_n = (max(m, bm), max(n, bn)) if interpret else (m, n)
    if config.split_k > 1:
        out_shape = [jax.ShapeDtypeStruct((config.split_k, out_m, out_n), jnp.float32)]
        grid = (_cdiv(m, bm) * _cdiv(n, bn), config.split_k)
    else:
        out_shape = [jax.ShapeDtypeStruct((out_m, out_n), out_dtype)]
        if save_preact:
            out_shape.append(jax.ShapeDtypeStruct((out_m, out_n), jnp.float32))
        grid = (_cdiv(m, bm) * _cdiv(n, bn),)

    kernel = functools.partial(
        _matmul_kernel, m=m, n=n, k=k, config=config, transpose_a=transpose_a,
        transpose_b=transpose_b, has_bias=bias is not None, num_captures=len(captures),
        epilogue=epilogue, save_preact=save_preact)
    operands = [a, b] + ([fit(bias, (bn,))] if bias is not None else []) + list(captures)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="jattn_matmul" if config.split_k == 1 else "jattn_matmul_split_k",
    )(*operands)
    outs = [out[..., :m, :n] for out in outs]
    return outs[0] if len(outs) == 1 else tuple(outs)

