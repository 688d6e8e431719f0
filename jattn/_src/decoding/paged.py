"""PagedKVCache: a pool of fixed-size K/V pages shared by a batch of sequences, and its table.

    logical positions of sequence b    page_table[b]       pool (per kv head)
    [0 .. ps) [ps .. 2ps) [2ps .. 3ps)  ->  [ 7,  2,  -1 ]  ->  page 7 | page 2 | (unassigned)

Layout: k_pages [Hkv, num_pages, page_size, E] and v_pages [Hkv, num_pages, page_size, Ev].
Head-major, because the decode kernel reads one kv head's keys in [block_k, E] tiles: here a
tile is one contiguous block of memory (page_size x E per head and page), as in a contiguous
[B, Hkv, S, E] cache, so paged reads are as coalesced as contiguous ones. A token-major pool
([num_pages, page_size, Hkv, E], vLLM's) would make the rows of a tile Hkv·E apart. The pool
reshapes without a copy to [1, Hkv, num_pages·page_size, E], the cache layout of torch's
PagedAttention, so torch hand-offs stay zero-copy. page_table [B, max_pages] int32 maps logical
page j of sequence b to a physical page; -1 marks a page not assigned yet. Page allocation
(which physical pages a sequence gets) is the caller's: this class only reads and writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src.masks.block_mask import BlockMask


def concrete(x: Any) -> np.ndarray | None:
    """x as numpy where its value is known (eager call), None under a transformation (jit)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_pool_sizes(**sizes: Any) -> None:
    """PagedKVCache.create's sizes (jattn's and the torch one's) must be positive ints."""
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"PagedKVCache.create: `{name}` must be a positive int, got "
                             f"{value!r}.")


@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """K/V page pools and the page table of a batch (see the module docstring for the layout).

    A pytree: pass it through jax.jit. Updates are functional (`assign` returns a new cache);
    donate the cache to the jitted step so that XLA writes the pools in place.

    Fields: k_pages [Hkv, num_pages, page_size, E] and v_pages [Hkv, num_pages, page_size, Ev]
    of one dtype (bfloat16, float16 or float32 for flex_decode); page_table int32
    [B, max_pages], -1 where unassigned. Capacity per sequence: max_pages · page_size.

    Example::

        table = jnp.array([[0, 1], [2, -1]])  # B = 2 sequences, up to 2 pages each
        cache = jattn.PagedKVCache.create(4, 16, 2, 64, table, dtype=jnp.float32)
        new_k = new_v = jnp.ones((2, 2, 10, 64), jnp.float32)  # [B, Hkv, Ln, E]
        cache = cache.assign(new_k, new_v, jnp.array([0, 0]))  # positions 0..9 of each
        q = jnp.ones((2, 4, 1, 64), jnp.float32)  # [B, Hq, Lq, E]
        out = jattn.flex_decode(q, cache, None, kv_len=jnp.array([10, 10]))
        print(cache.capacity, out.shape)  # 32 (2, 4, 1, 64)
    """

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array

    @classmethod
    def create(cls, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
               page_table: Any, *, dtype=jnp.bfloat16,
               value_dim: int | None = None) -> PagedKVCache:
        """Zeroed pools and a copy of the given page table [B, max_pages] (int, -1:
        unassigned): donating the cache to a jitted step leaves the caller's table alive."""
        check_pool_sizes(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim)
        value_dim = head_dim if value_dim is None else value_dim
        cache = cls(jnp.zeros((num_kv_heads, num_pages, page_size, head_dim), dtype),
                    jnp.zeros((num_kv_heads, num_pages, page_size, value_dim), dtype),
                    jnp.array(page_table, jnp.int32))
        cache.check()
        return cache

    # ---- shapes ---------------------------------------------------------------------------------

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    @property
    def capacity(self) -> int:
        """Logical positions per sequence: page-table width x page size."""
        return self.page_table.shape[1] * self.page_size

    def check(self) -> None:
        """Raises ValueError/TypeError on inconsistent shapes or (when known) page entries
        outside the pool."""
        k, v, table = self.k_pages, self.v_pages, self.page_table
        if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"PagedKVCache: k_pages {k.shape} and v_pages {v.shape} must be "
                             "[Hkv, num_pages, page_size, dim] with equal first three axes.")
        if k.dtype != v.dtype:
            raise TypeError(f"PagedKVCache: k_pages {k.dtype} and v_pages {v.dtype} must share "
                            "a dtype.")
        if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.integer):
            raise ValueError(f"PagedKVCache: page_table must be an int [B, max_pages] array, "
                             f"got {table.dtype}{list(table.shape)}.")
        values = concrete(table)
        if values is not None and ((values < -1) | (values >= self.num_pages)).any():
            b, j = np.argwhere((values < -1) | (values >= self.num_pages))[0]
            raise ValueError(f"PagedKVCache: page_table[{b}, {j}] = {values[b, j]} is outside "
                             f"the pool of {self.num_pages} pages (use -1 for unassigned).")

    # ---- writing --------------------------------------------------------------------------------

    def assign(self, k: jax.Array, v: jax.Array, positions: Any, *,
               batch_idx: Any = None) -> PagedKVCache:
        """Writes new tokens: k [Bn, Hkv, Ln, E], v [Bn, Hkv, Ln, Ev] at logical positions.

        positions: [Bn] (the first new token's position; the rest follow) or [Bn, Ln].
        batch_idx: [Bn] rows of the page table the tokens belong to (default: all B, in order).
        A position outside the capacity or on an unassigned page raises ValueError when its
        value is known; under jit such tokens are dropped (nothing is written out of bounds).
        """
        k, v = jnp.asarray(k), jnp.asarray(v)
        rows = self.page_table if batch_idx is None else self.page_table[jnp.asarray(batch_idx)]
        Bn, Hkv, Ln, E = k.shape if k.ndim == 4 else (None,) * 4
        if (k.ndim != 4 or v.shape[:3] != k.shape[:3] or Hkv != self.num_kv_heads
                or E != self.k_pages.shape[3] or v.shape[3] != self.v_pages.shape[3]):
            raise ValueError(f"PagedKVCache.assign: k {k.shape} and v {v.shape} must be "
                             f"[Bn, {self.num_kv_heads}, Ln, dim] with the pools' dims "
                             f"({self.k_pages.shape[3]}, {self.v_pages.shape[3]}).")
        if rows.shape[0] != Bn:
            raise ValueError(f"PagedKVCache.assign: {Bn} sequences of new tokens but "
                             f"{rows.shape[0]} page-table rows (pass batch_idx).")
        positions = jnp.asarray(positions, jnp.int32)
        if positions.ndim == 1:
            positions = positions[:, None] + jnp.arange(Ln, dtype=jnp.int32)
        if positions.shape != (Bn, Ln):
            raise ValueError(f"PagedKVCache.assign: positions must be [{Bn}] or [{Bn}, {Ln}], "
                             f"got {positions.shape}.")
        logical_page = positions // self.page_size
        page = jnp.take_along_axis(rows, jnp.clip(logical_page, 0, rows.shape[1] - 1), axis=1)
        ok = (positions >= 0) & (positions < self.capacity) & (page >= 0) & (
            page < self.num_pages)
        known = concrete(ok)
        if known is not None and not known.all():
            b, i = np.argwhere(~known)[0]
            raise ValueError(f"PagedKVCache.assign: token {i} of sequence {b} goes to position "
                             f"{int(positions[b, i])}, outside the capacity {self.capacity} or "
                             "on an unassigned page; assign pages in page_table first.")
        pool_rows = self.num_pages * self.page_size
        slot = jnp.where(ok, page * self.page_size + positions % self.page_size, pool_rows)

        def write(pages, new):
            flat = pages.reshape(Hkv, pool_rows, pages.shape[-1])
            new = jnp.swapaxes(new, 0, 1).reshape(Hkv, Bn * Ln, new.shape[-1])
            flat = flat.at[:, slot.reshape(-1)].set(new.astype(pages.dtype), mode="drop")
            return flat.reshape(pages.shape)

        return dataclasses.replace(self, k_pages=write(self.k_pages, k),
                                   v_pages=write(self.v_pages, v))

    # ---- views ----------------------------------------------------------------------------------

    def as_sequence(self) -> tuple[jax.Array, jax.Array]:
        """The pools as one physical sequence, [1, Hkv, num_pages·page_size, E|Ev] (no copy):
        torch PagedAttention's cache layout, and k/v for flex_attention with a converted mask."""
        return tuple(x.reshape(1, self.num_kv_heads, -1, x.shape[-1])
                     for x in (self.k_pages, self.v_pages))

    def to_contiguous(self) -> tuple[jax.Array, jax.Array]:
        """Gathers each sequence's pages: k [B, Hkv, capacity, E], v alike (a copy; unassigned
        pages read as zeros). For the XLA path and tests."""
        assigned = (self.page_table >= 0)[None, :, :, None, None]
        pages = jnp.clip(self.page_table, 0, self.num_pages - 1)

        def gather(pool):
            x = jnp.where(assigned, pool[:, pages], 0)  # [Hkv, B, max_pages, page_size, D]
            return jnp.swapaxes(x, 0, 1).reshape(self.batch, self.num_kv_heads, -1, x.shape[-1])

        return gather(self.k_pages), gather(self.v_pages)

    def physical_to_logical(self, batch_idx: Any = None) -> jax.Array:
        """[Bn, num_pages] int32: the logical page each physical page holds for each sequence
        (of the page-table rows `batch_idx`), -1 where the sequence does not own it."""
        rows = self.page_table if batch_idx is None else self.page_table[jnp.asarray(batch_idx)]
        owned = (rows >= 0) & (rows < self.num_pages)
        target = jnp.where(owned, rows, self.num_pages)  # not owned: a spare column
        logical = jnp.broadcast_to(jnp.arange(rows.shape[1], dtype=jnp.int32), rows.shape)
        table = jnp.full((rows.shape[0], self.num_pages + 1), -1, jnp.int32)
        return table.at[jnp.arange(rows.shape[0])[:, None], target].set(logical)[:, :-1]

    # ---- the physical view of masks and mods (for flex_attention over `as_sequence()`) ----------

    def _logical_kv(self, physical_to_logical: jax.Array, b, kv_idx):
        logical_page = physical_to_logical[b, kv_idx // self.page_size]
        return logical_page >= 0, logical_page * self.page_size + kv_idx % self.page_size

    def convert_score_mod(self, score_mod: Callable, batch_idx: Any = None) -> Callable:
        """score_mod over physical kv positions of `as_sequence()`, calling `score_mod` with
        each key's logical position."""
        physical_to_logical = self.physical_to_logical(batch_idx)

        def physical_score_mod(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, q_idx, self._logical_kv(physical_to_logical, b,
                                                                  kv_idx)[1])

        return physical_score_mod

    def convert_logical_block_mask(self, block_mask: BlockMask,
                                   batch_idx: Any = None) -> BlockMask:
        """The BlockMask of the same attention over the physical pool (`as_sequence()`).

        block_mask: over logical positions, KV_LEN = capacity, kv blocks dividing page_size.
        Each listed block moves to where its page lives; blocks on unassigned pages are
        dropped, and the mask_mod sees logical kv positions (pages other sequences own never
        attend). The result has one batch entry per page-table row (of `batch_idx`).
        """
        block_kv = block_mask.block_size[1]
        if block_mask.seq_lengths[1] != self.capacity or self.page_size % block_kv:
            raise ValueError(f"convert_logical_block_mask: the BlockMask must cover KV_LEN = "
                             f"capacity {self.capacity} in kv blocks dividing the page size "
                             f"{self.page_size}; got KV_LEN {block_mask.seq_lengths[1]}, "
                             f"block {block_kv}.")
        rows = self.page_table if batch_idx is None else self.page_table[jnp.asarray(batch_idx)]
        batches, heads = block_mask.shape[:2]
        if batches not in (1, rows.shape[0]):
            raise ValueError(f"convert_logical_block_mask: the BlockMask has batch {batches}, "
                             f"the page table {rows.shape[0]} rows.")
        per_page = self.page_size // block_kv
        physical_blocks = self.num_pages * per_page
        logical_block = jnp.arange(block_mask.num_blocks[1])
        page = rows[:, logical_block // per_page]  # [Bn, nKV]
        column = jnp.where((page >= 0) & (page < self.num_pages),
                           page * per_page + logical_block % per_page, physical_blocks)
        b = jnp.arange(rows.shape[0])[:, None, None, None]
        h = jnp.arange(heads)[None, :, None, None]
        r = jnp.arange(block_mask.num_blocks[0])[None, None, :, None]

        def move(table):  # [Bm, Hm, nQ, nKV] logical -> [Bn, Hm, nQ, physical blocks]
            table = jnp.broadcast_to(table, (rows.shape[0], *table.shape[1:]))
            moved = jnp.zeros((*table.shape[:3], physical_blocks + 1), bool)
            return moved.at[b, h, r, column[:, None, None, :]].set(table)[..., :-1]

        logical_mask_mod, mask_mod = block_mask.mask_mod, None
        if logical_mask_mod is not None:
            physical_to_logical = self.physical_to_logical(batch_idx)

            def physical_mask_mod(b, h, q_idx, kv_idx):
                owned, logical = self._logical_kv(physical_to_logical, b, kv_idx)
                return owned & logical_mask_mod(b, h, q_idx, logical)

            mask_mod = physical_mask_mod

        return BlockMask.from_dense_blocks(
            move(block_mask.partial_blocks()), move(block_mask.full_blocks()),
            block_size=block_mask.block_size,
            seq_lengths=(block_mask.seq_lengths[0], self.num_pages * self.page_size),
            mask_mod=mask_mod)


jax.tree_util.register_dataclass(PagedKVCache, data_fields=["k_pages", "v_pages", "page_table"],
                                 meta_fields=[])
