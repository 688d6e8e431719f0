"""Context parallelism without a ring: the keys gathered, or the heads traded for the sequence.

- "all_gather": every device gathers the whole sequence's K/V in one all-gather (small with
  GQA's few kv heads) and attends its own queries to them, with the BlockMask's rows of its
  query blocks; the backward's dK/dV parts are summed onto their shards by the all-gather's
  transpose, a reduce-scatter.
- "heads" (Ulysses): an all-to-all trades each device's sequence shard of every head for the
  whole sequence of 1/n of the heads; flex_attention runs there with the BlockMask's rows of
  those heads, and a second all-to-all returns the output and LSE to sequence shards. The
  backward is the same exchanges transposed.
Both differentiate through flex_attention's own custom_vjp (mods read the arrays they close
over directly), and see global positions, heads and per-token arrays, as the ring's do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.attention.api import flex_attention
from jattn._src.masks.block_mask import BlockMask
from jattn._src.ring import blocks
from jattn._src.ring.layout import from_zigzag, global_positions, to_zigzag


def _whole_sequence(x, axis_name: str, layout: str, axis: int):
    """The whole sequence of the devices' shards x (along `axis`), in its original order."""
    whole = lax.all_gather(x, axis_name, axis=axis, tiled=True)
    return whole if layout == "contiguous" else from_zigzag(whole, lax.axis_size(axis_name),
                                                           axis=axis)


def _bound(score_mod, mask_mod, tokens, query_position=None, head_offset=0):
    """The user's mods reading the whole per-token arrays, with this device's queries at
    their global positions (query_position) and its heads at their global indices."""
    def q_pos(q_idx):
        return q_idx if query_position is None else query_position(q_idx)

    score = None if score_mod is None else (
        lambda s, b, h, q_idx, kv_idx: score_mod(s, b, h + head_offset, q_pos(q_idx), kv_idx,
                                                 *tokens))
    mask = None if mask_mod is None else (
        lambda b, h, q_idx, kv_idx: mask_mod(b, h + head_offset, q_pos(q_idx), kv_idx,
                                             *tokens))
    return score, mask


def all_gather_attention(q, k, v, score_mod, mask_mod, *, axis_name: str, layout: str, scale,
                         enable_gqa: bool, implementation, block_size: int,
                         token_arrays: Sequence[jax.Array], block_mask: BlockMask | None):
    """(out, lse) of this device's queries against the whole sequence's gathered keys."""
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    (B, Hq, Lc, _), L = q.shape, n * q.shape[2]
    k, v = (_whole_sequence(x, axis_name, layout, 2) for x in (k, v))
    tokens = [_whole_sequence(t, axis_name, layout, t.ndim - 1) for t in token_arrays]
    score, mask = _bound(score_mod, mask_mod, tokens,
                         lambda q_idx: global_positions(q_idx, me, n, Lc, layout))
    if block_mask is None:
        local_mask = blocks.built(mask, B, Hq, Lc, L, block_size)
    else:  # the rows of this device's query blocks
        bq = block_mask.block_size[0]
        rows = global_positions(jnp.arange(0, Lc, bq, dtype=jnp.int32), me, n, Lc, layout) // bq
        full = (None if block_mask.full_kv_num_blocks is None
                else block_mask.full_blocks()[..., rows, :])
        local_mask = BlockMask.from_dense_blocks(
            block_mask.partial_blocks()[..., rows, :], full, block_size=block_mask.block_size,
            seq_lengths=(Lc, L), mask_mod=mask)
    return flex_attention(q, k, v, score, local_mask, scale=scale, enable_gqa=enable_gqa,
                          return_lse=True, implementation=implementation)


def heads_attention(q, k, v, score_mod, mask_mod, *, axis_name: str, layout: str, scale,
                    enable_gqa: bool, implementation, block_size: int,
                    token_arrays: Sequence[jax.Array], block_mask: BlockMask | None):
    """(out, lse) of this device's sequence shard, computed as the whole sequence of 1/n of
    the heads on each device."""
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    (B, Hq, Lc, _), Hkv = q.shape, k.shape[1]
    if Hq % n or Hkv % n:
        raise ValueError(f"ring_flex_attention: strategy='heads' splits the heads each device "
                         f"holds over the {n} devices of axis {axis_name!r}, so its Hq={Hq} "
                         f"and Hkv={Hkv} (per device, after sharded_flex_attention's "
                         "head_axis split if any) must both divide by it; use "
                         "strategy='ring' or 'all_gather'.")
    heads, L = Hq // n, n * Lc

    def to_heads(x):  # [B, H, Lc, ...] -> [B, H / n, L, ...], the sequence in order
        x = lax.all_to_all(x, axis_name, 1, 2, tiled=True)
        return x if layout == "contiguous" else from_zigzag(x, n, axis=2)

    def to_shards(x):  # the inverse
        x = x if layout == "contiguous" else to_zigzag(x, n, axis=2)
        return lax.all_to_all(x, axis_name, 2, 1, tiled=True)

    q, k, v = (to_heads(x) for x in (q, k, v))
    tokens = [_whole_sequence(t, axis_name, layout, t.ndim - 1) for t in token_arrays]
    score, mask = _bound(score_mod, mask_mod, tokens, head_offset=me * heads)
    local_mask = (blocks.built(mask, B, heads, L, L, block_size) if block_mask is None
                  else blocks.sliced(block_mask, mask, heads=(me * heads, heads)))
    out, lse = flex_attention(q, k, v, score, local_mask, scale=scale, enable_gqa=enable_gqa,
                              return_lse=True, implementation=implementation)
    return to_shards(out), to_shards(lse)


def attention(strategy: str, q, k, v, score_mod: Callable | None, mask_mod: Callable | None,
              **options):
    """(out, lse) of a strategy other than the ring."""
    run = {"all_gather": all_gather_attention, "heads": heads_attention}[strategy]
    return run(q, k, v, score_mod, mask_mod, **options)
