"""The split-KV attention kernel's static problem: flex decoding, and flex_attention's forward
for a few queries."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jattn._src import hardware
from jattn._src.attention.common import Mods
from jattn._src.attention.split_kv_config import (DecodeConfig, choose_num_splits,
                                                  heuristic_config, heuristic_stages)
from jattn._src.masks.block_mask import BlockMask
from jattn._src.tiling import cdiv, dot_tile
from jattn._src.user_functions import CaptureSet

# The decode kernel handles up to this many queries per sequence; flex_decode hands longer
# query blocks to flex_attention, and flex_attention hands shorter ones to the decode kernel.
MAX_DECODE_QUERIES = 16


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static option
class DecodeProblem:
    """Static description of one decode call on the kernel path.

    q [B, Hq, Lq, E]; keys are read at logical positions 0..S-1 of each sequence, either from a
    contiguous k [kv_batch, Hkv, S, E] or through a page table from a pool of `num_pages` pages
    of `page_size` positions (S = page-table width x page_size). Sequence b has kv_len[b] keys
    (int32 [B] at run time, or S everywhere when `static_length`: no length masks needed).
    Query i sits at position kv_len[b] - Lq + i (`queries_last`: decoding appends the queries
    to the cache) or at i (flex_attention's few-query forward).

    One program packs `heads_per_tile` query heads of a kv head times Lq queries (`rows`,
    padded to `block_m`) and reads one of `config.num_splits` key ranges. With a BlockMask
    (`has_mask`), programs walk the kv-major block lists of the rows their queries fall in.
    """

    B: int
    Hq: int
    Hkv: int
    Lq: int
    S: int
    E: int
    Ev: int
    kv_batch: int
    page_size: int | None
    num_pages: int | None
    heads_per_tile: int
    block_m: int
    static_length: bool
    queries_last: bool
    has_mask: bool
    has_full_lists: bool
    mask_batch: int
    mask_heads: int
    mask_block: tuple[int, int]
    mask_rows: int
    scale: float
    interpret: bool       # the kernels run in the Pallas interpreter
    config: DecodeConfig  # num_splits resolved
    mods: Mods            # traced on [block_m, block_k] tiles: b scalar; h, q_idx [M, 1]

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def groups(self) -> int:
        return self.Hq // self.Hkv

    @property
    def head_tiles(self) -> int:
        """Programs per kv head (per split)."""
        return self.groups // self.heads_per_tile

    @property
    def rows(self) -> int:
        return self.heads_per_tile * self.Lq

    @property
    def programs(self) -> int:
        """Programs per split: one per (batch, kv head, head tile)."""
        return self.B * self.Hkv * self.head_tiles


# ------------------------------------------------------------------------------------------------
# The kernel's problem: tiles, head packing, splits, mods traced at the tile shapes
# ------------------------------------------------------------------------------------------------

def make_problem(*, B: int, Hq: int, Hkv: int, Lq: int, S: int, E: int, Ev: int, kv_batch: int,
                 page_size: int | None, num_pages: int | None, block_mask: BlockMask | None,
                 score_mod: Callable | None, mask_mod: Callable | None,
                 score_set: CaptureSet | None, mask_set: CaptureSet | None, static_length: bool,
                 queries_last: bool, scale: float, interpret: bool,
                 config: DecodeConfig | None) -> DecodeProblem:
    """The kernel's DecodeProblem. score_mod/mask_mod (None: absent) come wrapped by the
    attention checks; their captured arrays are added to score_set/mask_set."""
    mask_block = block_mask.block_size[1] if block_mask is not None else None
    chosen = config is None
    config = config or heuristic_config(page_size=page_size, mask_block=mask_block)
    config.check_fits(page_size=page_size, mask_block=mask_block)
    groups = Hq // Hkv
    per_head_mask = block_mask is not None and block_mask.shape[1] > 1
    # Query heads of one kv head share a program (K/V read once) unless the mask differs per
    # head; as many as fit in block_m rows with the Lq queries each.
    heads_per_tile = 1 if per_head_mask else max(
        d for d in range(1, groups + 1) if groups % d == 0 and d * Lq <= config.block_m)
    block_m = dot_tile(heads_per_tile * Lq)
    splits = config.num_splits or choose_num_splits(B * Hkv * (groups // heads_per_tile),
                                                    cdiv(S, config.block_k),
                                                    hardware.num_sms())
    config = dataclasses.replace(config, num_splits=splits)
    if chosen:
        config = dataclasses.replace(
            config, num_stages=heuristic_stages(cdiv(cdiv(S, config.block_k), splits)))
    bk = config.block_k
    index_sig = (jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((block_m, 1), jnp.int32),
                 jax.ShapeDtypeStruct((block_m, 1), jnp.int32),
                 jax.ShapeDtypeStruct((1, bk), jnp.int32))
    mods = Mods(
        score=None if score_mod is None else score_set.trace(
            score_mod, (jax.ShapeDtypeStruct((block_m, bk), jnp.float32), *index_sig)),
        mask=None if mask_mod is None else mask_set.trace(mask_mod, index_sig))
    has_mask = block_mask is not None
    return DecodeProblem(
        B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, S=S, E=E, Ev=Ev, kv_batch=kv_batch, page_size=page_size,
        num_pages=num_pages, heads_per_tile=heads_per_tile, block_m=block_m,
        static_length=static_length, queries_last=queries_last, has_mask=has_mask,
        has_full_lists=has_mask and block_mask.full_kv_num_blocks is not None,
        mask_batch=block_mask.shape[0] if has_mask else 1,
        mask_heads=block_mask.shape[1] if has_mask else 1,
        mask_block=block_mask.block_size if has_mask else (1, 1),
        mask_rows=block_mask.num_blocks[0] if has_mask else 1, scale=scale,
        interpret=interpret, config=config, mods=mods)

