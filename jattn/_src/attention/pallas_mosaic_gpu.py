"""flex_attention on Mosaic GPU (Hopper).

The forward kernel (`pallas_mosaic_gpu_fwd`) feeds K/V tiles by TMA to two wgmma warpgroups;
the backward kernels (`pallas_mosaic_gpu_bwd`) do the same for dQ and for dK/dV. Their LSE and
delta follow the convention of the Triton kernels, so pallas_triton's backward runs behind the
forward wherever the Mosaic backward does not (`backward_unsupported` says why). What the
forward supports is narrower than pallas_triton's, and `unsupported` says so; the registry
then falls back with that reason. The mods read captured arrays by element and by position
(`pallas_mosaic_gpu_mods`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jattn._src import hardware
from jattn._src.attention import dropout
from jattn._src.attention import pallas_mosaic_gpu_mods as in_kernel
from jattn._src.attention import pallas_triton
from jattn._src.attention.common import Mods, Problem, trace_mods
from jattn._src.attention.config import AttentionConfig
from jattn._src.masks.block_mask import BlockMask, MaskLists
from jattn._src.user_functions import CaptureSet

CONSUMERS = 2  # consumer warpgroups per program
ROWS = 64  # query rows per consumer warpgroup: one wgmma M
BLOCK = (CONSUMERS * ROWS, 128)  # the BlockMask blocks one program walks: its q and kv tiles
TILE = (ROWS, BLOCK[1])  # the score tile a consumer warpgroup holds, and its mods see
# K/V slots in shared memory by head dim: 3 do not fit at 128 (120 bytes over the limit).
STAGES = {64: 3, 128: 2}
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HEAD_DIMS = (64, 128)


def unsupported(*, dtype=None, head_dim=None, value_dim=None, seq_lengths=None,
                block_size=None, unreadable_capture=None,
                max_scores=False, **facts) -> str | None:
    """Why the Mosaic GPU forward cannot run a call (None when it can)."""
    if not hardware.is_hopper():
        return f"it needs a Hopper GPU (sm_90), not {hardware.device_kind()}."
    if max_scores:
        return "it does not return the rows' largest scores; pallas_triton's forward does."
    if dtype is not None and jnp.dtype(dtype) not in DTYPES:
        return f"it takes bfloat16 or float16 inputs, not {jnp.dtype(dtype)}."
    if head_dim is not None and (head_dim not in HEAD_DIMS or value_dim != head_dim):
        return (f"it takes head dims 64 or 128 with equal q/k and v head dims, not E={head_dim},"
                f" Ev={value_dim}.")
    if block_size is not None and tuple(block_size) != BLOCK:
        return f"it walks BlockMasks of {BLOCK} blocks, not {tuple(block_size)}."
    if seq_lengths is not None and any(n % 128 for n in seq_lengths):
        return f"it takes lengths that are multiples of 128, not L, S = {tuple(seq_lengths)}."
    if unreadable_capture is not None:
        return (f"its mods read captured arrays by element (as `slopes[h]` or `bias[b, h]`) or "
                f"by position along their last dimension (as `doc_ids[b, q_idx]`), and "
                f"{unreadable_capture}; pallas_triton's read any.")
    return None


def unreadable_capture(score_mod, mask_mod, score_captures, mask_captures,
                       seq_lengths: tuple[int, int]) -> str | None:
    """The `unreadable_capture` fact of a call on sequences of `seq_lengths` (L, S): the first
    read of a captured array (the call's `score_captures` and `mask_captures`, found by tracing
    at another shape) that the forward cannot make, described; None when it can make them
    all."""
    mods = trace_mods(score_mod, mask_mod, CaptureSet(score_captures),
                      CaptureSet(mask_captures), *_tile_signature(), with_vjp=False)
    return in_kernel.unreadable(mods, seq_lengths, TILE)


# An eager torch op call runs this forward through JAX (0.7-1.0 ms of host per call in a
# transformers Llama step, H100) and pallas_triton's forward launched directly (0.4 ms); below
# this much attention work (4 * B * Hq * L * S * E, as if dense) this forward saves less GPU
# time than that (it runs 1.1-1.35x pallas_triton's at head dim 128, benchmarks/HISTORY.md). At
# head dim 64 with a score_mod it leads by 1.4-1.5x over a Triton kernel at a third of its
# mod-free rate: there a quarter of the work repays JAX's dispatch.
TORCH_EAGER_MIN_WORK = 10**12


def slower(*, head_dim=None, seq_lengths=None, score_mod=None, torch_eager_work=None,
           **facts) -> str | None:
    """Why the default choice passes this forward over for a call it supports: where
    benchmarks/bench_mosaic_selection.py finds pallas_triton's forward faster (bf16: head dim
    64 below 4096 queries without a score_mod; this forward leads everywhere else, dropout
    included (bench_features); numbers in benchmarks/HISTORY.md), and for an eager torch op
    call (`torch_eager_work`: its work) too small to repay going through JAX."""
    if head_dim == 64 and seq_lengths is not None and seq_lengths[0] < 4096 and not score_mod:
        return ("pallas_triton's forward is faster at head dim 64 below 4096 queries without a "
                "score_mod (measured 0.94-0.98x).")
    least = TORCH_EAGER_MIN_WORK
    if score_mod and head_dim is not None and head_dim <= 64:
        least //= 4
    if torch_eager_work is not None and torch_eager_work < least:
        return ("an eager torch call launches pallas_triton's forward without JAX's dispatch, "
                "which saves more host time than this forward saves GPU time below "
                f"{least:.1e} attention FLOPs.")
    return None


# The dK/dV kernel's register tile: [keys, queries] of one consumer warpgroup.
DKDV_TILE = (64, 64)


def _tile_signature(tile=TILE):
    index = jax.ShapeDtypeStruct(tile, jnp.int32)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return jax.ShapeDtypeStruct(tile, jnp.float32), (scalar, scalar, index, index)


def backward_unsupported(p: Problem, dq_mods: Mods, dkdv_mods: Mods) -> str | None:
    """Why the Mosaic GPU backward cannot run a call the forward runs (None when it can);
    pallas_triton's backward then runs behind the forward."""
    if p.kv_batch != p.B:
        return (f"it takes k/v with q's batch ({p.B}), not a broadcast batch of "
                f"{p.kv_batch}.")
    for mods, tile in ((dq_mods, TILE), (dkdv_mods, DKDV_TILE)):
        unreadable = in_kernel.unreadable(mods, (p.L, p.S), tile)
        if unreadable is not None:
            return f"{unreadable}."
    return None


def specialise(p: Problem, *, score_mod, mask_mod, score_set: CaptureSet, mask_set: CaptureSet,
               block_mask: BlockMask, config: AttentionConfig | None) -> Problem:
    """p with the Triton backward's config and mods, and the forward's mods traced at the
    Mosaic kernel's register tile (indices as full [64, 128] tiles, b and h scalars)."""
    p = pallas_triton.specialise(p, score_mod=score_mod, mask_mod=mask_mod, score_set=score_set,
                                 mask_set=mask_set, block_mask=block_mask, config=config)
    fwd = trace_mods(score_mod, mask_mod, score_set, mask_set, *_tile_signature(),
                     with_vjp=False)
    # `unsupported` judged the fact cached by the mods' XLA traces; a mod whose reads depend on
    # the shapes it sees may read otherwise at this tile.
    unreadable = in_kernel.unreadable(fwd, (p.L, p.S), TILE)
    if unreadable is not None:
        raise NotImplementedError(f"flex_attention: implementation='pallas_mosaic_gpu' reads "
                                  f"captured arrays by element or by position, and "
                                  f"{unreadable}; use implementation='pallas_triton'.")
    mosaic_backward = tuple(trace_mods(score_mod, mask_mod, score_set, mask_set,
                                       *_tile_signature(tile))
                            for tile in (TILE, DKDV_TILE))
    fallback = backward_unsupported(p, *mosaic_backward)
    if fallback is not None:
        mosaic_backward = None
    return dataclasses.replace(p, fwd=fwd, decode=None, mosaic_backward=mosaic_backward,
                               backward_fallback=fallback,
                               mosaic_dropout=_dropout_keeps(p) if p.dropout else None)


def _dropout_keeps(p: Problem) -> tuple:
    """dropout.kept as keep(b, h, q_idx, kv_idx) reading the call's `dropout.word_tables` (a
    row's word and a key's word, loaded along the tile as a mask_mod's doc_ids[b, q_idx]
    are), traced at the forward and dQ tile and at the dK/dV tile."""
    rows, columns = (jnp.zeros(shape.shape, shape.dtype) for shape in jax.eval_shape(
        lambda: dropout.word_tables(p, jnp.zeros((2,), jnp.uint32))))

    def keep(b, h, q_idx, kv_idx):
        if p.dropout_shared:
            b = h = 0
        return dropout.kept_from_words(p, rows[b, h, q_idx], columns[b, h, kv_idx])

    tables = CaptureSet((rows, columns))
    return tuple(tables.trace(keep, _tile_signature(tile)[1]) for tile in (TILE, DKDV_TILE))


def _dropout_operands(p: Problem, mask_caps) -> tuple[list, list, list]:
    """(the mask_mod's captured arrays, the dropout word tables or [], their avals) of a call
    whose mask captures end with the dropout seed (`dropout.with_seed`)."""
    mask_caps, seed = dropout.split(p, mask_caps)
    tables = [] if seed is None else list(dropout.word_tables(p, seed))
    return list(mask_caps), tables, [jax.typeof(t) for t in tables]


def _kernel_mod(fn, avals, seq_lengths, tile=TILE, *, transposed=False, trailing=0):
    """A traced mod as a kernel calls it: (its captures' refs, *arguments before q_idx,
    the tile's first q and kv positions, *`trailing` arguments after them) -> value."""
    if fn is None:
        return None

    def call(refs, *args):
        *leading, q0, kv0 = args[:len(args) - trailing]
        return in_kernel.call_in_kernel(fn, refs, avals, leading, (q0, kv0), seq_lengths, tile,
                                        transposed=transposed,
                                        trailing=args[len(args) - trailing:])[0]

    return call


def _kernel_operand(array):
    """A captured array as the kernel reads it: flat, bool as int32 (read back as bool)."""
    return array.reshape(-1).astype(jnp.int32 if array.dtype == jnp.bool_ else array.dtype)


def forward(p: Problem, q, k, v, lists: MaskLists, score_caps, mask_caps):
    """(out, lse) as the XLA forward's."""
    # Imported here: JAX's Mosaic GPU modules need absl, which a CPU-only install may lack.
    from jattn._src.attention import pallas_mosaic_gpu_fwd as kernel

    mods: Mods = p.fwd
    mask_caps, tables, table_avals = _dropout_operands(p, mask_caps)
    avals = [jax.typeof(c) for c in (*score_caps, *mask_caps)]
    return kernel.forward(p, lists.has_full, q, k, v, lists.major("kv"),
                          [_kernel_operand(c) for c in score_caps],
                          [_kernel_operand(c) for c in mask_caps],
                          [_kernel_operand(t) for t in tables],
                          _kernel_mod(mods.score, avals[:len(score_caps)], (p.L, p.S)),
                          _kernel_mod(mods.mask, avals[len(score_caps):], (p.L, p.S)),
                          _kernel_mod(p.mosaic_dropout and p.mosaic_dropout[0], table_avals,
                                      (p.L, p.S)))


def tangents(p: Problem, residuals, linear):
    """The outputs' tangents: pallas_triton's kernel (p carries its config and mods)."""
    return pallas_triton.tangents(p, residuals, linear)


def backward(p: Problem, res, d_out, d_lse):
    """(dq, dk, dv, d_score_captures) of the residuals `res` (attention.api)."""
    if p.mosaic_backward is None:
        return pallas_triton.backward(p, res, d_out, d_lse)
    # Imported here, as in `forward`.
    from jattn._src.attention import pallas_mosaic_gpu_bwd as kernel
    from jattn._src.attention import pallas_triton_bwd
    from jattn._src.pallas_triton.compile import compiler_params

    delta, lse2 = pallas_triton_bwd.delta_and_lse2(
        p, res.out, res.lse, d_out, d_lse, compiler_params(4, 1, compiler=p.config.bwd_compiler))
    mask_caps, tables, table_avals = _dropout_operands(p, res.mask_captures)
    score_avals = [jax.typeof(c) for c in res.score_captures]
    mask_avals = [jax.typeof(c) for c in mask_caps]
    keeps = p.mosaic_dropout or (None, None)
    fns = []
    for mods, keep, tile, transposed in zip(p.mosaic_backward, keeps, (TILE, DKDV_TILE),
                                            (False, True)):
        mod = functools.partial(_kernel_mod, seq_lengths=(p.L, p.S), tile=tile,
                                transposed=transposed)
        fns.append((mod(mods.score, score_avals), mod(mods.score_vjp, score_avals, trailing=1),
                    mod(mods.mask, mask_avals), mod(keep, table_avals)))
    dq, dk, dv = kernel.backward(p, res.lists, res.q, res.k, res.v, d_out, lse2, delta,
                                 [_kernel_operand(c) for c in res.score_captures],
                                 [_kernel_operand(c) for c in mask_caps],
                                 [_kernel_operand(t) for t in tables], *fns)
    return dq, dk, dv, pallas_triton.captured_gradients(p, res, d_out, d_lse)
