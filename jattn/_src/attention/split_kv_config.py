"""Flex decoding tunables: a validated config, its heuristic default and the split count.

Decoding is bound by the bytes of K and V read. What decides the speed is (1) enough programs
to keep every SM's loads in flight, (2) K/V tiles large enough to be coalesced and pipelined,
(3) no program far longer than the others (the GPU waits for the last one). The split count
(key ranges of one kv head read by separate programs, merged afterwards) serves (1) and (3).
"""

from __future__ import annotations

import dataclasses
import math

from jattn._src.constants import MIN_DOT_TILE
from jattn._src.tiling import check_compiler, check_positive, check_tiles, check_warps

# A split reads at least this many K/V tiles: shorter programs spend their time filling the
# load pipeline (num_stages tiles) rather than streaming.
MIN_TILES_PER_SPLIT = 8

# Partials are [splits, programs, block_m, Ev] float32: more splits than this only grows them.
MAX_SPLITS = 128

# Splits whose occupancy score is within this factor of the best count as good as the best; the
# smallest such split count wins (fewer partials, longer streams per program).
GOOD_ENOUGH = 0.95

# Programs per SM the split choice aims at: one H100 SM holds two decode programs at the default
# tiles (at 4 stages Triton buffers 3 steps of K + V 64x128 bf16 tiles, 96 KiB of its 227 KiB
# shared memory).
PROGRAMS_PER_SM = 2


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiles and launch parameters of the flex decoding kernel.

    block_k: K/V rows per loop step (must divide the page size and the BlockMask's kv block).
    block_m: the most query rows one program packs (query heads of one kv head x queries); a
      group that needs more rows is spread over several programs, each reading K/V again.
    num_warps, num_stages: Triton's warps per program and software-pipelining depth (loads kept
      in flight). num_splits: key ranges per (batch, kv head); None picks it from the SM count.
    compiler: who compiles the kernel's Triton IR, "xla" or "triton" (as AttentionConfig).

    All fields but `compiler` (a str) and num_splits (int or None) are Python ints: tiles
    powers of two >= 16, warps 1, 2, 4, 8 or 16, stages >= 1. Frozen and hashable.

    Example::

        q = jnp.ones((2, 8, 1, 64), jnp.float32)  # [B, Hq, Lq, E]
        k = v = jnp.ones((2, 2, 256, 64), jnp.float32)  # [B, Hkv, S, E]
        config = jattn.DecodeConfig(block_k=32, num_splits=4)
        out = jattn.flex_decode(q, k, v, config=config)  # (xla ignores the config)
        print(out.shape)  # (2, 8, 1, 64)
    """

    block_k: int = 64
    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None
    compiler: str = "xla"

    def __post_init__(self):
        check_compiler(self)
        check_tiles(self, "block_k", "block_m")
        check_warps(self, "num_warps")
        check_positive(self, "num_stages")
        if self.num_splits is not None:
            check_positive(self, "num_splits")

    def check_fits(self, *, page_size: int | None, mask_block: int | None) -> None:
        for what, size in (("page size", page_size), ("BlockMask kv block size", mask_block)):
            if size is not None and size % self.block_k:
                raise ValueError(f"DecodeConfig.block_k={self.block_k} must divide the {what} "
                                 f"{size}; use a smaller block_k.")


def heuristic_config(*, page_size: int | None, mask_block: int | None) -> DecodeConfig:
    """The default config: 64-row K/V tiles (16 KiB per operand at E=128, bf16), shrunk to
    divide the page size and the BlockMask's kv block size."""
    block_k = DecodeConfig.block_k
    for size in (page_size, mask_block):
        while size is not None and size % block_k and block_k > MIN_DOT_TILE:
            block_k //= 2
    config = DecodeConfig(block_k=block_k)
    config.check_fits(page_size=page_size, mask_block=mask_block)
    return config


# The heuristic pipelines 4 stages deep when a split streams at least this many tiles, else 3:
# on the H100 4 stages are faster on long splits (64 and 256 tiles) and slower on short ones (8
# and 16 tiles), where filling the deeper pipeline is a larger share of the run; in between
# (32 and 62 tiles) the two are level (benchmarks/HISTORY.md, "Flex decoding").
DEEP_PIPELINE_TILES = 48


def heuristic_stages(tiles_per_split: int) -> int:
    return 4 if tiles_per_split >= DEEP_PIPELINE_TILES else 3


def _wave_efficiency(programs: int, slots: int) -> float:
    """Fraction of launched slot time doing work when `programs` equal programs run `slots` at
    a time: 1.0 when they fill whole waves, low when a last wave is nearly empty."""
    return programs / (math.ceil(programs / slots) * slots)


def choose_num_splits(programs: int, tiles: int, num_sms: int) -> int:
    """Splits per (batch, kv head, head tile) for `programs` such groups over `tiles` K/V tiles.

    Scores each count by the worse wave efficiency at one and at PROGRAMS_PER_SM programs per SM
    (the real occupancy depends on the config) times how well the launch fills PROGRAMS_PER_SM
    per SM, and returns the smallest count scoring within GOOD_ENOUGH of the best. B=1, Hkv=8 at
    128k gives 33 splits (264 programs = 2 per SM, 62 tiles each); B=8, Hkv=8 at 32k gives 8;
    B=32 gives 1-2.
    """
    largest = max(1, min(MAX_SPLITS, tiles // MIN_TILES_PER_SPLIT))
    target = PROGRAMS_PER_SM * num_sms

    def score(splits: int) -> float:
        total = programs * splits
        waves = min(_wave_efficiency(total, num_sms), _wave_efficiency(total, target))
        return waves * min(1.0, total / target)

    scores = {splits: score(splits) for splits in range(1, largest + 1)}
    best = max(scores.values())
    return min(s for s, value in scores.items() if value >= GOOD_ENOUGH * best)
