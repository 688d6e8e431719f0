"""One (query shard, key shard) pair of the ring: its mods on global positions, and what they
read.

The ring's custom_vjp cannot differentiate arrays its mods close over, so the arrays the user's
mods capture become the ring's explicit arguments (`captured_arrays`) and each pair's mods read
them from there (`reading`: the user's function traced at each call's shapes, its captured
arrays swapped for the arguments). Per-token arrays (document ids) are sharded like q; the mods
see each over the whole sequence (`token_view`), filled at this device's positions and at
those of the shard in hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn._src.masks.block_mask import BlockMask
from jattn._src.masks.create import create_block_mask
from jattn._src.mesh_axes import aligned
from jattn._src.ring.layout import global_positions
from jattn._src.ring.schedule import runs
from jattn._src.user_functions import CaptureSet, TracedFunction


def _index(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _struct(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def captured_arrays(fn: Callable[..., Any] | None, signature: Sequence[Any]) -> list[Any]:
    """The arrays `fn` closes over, found by tracing it at `signature`."""
    if fn is None:
        return []
    capture_set = CaptureSet()
    capture_set.trace(fn, signature)
    return capture_set.captures


def reading(fn: Callable[..., Any], original_ids: Sequence[int],
            replacements: Sequence[Any]) -> Callable[..., Any]:
    """`fn` reading replacements[i] wherever it closes over the array whose id() is
    original_ids[i]; traced anew at each call's argument shapes."""
    slot_of: dict[int, int] = {}
    for slot, original in enumerate(original_ids):
        slot_of.setdefault(original, slot)

    def rebound(*args):
        # (a fresh function: make_jaxpr caches a trace by the function's identity)
        closed = jax.make_jaxpr(lambda *a: fn(*a))(*(_struct(x) for x in args))
        captures, slots = list(replacements), []
        for const in closed.consts:
            slot = slot_of.get(id(const))
            if slot is None:  # an array the trace at the ring's own signature did not meet
                slot = len(captures)
                captures.append(const)
            slots.append(slot)
        return TracedFunction(closed, tuple(slots))(captures, *args)[0]

    return rebound


@dataclasses.dataclass(frozen=True, eq=False)
class RingMods:
    """The user's mods, the ids of the arrays they capture (read, in the ring, from its
    `score_captures` / `mask_captures` arguments) and the shape of the per-token arrays."""

    score_mod: Callable[..., jax.Array] | None
    mask_mod: Callable[..., jax.Array] | None
    score_ids: tuple[int, ...]
    mask_ids: tuple[int, ...]
    uses_batch: bool
    uses_head: bool

    @classmethod
    def of(cls, score_mod, mask_mod, token_views: Sequence[jax.ShapeDtypeStruct]):
        """RingMods and the arrays (score_mod's, mask_mod's) they capture."""
        tokens = list(token_views)
        score_caps = captured_arrays(score_mod, [jax.ShapeDtypeStruct((1, 1), jnp.float32),
                                                 _index(), _index(), _index(1, 1),
                                                 _index(1, 1), *tokens])
        mask_caps = captured_arrays(mask_mod, [_index(), _index(), _index(1, 1), _index(1, 1),
                                               *tokens])
        uses_b, uses_h = (False, False) if mask_mod is None else uses_batch_or_head(
            mask_mod, tokens)
        return cls(score_mod, mask_mod, tuple(map(id, score_caps)), tuple(map(id, mask_caps)),
                   uses_b, uses_h), score_caps, mask_caps


def uses_batch_or_head(mask_mod: Callable[..., Any],
                       extra_args: Sequence[Any] = ()) -> tuple[bool, bool]:
    """Whether mask_mod's result depends on its b and h arguments (the BlockMask then needs
    those axes; otherwise one row of blocks serves every batch and head): called on indices
    of distinct broadcast shapes, its result has an axis of each argument it uses."""
    shape = jax.eval_shape(lambda *args: mask_mod(*args),  # (fresh: not cached by identity)
                           _index(2, 1, 1, 1), _index(1, 3, 1, 1), _index(1, 1, 5, 1),
                           _index(1, 1, 1, 7), *extra_args).shape
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    return padded[0] == 2, padded[1] == 3


def token_view(local: jax.Array, in_hand: jax.Array, q_positions: jax.Array,
               kv_positions: jax.Array, length: int) -> jax.Array:
    """A per-token array over the whole sequence (last axis `length`) holding this device's
    shard `local` at its global positions and the shard in hand at the keys' (zeros
    elsewhere: no mod call asks for those)."""
    view = aligned(jnp.zeros(local.shape[:-1] + (length,), local.dtype), local, in_hand)[0]
    return view.at[..., kv_positions].set(in_hand).at[..., q_positions].set(local)


# The pairs' mods state the ranges of their device indices and per-block shifts with
# `lax.clamp`, so that the Mosaic GPU kernels see the global positions as shifted q_idx /
# kv_idx and read captured arrays along them (document ids) with vector loads.


def _bounded(device, num_devices: int):
    """A device index (traced, or a constant) with its range stated."""
    if isinstance(device, int):
        return device
    typed = np.dtype(device.dtype).type  # (int64 constants where x64 is enabled)
    return lax.clamp(typed(0), device, typed(num_devices - 1))


def _in_shard(index, local: np.ndarray | None):
    """The shard positions of indices into the `local` positions of a shard (sorted, whole
    blocks; None: the whole shard, in order): the index shifted by its block's offset."""
    if local is None:
        return index
    block = int(np.gcd.reduce([int(x) for run in runs(local) for x in (run[0], run.size)]))
    shifts = (local[::block] - np.arange(0, local.size, block)) // block
    typed = np.dtype(index.dtype).type
    shift = lax.clamp(typed(shifts.min()), jnp.asarray(shifts, index.dtype)[
        lax.div(index, typed(block))], typed(shifts.max()))
    return index + shift * typed(block)


@dataclasses.dataclass(frozen=True)
class Pair:
    """The mods of attending this device's queries to the key shard of device `origin`."""

    score: Callable[..., jax.Array] | None
    mask: Callable[..., jax.Array] | None

    @classmethod
    def make(cls, mods: RingMods, *, me, origin, num_devices: int, shard: int, layout: str,
             score_caps, mask_caps, tokens: Sequence[jax.Array],
             tokens_in_hand: Sequence[jax.Array], kv_local: np.ndarray | None = None,
             q_local: np.ndarray | None = None) -> Pair:
        """kv_local: the positions in origin's shard of the keys in hand, where they are
        some of its blocks (None: all of it, in order); q_local: likewise the positions in
        this device's shard of the queries attended."""
        local = jnp.arange(shard, dtype=jnp.int32)
        q_at = global_positions(local, me, num_devices, shard, layout)
        kv_at = global_positions(local if kv_local is None else jnp.asarray(kv_local), origin,
                                 num_devices, shard, layout)
        views = [token_view(mine, theirs, q_at, kv_at, num_devices * shard)
                 for mine, theirs in zip(tokens, tokens_in_hand)]

        def q_pos(q_idx):
            return global_positions(_in_shard(q_idx, q_local), _bounded(me, num_devices),
                                    num_devices, shard, layout)

        def kv_pos(kv_idx):
            return global_positions(_in_shard(kv_idx, kv_local), _bounded(origin, num_devices),
                                    num_devices, shard, layout)

        score = mask = None
        if mods.score_mod is not None:
            user_score = reading(mods.score_mod, mods.score_ids, score_caps)
            score = lambda s, b, h, q_idx, kv_idx: user_score(  # noqa: E731
                s, b, h, q_pos(q_idx), kv_pos(kv_idx), *views)
        if mods.mask_mod is not None:
            user_mask = reading(mods.mask_mod, mods.mask_ids, mask_caps)
            mask = lambda b, h, q_idx, kv_idx: user_mask(  # noqa: E731
                b, h, q_pos(q_idx), kv_pos(kv_idx), *views)
        return cls(score, mask)

    def block_mask(self, mods: RingMods, B: int, Hq: int, shard: int,
                   block_size: int) -> BlockMask | None:
        """The pair's BlockMask built from its mask (None: every key attends)."""
        if self.mask is None:
            return None
        return create_block_mask(self.mask, B if mods.uses_batch else None,
                                 Hq if mods.uses_head else None, shard, shard,
                                 block_size=block_size)

    def cut_block_mask(self, tables: tuple[jax.Array, jax.Array | None], *, me, origin,
                       num_devices: int, shard: int, layout: str, block_size: tuple[int, int],
                       kv_local: np.ndarray | None = None,
                       q_local: np.ndarray | None = None) -> BlockMask:
        """The pair's BlockMask cut from the whole sequence's dense block tables (partial,
        full): the rows of this device's query blocks and the columns of the key blocks in
        hand (kv_local, q_local: their positions in the shards, whole blocks; None: all of
        the shard). No mask is evaluated."""
        def block_starts(device, block, local):
            starts = (jnp.arange(0, shard, block, dtype=jnp.int32) if local is None
                      else jnp.asarray(local[::block]))
            return global_positions(starts, device, num_devices, shard, layout) // block

        rows = block_starts(me, block_size[0], q_local)
        columns = block_starts(origin, block_size[1], kv_local)
        partial, full = (None if t is None else t[..., rows[:, None], columns[None, :]]
                         for t in tables)
        lengths = tuple(shard if local is None else len(local) for local in (q_local, kv_local))
        return BlockMask.from_dense_blocks(partial, full, block_size=block_size,
                                           seq_lengths=lengths, mask_mod=self.mask)


def visited_blocks(block_mask: BlockMask | None) -> jax.Array:
    """How many blocks a pair's BlockMask visits (1 without one: every key attends)."""
    if block_mask is None:
        return jnp.int32(1)
    lists = block_mask.lists()
    blocks = lists.kv_num_blocks.sum()
    if lists.has_full:
        blocks = blocks + lists.full_kv_num_blocks.sum()
    return blocks
