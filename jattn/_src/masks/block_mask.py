"""BlockMask: which key/value blocks each query block visits, and which need mask_mod.

    kv blocks ->   0   1   2   3        A block is
    q block 0    [ ░ ]                    █ full:    every (q, kv) pair in it attends;
    q block 1    [ █ ][ ░ ]                          the kernel skips mask_mod there
    q block 2    [ █ ][ █ ][ ░ ]          ░ partial: some pairs attend; mask_mod decides
    q block 3    [ █ ][ █ ][ █ ][ ░ ]       (empty): never visited, no work at all
                 (causal, 4x4 blocks)

Field names follow torch.nn.attention.flex_attention.BlockMask so a torch mask maps one-to-one:
`kv_num_blocks[b, h, i]` partial blocks of query block i, listed first in
`kv_indices[b, h, i, :]`; `full_kv_*` the same for full blocks; `q_*` and `full_q_*` are the
transposed (per key/value block) lists that the dK/dV backward walks. B and H of the mask are
1 (broadcast) or the attention's batch and query-head counts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src import function_arrays
from jattn._src.tiling import cdiv

MaskMod = Callable[..., jax.Array]

# torch's default block size; any block size up to it is fine for a short sequence.
DEFAULT_BLOCK = 128


def dense_from_lists(num_blocks: jax.Array, indices: jax.Array, columns: int,
                     xp=jnp) -> jax.Array:
    """[..., rows] counts and [..., rows, columns] lists -> [..., rows, columns] bool table;
    xp=np: computed now by numpy, of known values (outside any trace, an eager shard_map's
    included)."""
    if xp is np:
        num_blocks, indices = np.asarray(num_blocks), np.asarray(indices)
    valid = (xp.arange(indices.shape[-1]) < num_blocks[..., None]) & (indices >= 0) & (
        indices < columns)
    target = xp.where(valid, indices, columns)  # invalid entries land in a spare column
    lead = xp.indices(indices.shape, sparse=True)[:-1]
    if xp is np:
        table = np.zeros(indices.shape[:-1] + (columns + 1,), bool)
        table[(*lead, target)] = True
    else:
        table = jnp.zeros(indices.shape[:-1] + (columns + 1,), bool).at[(*lead, target)].set(
            True)
    return table[..., :columns]


def lists_from_dense(table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., rows, columns] bool -> (counts [..., rows], ascending column lists, set ones first).

    The lists are the stable argsort of ~table, built without a sort: each column is ranked
    among the set (or unset) ones by a cumulative sum and scattered to its rank."""
    table = table.astype(bool)
    num_blocks = table.sum(axis=-1, dtype=jnp.int32)
    set_rank = jnp.cumsum(table, axis=-1, dtype=jnp.int32) - 1
    unset_rank = jnp.cumsum(~table, axis=-1, dtype=jnp.int32) - 1
    rank = jnp.where(table, set_rank, num_blocks[..., None] + unset_rank)
    columns = jnp.broadcast_to(jnp.arange(table.shape[-1], dtype=jnp.int32), table.shape)
    lead = jnp.indices(table.shape, sparse=True)[:-1]
    indices = jnp.zeros(table.shape, jnp.int32).at[(*lead, rank)].set(
        columns, unique_indices=True)
    return num_blocks, indices


class MaskLists(NamedTuple):
    """A BlockMask's block lists as every implementation reads them (int32): partial blocks,
    then full ones (None where the mask has no full lists); kv-major (the forward and dQ walk
    them) and q-major (dK/dV). The field order is the torch ops' order of mask tensors."""

    kv_num_blocks: jax.Array
    kv_indices: jax.Array
    q_num_blocks: jax.Array
    q_indices: jax.Array
    full_kv_num_blocks: jax.Array | None = None
    full_kv_indices: jax.Array | None = None
    full_q_num_blocks: jax.Array | None = None
    full_q_indices: jax.Array | None = None

    @property
    def has_full(self) -> bool:
        return self.full_kv_num_blocks is not None

    def major(self, which: str) -> list[jax.Array]:
        """[counts, indices] of the partial lists of one orientation ('kv' or 'q'), then the
        full ones if any."""
        names = [f"{which}_num_blocks", f"{which}_indices"]
        if self.has_full:
            names += [f"full_{which}_num_blocks", f"full_{which}_indices"]
        return [getattr(self, name) for name in names]

    def dense(self) -> tuple[jax.Array, jax.Array]:
        """[Bm, Hm, nQ, nKV] bool tables of partial and full blocks (from the kv-major lists)."""
        n_kv = self.kv_indices.shape[-1]
        partial = dense_from_lists(self.kv_num_blocks, self.kv_indices, n_kv)
        if not self.has_full:
            return partial, jnp.zeros_like(partial)
        return partial, dense_from_lists(self.full_kv_num_blocks, self.full_kv_indices, n_kv)


def _int32(x) -> jax.Array | np.ndarray:
    """x as int32; a numpy array stays one (under jit a constant, eagerly no device op)."""
    if isinstance(x, np.ndarray):
        return x.astype(np.int32, copy=False)
    if isinstance(x, jax.Array) and x.dtype == jnp.int32:
        return x  # (jnp.asarray costs ~10 us per list on every eager call)
    return jnp.asarray(x, jnp.int32)


def _transpose(table: jax.Array) -> jax.Array:
    return jnp.swapaxes(table, -1, -2)


@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Block-sparse attention mask (see the module docstring for the picture).

    Shapes (int32): kv_num_blocks [Bm, Hm, nQ]; kv_indices [Bm, Hm, nQ, nKV]; q_num_blocks
    [Bm, Hm, nKV]; q_indices [Bm, Hm, nKV, nQ]; the full_* fields alike or None. nQ and nKV are
    the block counts, ceil(seq_length / block_size) per axis. block_size and seq_lengths are
    (q, kv) int pairs; `shape` is (Bm, Hm, Q_LEN, KV_LEN). Made by `jattn.create_block_mask`
    or `BlockMask.from_kv_blocks`; a pytree, so it passes through jax.jit.

    Example::

        kv_num_blocks = jnp.array([[[1, 2]]], jnp.int32)  # [1, 1, nQ=2]: blocks per q block
        kv_indices = jnp.array([[[[0, 1], [0, 1]]]], jnp.int32)  # [1, 1, 2, nKV=2]
        mask = jattn.BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, block_size=64)
        print(mask.shape, mask.to_dense()[0, 0].tolist())  # (1, 1, 128, 128) [[1, 0], [1, 1]]
    """

    kv_num_blocks: jax.Array
    kv_indices: jax.Array
    full_kv_num_blocks: jax.Array | None
    full_kv_indices: jax.Array | None
    q_num_blocks: jax.Array
    q_indices: jax.Array
    full_q_num_blocks: jax.Array | None
    full_q_indices: jax.Array | None
    block_size: tuple[int, int]
    seq_lengths: tuple[int, int]
    mask_mod: MaskMod | None = None

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def from_dense_blocks(cls, partial: jax.Array, full: jax.Array | None, *,
                          block_size: tuple[int, int], seq_lengths: tuple[int, int],
                          mask_mod: MaskMod | None) -> BlockMask:
        """From [Bm, Hm, nQ, nKV] bool tables of partial and full blocks (disjoint)."""
        tables = [partial, _transpose(partial)]
        if full is not None:
            tables += [full, _transpose(full)]
        # The tables of one shape listed together: a few kernels per shape, not per table
        # (create_block_mask at 32k: 0.15 ms for four tables one by one, H100).
        lists = [None] * 8
        for shape in {t.shape for t in tables}:
            at = [i for i, t in enumerate(tables) if t.shape == shape]
            nums, indices = lists_from_dense(jnp.stack([tables[i] for i in at]))
            for j, i in enumerate(at):
                lists[2 * i], lists[2 * i + 1] = nums[j], indices[j]
        kv_num, kv_idx, q_num, q_idx, full_kv_num, full_kv_idx, full_q_num, full_q_idx = lists
        return cls(kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num,
                   full_q_idx, block_size=block_size, seq_lengths=seq_lengths,
                   mask_mod=mask_mod)

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks: jax.Array, kv_indices: jax.Array,
                       full_kv_num_blocks: jax.Array | None = None,
                       full_kv_indices: jax.Array | None = None, *,
                       block_size: int | tuple[int, int] = 128, mask_mod: MaskMod | None = None,
                       seq_lengths: tuple[int, int] | None = None) -> BlockMask:
        """From kv-major lists, as torch's `BlockMask.from_kv_blocks`; the q-major lists follow.

        kv_num_blocks [Bm, Hm, nQ] and kv_indices [Bm, Hm, nQ, nKV] (int). Partial blocks apply
        `mask_mod` (None: every pair of a listed block attends). seq_lengths defaults to the block
        counts times the block size. A count outside [0, nKV] or a listed index outside
        [0, nKV) raises where the values are known; under jit they are not checked, and such an
        index lists no block.
        """
        block_size = _pair("block_size", block_size, minimum=1)
        kv_num_blocks, kv_indices = jnp.asarray(kv_num_blocks), jnp.asarray(kv_indices)
        _check_lists("kv", kv_num_blocks, kv_indices)
        n_q, n_kv = kv_indices.shape[-2:]
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("from_kv_blocks: give both full_kv_num_blocks and full_kv_indices, "
                             "or neither.")
        partial = dense_from_lists(kv_num_blocks, kv_indices, n_kv)
        full = None
        if full_kv_num_blocks is not None:
            full_kv_num_blocks = jnp.asarray(full_kv_num_blocks)
            full_kv_indices = jnp.asarray(full_kv_indices)
            _check_lists("full_kv", full_kv_num_blocks, full_kv_indices)
            if full_kv_indices.shape != kv_indices.shape:
                raise ValueError(f"from_kv_blocks: full_kv_indices {full_kv_indices.shape} and "
                                 f"kv_indices {kv_indices.shape} must have the same shape.")
            full = dense_from_lists(full_kv_num_blocks, full_kv_indices, n_kv)
            partial = partial & ~full
        if seq_lengths is None:
            seq_lengths = (n_q * block_size[0], n_kv * block_size[1])
        seq_lengths = _pair("seq_lengths", seq_lengths, minimum=1)
        if (cdiv(seq_lengths[0], block_size[0]), cdiv(seq_lengths[1], block_size[1])) != (
                n_q, n_kv):
            raise ValueError(f"from_kv_blocks: seq_lengths {seq_lengths} with block_size "
                             f"{block_size} need {cdiv(seq_lengths[0], block_size[0])} x "
                             f"{cdiv(seq_lengths[1], block_size[1])} blocks, but kv_indices "
                             f"has {n_q} x {n_kv}.")
        return cls.from_dense_blocks(partial, full, block_size=block_size,
                                     seq_lengths=seq_lengths, mask_mod=mask_mod)

    def __getitem__(self, index) -> BlockMask:
        """The rows of some batches, heads and query blocks, as torch's `BlockMask[index]`.

        index: up to three of int, slice or integer array, for the batch, head and
        query-block dims of `kv_num_blocks`; an int keeps its dim (length 1). The kv lists are
        the selected rows as listed; seq_lengths stay the original's, and mask_mod becomes one
        that raises, as in torch: give the slice a mask_mod (and the lengths it is used at)
        with `dataclasses.replace(mask[:, :, i], mask_mod=..., seq_lengths=(1, KV_LEN))`.
        """
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError(f"BlockMask[...]: at most 3 indices (batch, head, query block), "
                             f"got {len(index)}.")
        sizes = self.kv_num_blocks.shape
        index = tuple(_kept_dim(i, n, dim) for dim, (i, n) in enumerate(
            zip((*index, slice(None), slice(None))[:3], sizes)))
        kv_lists = {name: getattr(self, name)[index] for name in _LISTS[:4]
                    if getattr(self, name) is not None}
        n_kv = self.num_blocks[1]
        partial = dense_from_lists(kv_lists["kv_num_blocks"], kv_lists["kv_indices"], n_kv)
        full = None if self.full_kv_num_blocks is None else dense_from_lists(
            kv_lists["full_kv_num_blocks"], kv_lists["full_kv_indices"], n_kv)
        sliced = BlockMask.from_dense_blocks(partial, full, block_size=self.block_size,
                                             seq_lengths=self.seq_lengths,
                                             mask_mod=sliced_mask_mod)
        # the kv lists in the original's order, as torch's slice keeps them
        return dataclasses.replace(sliced, **kv_lists)

    # ---- inspection -----------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(Bm, Hm, Q_LEN, KV_LEN)."""
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    @property
    def num_blocks(self) -> tuple[int, int]:
        return tuple(self.kv_indices.shape[-2:])

    def lists(self) -> MaskLists:
        """The block lists as int32 (the one flattening every implementation reads). An eager
        mask keeps them: every call with it reads them."""
        known = self.__dict__.get("_lists")
        if known is not None:
            return known
        names = MaskLists._fields if self.full_kv_num_blocks is not None else \
            MaskLists._fields[:4]
        result = MaskLists(*(_int32(getattr(self, name)) for name in names))
        if not any(isinstance(x, jax.core.Tracer) for x in result):
            object.__setattr__(self, "_lists", result)
        return result

    def partial_blocks(self) -> jax.Array:
        """[Bm, Hm, nQ, nKV] bool: blocks that apply mask_mod."""
        return dense_from_lists(self.kv_num_blocks, self.kv_indices, self.num_blocks[1])

    def full_blocks(self) -> jax.Array:
        """[Bm, Hm, nQ, nKV] bool: blocks that skip mask_mod (all False without full lists)."""
        if self.full_kv_num_blocks is None:
            return jnp.zeros(self.kv_indices.shape, bool)
        return dense_from_lists(self.full_kv_num_blocks, self.full_kv_indices,
                                self.num_blocks[1])

    def to_dense(self) -> jax.Array:
        """[Bm, Hm, nQ, nKV] int32: 1 where a block is visited (partial or full), like torch."""
        return (self.partial_blocks() | self.full_blocks()).astype(jnp.int32)

    def sparsity(self) -> float:
        """Percentage of blocks never visited."""
        return 100.0 * (1.0 - float(jnp.mean(self.to_dense())))

    def numel(self) -> int:
        """Elements of the mask, not counting sparsity: Bm · Hm · Q_LEN · KV_LEN (torch's)."""
        return math.prod(self.shape)

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """The visited blocks of each (batch, head) drawn as torch's `BlockMask.to_string`
        draws them: a grid of at most grid_size cells (-1: one a block), each two characters,
        █ where every block under it is visited, blank where none is, ░ where some are; the
        first `limit` (batch, head) pairs."""
        dense = np.asarray(self.to_dense())
        *lead, rows, cols = dense.shape
        if grid_size == -1:
            max_rows, max_cols = rows, cols
        elif isinstance(grid_size, int):
            max_rows = max_cols = grid_size
        else:
            max_rows, max_cols = grid_size
        row_step, col_step = max(1, cdiv(rows, max_rows)), max(1, cdiv(cols, max_cols))
        pictures = []
        for number, at in enumerate(np.ndindex(*lead)):
            if number == limit:
                pictures += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                             "You can also index (BlockMask[batch, head]) to choose a specific "
                             "batch or head"]
                break
            lines = [f"{at}"]
            for r in range(0, rows, row_step):
                cells = (dense[at][r:r + row_step, c:c + col_step].mean()
                         for c in range(0, cols, col_step))
                lines.append("".join(2 * ("█" if x == 1 else " " if x == 0 else "░")
                                     for x in cells))
            pictures.append("\n".join(lines) + "\n")
        return "\n".join(pictures)

    def __repr__(self) -> str:
        head = (f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                f"mask_mod={getattr(self.mask_mod, '__name__', self.mask_mod)}")
        if not isinstance(self.kv_num_blocks, (jax.Array, np.ndarray)) or isinstance(
                self.kv_num_blocks, jax.core.Tracer):
            return head + ")"  # (traced, or abstract: jax.eval_shape's)
        picture = ""
        n_q, n_kv = self.num_blocks
        if n_q <= 16 and n_kv <= 32:
            partial = np.asarray(self.partial_blocks()[0, 0])
            full = np.asarray(self.full_blocks()[0, 0])
            rows = ["".join("█" if f else "░" if p else "·" for p, f in zip(pr, fr))
                    for pr, fr in zip(partial, full)]
            picture = "\n  " + "\n  ".join(rows) + "\n  (batch 0, head 0: █ full, ░ partial)"
        return f"{head}, sparsity={self.sparsity():.1f}%){picture}"


_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


# A mask_mod's arguments (b, h, q_idx, kv_idx) where its trace is tried without array values.
_MASK_MOD_SIGNATURE = (jax.ShapeDtypeStruct((), jnp.int32),) * 4


def _flatten(mask: BlockMask):
    """Children: the lists and the arrays the mask_mod reads: its pytree leaves (jattn.masks'
    mods) and the arrays plain functions among them read directly (a user's closure over
    document ids, a global rebound per batch: `function_arrays`), so that new ids pass
    through jax.jit as arguments; the rest is static. A BlockMask made by `_unflatten` keeps
    the structure it was made with, whatever its leaves are now (`jax.tree.map(f, mask)`
    keeps the tree's structure, as for any pytree)."""
    lists = tuple(getattr(mask, name) for name in _LISTS)
    made = mask.__dict__.get("_made_from")
    if made is not None:
        aux, mod_children = made
        return (*lists, *mod_children), aux
    leaves, mod_tree = jax.tree_util.tree_flatten(mask.mask_mod)
    arrays, static = [], []
    for leaf in leaves:
        if isinstance(leaf, (jax.Array, np.ndarray)):
            arrays.append(leaf)
            static.append(None)
        elif (parts := function_arrays.split(leaf, _MASK_MOD_SIGNATURE)) is not None:
            arrays.extend(parts[1])
            static.append(parts[0])
        else:
            static.append(leaf)
    return (*lists, *arrays), (mask.block_size, mask.seq_lengths, mod_tree, tuple(static))


def _unflatten(aux, children) -> BlockMask:
    block_size, seq_lengths, mod_tree, static = aux
    mod_children = tuple(children[len(_LISTS):])
    # NumPy arrays (jax.device_get of a mask) become JAX arrays where the mod reads them: a mod
    # indexes them with traced positions.
    arrays = iter(jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in mod_children)
    leaves = []
    for x in static:
        if x is None:
            leaves.append(next(arrays))
        elif isinstance(x, function_arrays.Skeleton):
            leaves.append(x.rebuild([next(arrays) for _ in range(x.n_arrays)]))
        else:
            leaves.append(x)
    mask = BlockMask(*children[:len(_LISTS)], block_size=block_size, seq_lengths=seq_lengths,
                     mask_mod=mod_tree.unflatten(leaves))
    object.__setattr__(mask, "_made_from", (aux, mod_children))
    return mask


jax.tree_util.register_pytree_node(BlockMask, _flatten, _unflatten)


def check_block_counts(mask: BlockMask, op: str) -> None:
    """Raises where the mask's block lists do not cover its seq_lengths (a slice of a mask,
    mask[:, :, i], keeps the original's lengths until it is given its own)."""
    need = (cdiv(mask.seq_lengths[0], mask.block_size[0]),
            cdiv(mask.seq_lengths[1], mask.block_size[1]))
    if mask.num_blocks != need:
        raise ValueError(
            f"{op}: block_mask lists {mask.num_blocks[0]} x {mask.num_blocks[1]} blocks, but its "
            f"seq_lengths {mask.seq_lengths} with block_size {mask.block_size} need {need[0]} x "
            f"{need[1]}. A slice (mask[:, :, i]) keeps the original's seq_lengths: give it the "
            "lengths it is used at (JAX: dataclasses.replace(mask[:, :, i], seq_lengths=(1, "
            "KV_LEN), mask_mod=...); torch: sliced.seq_lengths = (1, KV_LEN)).")


def sliced_mask_mod(b, h, q_idx, kv_idx):
    """The mask_mod of a sliced BlockMask: the slice no longer knows its positions."""
    raise RuntimeError(
        "Cannot use the mask_mod of a sliced BlockMask: slicing (mask[...]) resets it, as in "
        "torch. Give the slice the original's mask_mod, shifted to the slice's positions, "
        "e.g. dataclasses.replace(mask[:, :, i], mask_mod=lambda b, h, q, kv: "
        "mask.mask_mod(b, h, q + offset, kv), seq_lengths=(1, KV_LEN)).")


def _kept_dim(index, size: int, dim: int):
    """An index of BlockMask[...] that keeps its dim: an int i becomes the slice i:i+1."""
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        if not -size <= index < size:
            raise IndexError(f"BlockMask[...]: index {index} is out of range for dim {dim} of "
                             f"size {size}.")
        index = int(index) % size
        return slice(index, index + 1)
    if hasattr(index, "dtype") and jnp.issubdtype(index.dtype, jnp.integer):
        # a 0-d array (a traced position) keeps its dim as an int does
        return jnp.reshape(index, (1,)) if jnp.ndim(index) == 0 else index
    if isinstance(index, slice):
        return index
    if isinstance(index, (list, tuple)):
        return np.asarray(index, np.int32)
    raise TypeError(f"BlockMask[...]: indices are ints, slices or integer arrays, got "
                    f"{type(index).__name__} for dim {dim}.")


def _pair(name: str, value, *, minimum: int = 16) -> tuple[int, int]:
    def is_int(v):
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    try:
        pair = (value, value) if is_int(value) else tuple(value)
    except TypeError:
        pair = ()
    if isinstance(value, (str, bytes)) or not pair or not all(is_int(v) for v in pair):
        raise TypeError(f"`{name}` must be an int or a pair of ints (e.g. 128 or (128, 64)), "
                        f"got {type(value).__name__} {value!r}.")
    if len(pair) != 2 or min(pair) < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum} or a pair of them, got {value!r}.")
    return int(pair[0]), int(pair[1])


def _check_lists(name: str, num_blocks: jax.Array, indices: jax.Array) -> None:
    if num_blocks.ndim != 3 or indices.ndim != 4 or indices.shape[:3] != num_blocks.shape:
        raise ValueError(f"from_kv_blocks: {name}_num_blocks must be [B, H, nQ] and "
                         f"{name}_indices [B, H, nQ, nKV], got {num_blocks.shape} and "
                         f"{indices.shape}.")
    for array in (num_blocks, indices):
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise TypeError(f"from_kv_blocks: {name} block lists must be integers, got "
                            f"{array.dtype}.")
    if not any(isinstance(a, jax.core.Tracer) for a in (num_blocks, indices)):
        _check_list_values(name, np.asarray(num_blocks), np.asarray(indices))


def _check_list_values(name: str, counts: np.ndarray, indices: np.ndarray) -> None:
    """Counts in [0, nKV] and the listed (first count) indices in [0, nKV)."""
    n_kv = indices.shape[-1]
    bad = np.argwhere((counts < 0) | (counts > n_kv))
    if bad.size:
        at = tuple(int(i) for i in bad[0])
        raise ValueError(f"from_kv_blocks: {name}_num_blocks{list(at)} = {counts[at]} is "
                         f"outside [0, {n_kv}], the number of kv blocks.")
    listed = np.arange(n_kv) < counts[..., None]
    bad = np.argwhere(listed & ((indices < 0) | (indices >= n_kv)))
    if bad.size:
        at = tuple(int(i) for i in bad[0])
        raise ValueError(f"from_kv_blocks: {name}_indices{list(at)} = {indices[at]} is "
                         f"outside [0, {n_kv}): the mask has {n_kv} kv blocks.")
