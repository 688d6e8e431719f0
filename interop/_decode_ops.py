"""jattn::flex_decode: `jattn.flex_decode` as a torch custom op, on a contiguous or paged cache,
and the index work of `PagedKVCache.assign`.

Inference only, decided in the forward: with grad mode on, an input that requires grad raises
before anything runs (`check_no_grad`), in eager mode and under torch.compile alike. A backward
formula that raises could not defer the error to backward() either: torch.compile traces it
while compiling any graph whose inputs require grad (tried, torch 2.13).

Values are checked where the host has them for free: an int kv_len, and kv_len and the page
table on CPU tensors, raise ValueError when out of range. CUDA tensors are not read back (the host
would wait for the GPU on every call): as `jattn.flex_decode` under jit, a sequence whose kv_len
is outside [0, S] or reaches an unassigned page comes out NaN, and nothing is read out of bounds.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import torch
from torch import Tensor

import jattn
from . import _ops
from ._dlpack import run, same_device, to_torch

_FN = "flex_decode"

# ------------------------------------------------------------------------------------------------
# Checks made on the torch side
# ------------------------------------------------------------------------------------------------


def check_no_grad(tensors: tuple[Tensor, ...]) -> None:
    """Raises NotImplementedError when grad mode is on and a tensor (q, k, v, then captured
    tensors) requires grad."""
    if not _ops.needs_autograd(tensors):
        return
    names = ("q", "k", "v", *(f"captured tensor {i}" for i in range(len(tensors) - 3)))
    names = [name for name, t in zip(names, tensors) if t.requires_grad]
    if names:
        raise NotImplementedError(
            "flex_decode is inference-only (no gradient), but grad mode is on and these "
            f"require grad: {', '.join(names)}. "
            "Call it under torch.no_grad() or torch.inference_mode(), or detach the inputs; to "
            "train, use jattn.torch.flex_attention (same q, k, v, score_mod and BlockMask).")


def kv_len_tensor(kv_len, q: Tensor, S: int) -> Tensor | None:
    """kv_len as the op takes it: None (every key valid) or an int tensor; an int, checked
    against the cache length S, becomes int32 [B] on q's device."""
    if kv_len is None or isinstance(kv_len, Tensor):
        return kv_len
    if isinstance(kv_len, bool) or not isinstance(kv_len, int):
        raise TypeError(f"flex_decode: `kv_len` must be an int or an int tensor [B], got "
                        f"{type(kv_len).__name__}.")
    if not 0 <= kv_len <= S:
        raise ValueError(_outside_message("kv_len", kv_len, S))
    return torch.full((q.shape[0],), kv_len, dtype=torch.int32, device=q.device)


def _outside_message(name: str, length: int, S: int) -> str:
    return (f"flex_decode: {name} = {length} is outside [0, {S}], the cache length (k's length, "
            "or the paged cache's capacity); grow the cache or clamp kv_len.")


def _check_ranks(q: Tensor, k: Tensor, v: Tensor, page_table: Optional[Tensor]) -> None:
    kind = "pool [Hkv, num_pages, page_size, dim]" if page_table is not None else (
        "cache [B|1, Hkv, S, dim]")
    for name, x, layout in (("q", q, "[B, Hq, Lq, E]"), ("k", k, kind), ("v", v, kind)):
        if x.dim() != 4:
            raise ValueError(f"flex_decode: `{name}` must be a {layout} tensor, got shape "
                             f"{list(x.shape)}.")
    if page_table is not None and (page_table.dim() != 2 or page_table.shape[0] != q.shape[0]):
        raise ValueError(f"flex_decode: the page table must be [B, max_pages] with B = "
                         f"{q.shape[0]} (q's batch), got {list(page_table.shape)}.")


def _check_kv_len(kv_len: Optional[Tensor], B: int) -> None:
    if kv_len is not None and (kv_len.dtype not in (torch.int32, torch.int64) or kv_len.dim() > 1
                               or kv_len.numel() not in (1, B)):
        raise ValueError(f"flex_decode: `kv_len` must be an int, or an int32/int64 tensor [] or "
                         f"[{B}] (q's batch), got {kv_len.dtype} {list(kv_len.shape)}.")


def _check_cpu_lengths(kv_len: Optional[Tensor], page_table: Optional[Tensor], B: int, S: int,
                       page_size: int, num_pages: int) -> None:
    """CPU tensors: kv_len within [0, S] and, with a page table, every entry in
    [-1, num_pages) and every page below kv_len assigned."""
    if kv_len is None and page_table is None:
        return
    lengths = torch.full((B,), S) if kv_len is None else kv_len.long().expand(B)
    outside = ((lengths < 0) | (lengths > S)).nonzero()
    if len(outside):
        b = int(outside[0, 0])
        raise ValueError(_outside_message(f"kv_len[{b}]", int(lengths[b]), S))
    if page_table is not None:
        _check_pages(page_table, lengths, page_size, num_pages)


def check_page_table(fn: str, table: Tensor, num_pages: int) -> None:
    """Raises ValueError for a page-table entry outside [-1, num_pages) (read on the host)."""
    invalid = ((table < -1) | (table >= num_pages)).nonzero()
    if len(invalid):
        b, j = invalid[0].tolist()
        raise ValueError(f"{fn}: page_table[{b}, {j}] = {int(table[b, j])} is outside the pool "
                         f"of {num_pages} pages (use -1 for unassigned).")


def _check_pages(table: Tensor, lengths: Tensor, page_size: int, num_pages: int) -> None:
    check_page_table(_FN, table, num_pages)
    needed = torch.arange(table.shape[1]) < (lengths[:, None] + page_size - 1) // page_size
    unassigned = (needed & (table < 0)).nonzero()
    if len(unassigned):
        b, j = unassigned[0].tolist()
        raise ValueError(f"flex_decode: kv_len[{b}] = {int(lengths[b])} reaches logical page {j} "
                         f"(page size {page_size}), which page_table[{b}] leaves unassigned "
                         "(-1); assign its pages first or lower kv_len.")


# ------------------------------------------------------------------------------------------------
# The op
# ------------------------------------------------------------------------------------------------

_STATIC = ("mods", "block_size", "seq_lengths", "scale", "implementation")
_TENSORS = ("q", "k", "v", "page_table", "kv_len")  # before the mask lists and captures


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode(q, k, v, page_table, kv_len, mask_arrays, captures, *, mods, block_size,
            seq_lengths, scale, implementation):
    """(out, lse) of jattn.flex_decode; with a page table, k and v are a PagedKVCache's pools.
    mask_arrays: the kv-major lists."""
    score, mask = _ops.translated_mods(mods)
    n_score = 0 if score is None else score.n_captures
    score_mod = None if score is None else score.bind(captures[:n_score])
    mask_mod = None if mask is None else mask.bind(captures[n_score:])
    block_mask = _ops.jattn_block_mask(mask_arrays, block_size, seq_lengths, mask_mod,
                                       kv_only=True)
    if page_table is not None:
        k, v = jattn.PagedKVCache(k, v, page_table), None
    return jattn.flex_decode(q, k, v, score_mod, block_mask, kv_len=kv_len, scale=scale,
                             return_lse=True, implementation=implementation)


def _decode_forward(q: Tensor, k: Tensor, v: Tensor, page_table: Optional[Tensor],
                    kv_len: Optional[Tensor], mask_tensors: list[Tensor],
                    captures: list[Tensor], mods: str, block_size: list[int],
                    seq_lengths: list[int], scale: Optional[float],
                    implementation: Optional[str]) -> tuple[Tensor, Tensor]:
    """jattn::flex_decode. k, v: a contiguous cache, or with page_table [B, max_pages] int32 the
    pools of a paged one; kv_len: None or int [] / [B]. Returns out [B, Hq, Lq, Ev] (q's dtype)
    and the float32 LSE [B, Hq, Lq]."""
    device, leading, lists, capture_arrays = _ops.ready_op_views(
        _FN, _TENSORS, (q, k, v, page_table, kv_len), mask_tensors, captures,
        kv_only=True)  # the kv-major lists: all the decode kernel reads
    _check_ranks(q, k, v, page_table)
    _check_kv_len(kv_len, q.shape[0])
    if device.type == "cpu":  # CUDA values are not read back (module docstring)
        if page_table is None:
            S, page_size, num_pages = k.shape[2], 0, 0
        else:
            S, page_size, num_pages = page_table.shape[1] * k.shape[2], k.shape[2], k.shape[1]
        _check_cpu_lengths(kv_len, page_table, q.shape[0], S, page_size, num_pages)
    program = functools.partial(
        _decode, mods=mods, block_size=tuple(block_size), seq_lengths=tuple(seq_lengths),
        scale=scale, implementation=_ops.implementation_for(_FN, device, implementation))
    out, lse = run(program, device, *leading, lists, capture_arrays)
    return to_torch(out, device), to_torch(lse, device)


flex_decode_op = torch.library.custom_op("jattn::flex_decode", mutates_args=())(_decode_forward)


@flex_decode_op.register_fake
def _decode_fake(q, k, v, *rest):
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(q.shape[:-1], dtype=torch.float32))


def flex_decode(q: Tensor, k: Tensor, v: Tensor, page_table: Optional[Tensor],
                kv_len: Optional[Tensor], mask_tensors: list[Tensor], captures: list[Tensor],
                *static) -> tuple[Tensor, Tensor]:
    """jattn::flex_decode: the custom-op node under torch.compile; in eager mode its
    implementation, called directly (nothing for autograd to record, and the dispatcher's
    per-call cost saved)."""
    check_no_grad((q, k, v, *captures))
    if torch.compiler.is_compiling():
        return flex_decode_op(q, k, v, page_table, kv_len, mask_tensors, captures, *static)
    return _decode_forward(q, k, v, page_table, kv_len, mask_tensors, captures, *static)


# ------------------------------------------------------------------------------------------------
# Paged cache writes
# ------------------------------------------------------------------------------------------------


def token_slots(k_pages: Tensor, v_pages: Tensor, page_table: Tensor, k: Tensor, v: Tensor,
                positions, batch_idx) -> Tensor:
    """Pool rows (page · page_size + offset, int64 [Bn · Ln], sequence-major) of new tokens k
    [Bn, Hkv, Ln, E], v [Bn, Hkv, Ln, Ev], after the checks of jattn.PagedKVCache.assign; a
    position outside the capacity or on an unassigned page raises (read on the host)."""
    fn = "PagedKVCache.assign"
    same_device(fn, k_pages=k_pages, page_table=page_table, k=k, v=v)
    Hkv, num_pages, page_size, E = k_pages.shape
    if (k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3] or k.shape[1] != Hkv
            or k.shape[3] != E or v.shape[3] != v_pages.shape[3]):
        raise ValueError(f"{fn}: k {list(k.shape)} and v {list(v.shape)} must be [Bn, {Hkv}, "
                         f"Ln, dim] with the pools' dims ({E}, {v_pages.shape[3]}).")
    Bn, _, Ln, _ = k.shape
    rows = page_table if batch_idx is None else page_table[
        torch.as_tensor(batch_idx, device=page_table.device)]
    if rows.shape[0] != Bn:
        raise ValueError(f"{fn}: {Bn} sequences of new tokens but {rows.shape[0]} page-table "
                         "rows (pass batch_idx).")
    positions = torch.as_tensor(positions, device=page_table.device).long()
    if positions.dim() == 1:
        positions = positions[:, None] + torch.arange(Ln, device=positions.device)
    if positions.shape != (Bn, Ln):
        raise ValueError(f"{fn}: positions must be [{Bn}] or [{Bn}, {Ln}], got "
                         f"{list(positions.shape)}.")
    page = torch.take_along_dim(rows.long(), (positions // page_size).clamp(0, rows.shape[1] - 1),
                                dim=1)
    ok = (positions >= 0) & (positions < rows.shape[1] * page_size) & (page >= 0) & (
        page < num_pages)
    bad = (~ok).nonzero()
    if len(bad):
        b, i = bad[0].tolist()
        raise ValueError(f"{fn}: token {i} of sequence {b} goes to position "
                         f"{int(positions[b, i])}, outside the capacity "
                         f"{rows.shape[1] * page_size} or on an unassigned page; assign pages in "
                         "page_table first.")
    return (page * page_size + positions % page_size).reshape(-1)
