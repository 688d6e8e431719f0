"""Attention tunables: a validated config and its heuristic default."""

from __future__ import annotations

import dataclasses

from jattn._src.constants import MIN_DOT_TILE


def _check_block(owner: str, name: str, value) -> None:
    if not isinstance(value, int) or value < MIN_DOT_TILE or value & (value - 1):
        raise ValueError(f"{owner}.{name}={value!r} must be a power of two >= {MIN_DOT_TILE}.")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Tiles and launch parameters of the flex attention kernels.

    block_q, block_k: forward tile (query rows x key columns). bwd_block_q, bwd_block_k: tile of
    both backward kernels (dQ and dK/dV). Each must divide the BlockMask's block size along its
    axis. num_warps / num_stages and bwd_num_warps / bwd_num_stages: Triton launch parameters.
    """

    block_q: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    bwd_block_q: int = 64
    bwd_block_k: int = 64
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k", "bwd_block_q", "bwd_block_k"):
            _check_block("AttentionConfig", name, getattr(self, name))
        for name in ("num_warps", "bwd_num_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"AttentionConfig.{name}={getattr(self, name)!r} must be 1, 2, "
                                 "4, 8 or 16.")
        for name in ("num_stages", "bwd_num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionConfig.{name}={value!r} must be a positive int.")

    def check_fits(self, mask_block: tuple[int, int]) -> None:
        for name, tile, block in (("block_q", self.block_q, mask_block[0]),
                                  ("block_k", self.block_k, mask_block[1]),
                                  ("bwd_block_q", self.bwd_block_q, mask_block[0]),
                                  ("bwd_block_k", self.bwd_block_k, mask_block[1])):
            if block % tile:
                raise ValueError(f"AttentionConfig.{name}={tile} must divide the BlockMask "
                                 f"block size {block} along its axis; use a smaller tile or a "
                                 "BlockMask with larger blocks.")


def heuristic_config(head_dim: int, mask_block: tuple[int, int]) -> AttentionConfig:
    """The default config for a head dim and a BlockMask block size."""
    # H100 sweep (benchmarks/RESULTS.md): 128x64 w4 led at D=128 full, 64x128 w4 at D=64 full.
    if head_dim > 64:
        config = AttentionConfig(block_q=128, block_k=64, num_warps=4, num_stages=3)
    else:
        config = AttentionConfig(block_q=64, block_k=128, num_warps=4, num_stages=3)

    def fit(tile: int, block: int) -> int:
        while block % tile and tile > MIN_DOT_TILE:
            tile //= 2
        if block % tile:
            raise ValueError(f"BlockMask block size {block} has no power-of-two divisor >= "
                             f"{MIN_DOT_TILE} for a kernel tile; use a multiple of 16.")
        return tile

    return dataclasses.replace(config, **{
        name: fit(getattr(config, name), mask_block[axis])
        for name, axis in (("block_q", 0), ("block_k", 1), ("bwd_block_q", 0),
                           ("bwd_block_k", 1))})
