"""The GEMM kernel in Pallas, lowered to Triton.

One program computes one [block_m, block_n] output tile (or, with split_k, its share of the K
range). Each program sees its A row panel [block_m, K] and B column panel [K, block_n] through
BlockSpecs and walks K in block_k steps. A partial panel at a ragged edge is neither padded nor
masked on the GPU, so every load and store there carries an explicit mask. mm_plus_mm runs the
same kernel with two (A, B) panel pairs, walking the K of each into one accumulator.

Tile order: with group_m == 1 the grid is 2-D (row tiles, column tiles); with group_m > 1 it is
1-D and walks `group_m` row tiles at a time so neighbouring programs share B panels in L2.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn._src.gemm.config import MatmulConfig
from jattn._src.gemm.xla import apply_epilogue
from jattn._src.pallas_triton.masked import both, bounds, load, store
from jattn._src.pallas_triton.compile import compiler_params
from jattn._src.pallas_triton.captured_loads import call_in_kernel
from jattn._src.tiling import cdiv
from jattn._src.user_functions import TracedFunction


# ------------------------------------------------------------------------------------------------
# Tile order
# ------------------------------------------------------------------------------------------------

def _tile_coords(grid_ids: Sequence[Any], tiles_m: int, tiles_n: int, group_m: int):
    """(row tile, column tile) of a program, from its grid indices (split index excluded)."""
    if group_m == 1:
        return grid_ids[0], grid_ids[1]
    tiles_per_group = group_m * tiles_n
    first_m = (grid_ids[0] // tiles_per_group) * group_m
    rows_in_group = jnp.minimum(tiles_m - first_m, group_m)
    within = grid_ids[0] % tiles_per_group
    return first_m + within % rows_in_group, within // rows_in_group


def walk_k(step, k: int, bk: int, split_k: int, split_id, acc):
    """acc after step(i, acc[, k_bound]) over this program's share of the cdiv(k, bk) K steps.

    Whole steps run unmasked along K in a loop, then the ragged tail (if any) with
    k_bound=k. With split_k > 1, program `split_id` of the split owns a contiguous run of steps.
    """
    full_k_steps, k_tail = divmod(k, bk)
    if split_k == 1:
        acc = lax.fori_loop(0, full_k_steps, step, acc)
        return step(full_k_steps, acc, k_bound=k) if k_tail else acc
    steps_per_split = cdiv(cdiv(k, bk), split_k)
    first = split_id * steps_per_split
    acc = lax.fori_loop(first, jnp.minimum(first + steps_per_split, full_k_steps), step, acc)
    if not k_tail:
        return acc
    owns_tail = (first <= full_k_steps) & (full_k_steps < first + steps_per_split)
    return lax.cond(owns_tail, lambda a: step(full_k_steps, a, k_bound=k), lambda a: a, acc)


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------

def _matmul_kernel(*refs, m: int, n: int, ks: tuple[int, ...], config: MatmulConfig,
                   transpose_a: bool, transpose_b: bool, has_bias: bool, num_captures: int,
                   epilogue: TracedFunction | None, save_preact: bool,
                   scale_kinds: tuple[str, ...] = ()):
    operand_refs, refs = refs[:2 * len(ks)], refs[2 * len(ks):]
    scale_refs, refs = refs[:len(scale_kinds)], refs[len(scale_kinds):]
    bias_ref = refs[0] if has_bias else None
    capture_refs = refs[int(has_bias):int(has_bias) + num_captures]
    out_refs = refs[int(has_bias) + num_captures:]
    bm, bn, bk, split_k = config.block_m, config.block_n, config.block_k, config.split_k
    grid_ids = [pl.program_id(axis) for axis in range(2 if config.group_m == 1 else 1)]

    # ---- where this tile sits; which edges need masks (known statically) -----------------------
    pid_m, pid_n = _tile_coords(grid_ids, cdiv(m, bm), cdiv(n, bn), config.group_m)
    m0, n0 = pid_m * bm, pid_n * bn
    m_bound, n_bound = (m if m % bm else None), (n if n % bn else None)
    row_mask, col_mask = bounds(m0, bm, m_bound, 0), bounds(n0, bn, n_bound, 1)

    def k_step(a_ref, b_ref, step, acc, k_bound=None):
        # A static start past the end would be rejected at trace time, so the tail's is traced.
        k0 = jnp.int32(step * bk) if isinstance(step, int) else pl.multiple_of(step * bk, bk)
        if transpose_a:  # A panel is [K, bm]
            a = load(a_ref, (pl.ds(k0, bk), slice(None)),
                      both(bounds(k0, bk, k_bound, 0), bounds(m0, bm, m_bound, 1)))
        else:
            a = load(a_ref, (slice(None), pl.ds(k0, bk)),
                      both(row_mask, bounds(k0, bk, k_bound, 1)))
        if transpose_b:  # B panel is [bn, K]
            b = load(b_ref, (slice(None), pl.ds(k0, bk)),
                      both(bounds(n0, bn, n_bound, 0), bounds(k0, bk, k_bound, 1)))
        else:
            b = load(b_ref, (pl.ds(k0, bk), slice(None)),
                      both(bounds(k0, bk, k_bound, 0), col_mask))
        dims = (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))
        return acc + lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    # ---- main loop; with several operand pairs (mm_plus_mm) each adds into the same acc -------
    acc = jnp.zeros((bm, bn), jnp.float32)
    tile_mask = both(row_mask, col_mask)
    for a_ref, b_ref, k in zip(operand_refs[::2], operand_refs[1::2], ks):
        acc = walk_k(functools.partial(k_step, a_ref, b_ref), k, bk, split_k,
                     split_id=pl.program_id(len(grid_ids)) if split_k > 1 else 0, acc=acc)
    if split_k > 1:  # fp32 partial sums; the caller adds them and applies the rest
        store(out_refs[0], ..., acc, tile_mask)
        return

    # ---- epilogue on the fp32 tile --------------------------------------------------------------
    # Scales come first (bias is in output units); each is a [bm, 1], [1, bn] or [1, 1] tile.
    scale_masks = {"row": row_mask, "col": col_mask, "tensor": None}
    for kind, scale_ref in zip(scale_kinds, scale_refs):
        acc = acc * load(scale_ref, ..., scale_masks[kind])
    if has_bias:
        bias_mask = None if col_mask is None else col_mask[0]
        acc = acc + load(bias_ref, ..., bias_mask).astype(jnp.float32)[None, :]
    if save_preact:
        store(out_refs[1], ..., acc, tile_mask)
    if epilogue is not None:
        rows = m0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        cols = n0 + lax.broadcasted_iota(jnp.int32, (1, bn), 1)
        acc = call_in_kernel(epilogue, capture_refs, acc, rows, cols)[0]
    store(out_refs[0], ..., acc.astype(out_refs[0].dtype), tile_mask)


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
    if config.split_k > 1 and (bias is not None or epilogue is not None or save_preact):
        raise ValueError("split_k > 1 returns partial sums: apply bias and epilogue after.")
    return _launch([(a, b)], bias, captures, config=config, out_dtype=out_dtype,
                   transpose_a=transpose_a, transpose_b=transpose_b, epilogue=epilogue,
                   save_preact=save_preact, interpret=interpret,
                   name="jattn_matmul" if config.split_k == 1 else "jattn_matmul_split_k")


def mm_plus_mm(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array, bias: jax.Array | None,
               captures: Sequence[Any], *, config: MatmulConfig, out_dtype,
               epilogue: TracedFunction | None = None, save_preact: bool = False,
               interpret: bool = False):
    """a @ b + c @ d (+ bias[None, :]) then epilogue, one fp32 accumulator, one kernel.

    a: [M, K1], b: [K1, N], c: [M, K2], d: [K2, N] (K1 and K2 may differ); bias: [N] or None.
    Returns as `matmul` does; config.split_k must be 1.
    """
    if config.split_k != 1:
        raise ValueError(f"mm_plus_mm runs without split-K, got split_k={config.split_k}.")
    return _launch([(a, b), (c, d)], bias, captures, config=config, out_dtype=out_dtype,
                   epilogue=epilogue, save_preact=save_preact, interpret=interpret,
                   name="jattn_mm_plus_mm")


# use_fast_accum=False: fp8 partial sums are promoted into the float32 accumulator at least
# every this many K elements (DeepSeek's DeepGEMM promotes every 128).
FP8_PROMOTION_INTERVAL = 128


def scaled_matmul(a: jax.Array, b: jax.Array, scale_a: jax.Array, scale_b: jax.Array,
                  bias: jax.Array | None, *, config: MatmulConfig, out_dtype,
                  use_fast_accum: bool = False, interpret: bool = False):
    """(a @ b) * scale_a * scale_b (+ bias[None, :]) on fp8 operands, fp32 accumulation.

    a: [M, K], b: [K, N], both the same float8 dtype; scale_a: [M, 1] (row-wise) or [1, 1]
    (tensor-wise) float32; scale_b: [1, N] or [1, 1] float32; bias: [N] or None. Returns
    [M, N] of out_dtype; config.split_k must be 1.

    The kernel reads b as its transpose [N, K]: Hopper's fp8 tensor-core MMA takes both
    operands K-major, and a row-major [K, N] panel would be transposed on chip every K step.
    When b is itself a transpose (weights stored [N, K]), XLA cancels the two under jit.

    Accumulation (compiled by the `triton` package, which sets Triton's fp8 knob that Pallas
    does not expose): use_fast_accum leaves it to the tensor core's reduced-precision
    accumulator throughout; otherwise partial sums are promoted into the float32 accumulator
    every min(block_k, FP8_PROMOTION_INTERVAL) K elements. Without `triton`, XLA's compiler
    runs Pallas' default, which promotes after every MMA instruction and is far slower.
    """
    if config.split_k != 1:
        raise ValueError(f"scaled_matmul runs without split-K, got split_k={config.split_k}.")
    scales = [("tensor" if scale_a.size == 1 else "row", scale_a),
              ("tensor" if scale_b.size == 1 else "col", scale_b)]
    promotion = 2**30 if use_fast_accum else min(config.block_k, FP8_PROMOTION_INTERVAL)
    return _launch([(a, b.T)], bias, (), config=config, out_dtype=out_dtype, epilogue=None,
                   save_preact=False, interpret=interpret, name="jattn_scaled_matmul",
                   transpose_b=True, scales=scales, max_num_imprecise_acc=promotion)


def tile_grid(m: int, n: int, config: MatmulConfig):
    """(grid, rows, cols) of an [m, n] output: rows(*ids) and cols(*ids) give a program's row
    and column tile (for BlockSpec index maps); the last grid axis is the split with split_k > 1.
    """
    tiles = (cdiv(m, config.block_m), cdiv(n, config.block_n))
    grid = tiles if config.group_m == 1 else (tiles[0] * tiles[1],)
    tile_axes = len(grid)
    if config.split_k > 1:
        grid = (*grid, config.split_k)

    def rows(*ids):
        return _tile_coords(ids[:tile_axes], *tiles, config.group_m)[0]

    def cols(*ids):
        return _tile_coords(ids[:tile_axes], *tiles, config.group_m)[1]

    return grid, rows, cols


def tile_outputs(m: int, n: int, config: MatmulConfig, out_dtype, rows, cols, *,
                 save_preact: bool = False):
    """(out_shape, out_specs): [m, n] of out_dtype (and its fp32 pre-epilogue twin if
    save_preact), or with split_k > 1 the fp32 partial sums [split_k, m, n]."""
    bm, bn = config.block_m, config.block_n
    if config.split_k > 1:
        return ([jax.ShapeDtypeStruct((config.split_k, m, n), jnp.float32)],
                [pl.BlockSpec((None, bm, bn), lambda *ids: (ids[-1], rows(*ids), cols(*ids)))])
    tile_spec = pl.BlockSpec((bm, bn), lambda *ids: (rows(*ids), cols(*ids)))
    dtypes = [out_dtype] + ([jnp.float32] if save_preact else [])
    return [jax.ShapeDtypeStruct((m, n), dtype) for dtype in dtypes], [tile_spec] * len(dtypes)


def _launch(pairs: Sequence[tuple[jax.Array, jax.Array]], bias, captures, *,
            config: MatmulConfig, out_dtype, epilogue, save_preact: bool, interpret: bool,
            name: str, transpose_a: bool = False, transpose_b: bool = False,
            scales: Sequence[tuple[str, jax.Array]] = (),
            max_num_imprecise_acc: int | None = None):
    """Sum of op(a) @ op(b) over `pairs` (same M and N, each its own K) in one pallas_call.

    scales: (kind, array) pairs multiplied into the fp32 tile before the bias: "row" [M, 1],
    "col" [1, N] or "tensor" [1, 1]. max_num_imprecise_acc: Triton's fp8 accumulation knob (see
    pallas_triton.compile).

    Compiler: the `triton` package where installed, except for kernels with a user epilogue.
    On the H100 (benchmarks/HISTORY.md), without an epilogue its code runs level with XLA's
    compile of the same kernel at every bench_matmul shape, with bitwise equal results (and
    interop can then launch it without JAX); with the gelu epilogue it is slower.
    """
    a, b = pairs[0]
    m = a.shape[1] if transpose_a else a.shape[0]
    n = b.shape[0] if transpose_b else b.shape[1]
    ks = tuple(x.shape[0] if transpose_a else x.shape[1] for x, _ in pairs)
    bm, bn = config.block_m, config.block_n

    grid, rows, cols = tile_grid(m, n, config)
    in_specs = []
    for k in ks:
        # Panels span all of K, rounded up to whole K steps: a window past the end is masked on
        # the GPU, and the interpreter pads the panel instead of rejecting the window.
        k_span = cdiv(k, config.block_k) * config.block_k
        in_specs += [
            pl.BlockSpec((k_span, bm), lambda *ids: (0, rows(*ids))) if transpose_a
            else pl.BlockSpec((bm, k_span), lambda *ids: (rows(*ids), 0)),
            pl.BlockSpec((bn, k_span), lambda *ids: (cols(*ids), 0)) if transpose_b
            else pl.BlockSpec((k_span, bn), lambda *ids: (0, cols(*ids))),
        ]
    scale_specs = {
        "row": pl.BlockSpec((bm, 1), lambda *ids: (rows(*ids), 0)),
        "col": pl.BlockSpec((1, bn), lambda *ids: (0, cols(*ids))),
        "tensor": pl.BlockSpec((1, 1), lambda *ids: (0, 0)),
    }
    in_specs += [scale_specs[kind] for kind, _ in scales]
    if bias is not None:
        in_specs.append(pl.BlockSpec((bn,), lambda *ids: (cols(*ids),)))
    # Captured arrays stay whole in memory; the epilogue reads the elements it indexes.
    in_specs += [pl.BlockSpec(c.shape, lambda *ids, nd=jnp.ndim(c): (0,) * nd) for c in captures]

    out_shape, out_specs = tile_outputs(m, n, config, out_dtype, rows, cols,
                                        save_preact=save_preact)
    kernel = functools.partial(
        _matmul_kernel, m=m, n=n, ks=ks, config=config, transpose_a=transpose_a,
        transpose_b=transpose_b, has_bias=bias is not None, num_captures=len(captures),
        epilogue=epilogue, save_preact=save_preact,
        scale_kinds=tuple(kind for kind, _ in scales))
    operands = [x for pair in pairs for x in pair] + [x for _, x in scales]
    operands += ([bias] if bias is not None else []) + list(captures)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=compiler_params(
            config.num_warps, config.num_stages,
            compiler="xla" if epilogue is not None and max_num_imprecise_acc is None
            else "triton", max_num_imprecise_acc=max_num_imprecise_acc),
        interpret=interpret,
        name=name,
    )(*operands)
    return outs[0] if len(outs) == 1 else tuple(outs)


# ------------------------------------------------------------------------------------------------
# The ops' entry points (gemm/protocols.py: MatmulBackend, MmPlusMmBackend, ScaledBackend)
# ------------------------------------------------------------------------------------------------

def matmul_product(a: jax.Array, b: jax.Array, bias: jax.Array | None, captures: Sequence[Any],
                   *, config: MatmulConfig, out_dtype, transpose_a: bool = False,
                   transpose_b: bool = False, epilogue_tile: TracedFunction | None = None,
                   epilogue_full: TracedFunction | None = None, save_preact: bool = False,
                   interpret: bool = False):
    """MatmulBackend.matmul_product: one kernel, or with config.split_k > 1 the kernel's partial
    sums added, then the bias and the epilogue (traced at [M, N]) on the whole product."""
    transposes = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    if config.split_k == 1:
        return matmul(a, b, bias, captures, config=config, out_dtype=out_dtype,
                      epilogue=epilogue_tile, save_preact=save_preact, interpret=interpret,
                      **transposes)
    partials = matmul(a, b, None, (), config=config, out_dtype=out_dtype, interpret=interpret,
                      **transposes)
    return apply_epilogue(partials.sum(axis=0), bias, captures, epilogue_full, out_dtype,
                          save_preact)


def mm_plus_mm_product(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array,
                       bias: jax.Array | None, captures: Sequence[Any], *,
                       config: MatmulConfig, out_dtype,
                       epilogue_tile: TracedFunction | None = None, epilogue_full=None,
                       save_preact: bool = False, interpret: bool = False):
    """MmPlusMmBackend.mm_plus_mm_product."""
    del epilogue_full
    return mm_plus_mm(a, b, c, d, bias, captures, config=config, out_dtype=out_dtype,
                      epilogue=epilogue_tile, save_preact=save_preact, interpret=interpret)


def scaled_product(a: jax.Array, b: jax.Array, scale_a: jax.Array, scale_b: jax.Array,
                   bias: jax.Array | None, *, config: MatmulConfig, out_dtype,
                   use_fast_accum: bool = False, interpret: bool = False):
    """ScaledBackend.scaled_product."""
    return scaled_matmul(a, b, scale_a, scale_b, bias, config=config, out_dtype=out_dtype,
                         use_fast_accum=use_fast_accum, interpret=interpret)
