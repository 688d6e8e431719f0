"""Attention tunables: a validated config and its heuristic default."""

from __future__ import annotations

import dataclasses

from jattn._src.constants import MIN_DOT_TILE
from jattn._src.tiling import check_compiler, check_positive, check_tiles, check_warps


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Tiles and launch parameters of the flex attention kernels.

    block_q, block_k: forward tile (query rows x key columns). bwd_block_q, bwd_block_k: tile of
    both backward kernels (dQ and dK/dV). Each must divide the BlockMask's block size along its
    axis. num_warps / num_stages and bwd_num_warps / bwd_num_stages: Triton launch parameters.
    compiler, bwd_compiler: who compiles the forward's and the backward's kernels' Triton IR:
    "xla" (jax's own path) or "triton" (the `triton` package, where installed; otherwise it
    falls back to "xla"). The torch ops launch kernels the `triton` package compiled without
    JAX's dispatch (docs/torch.md).

    All fields but the compilers (strs) are Python ints: tiles powers of two >= 16, warps 1, 2, 4,
    8 or 16, stages >= 1; invalid values raise ValueError. Frozen and hashable.

    Example::

        config = jattn.AttentionConfig(block_q=64, block_k=64, num_stages=3)
        q = k = v = jnp.ones((1, 2, 128, 64), jnp.float32)  # [B, H, L, E]
        out = jattn.flex_attention(q, k, v, config=config)  # (xla ignores the config)
        print(out.shape)  # (1, 2, 128, 64)
    """

    block_q: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    bwd_block_q: int = 64
    bwd_block_k: int = 64
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    compiler: str = "xla"
    bwd_compiler: str = "xla"

    def __post_init__(self):
        check_compiler(self)
        check_compiler(self, "bwd_compiler")
        check_tiles(self, "block_q", "block_k", "bwd_block_q", "bwd_block_k")
        check_warps(self, "num_warps", "bwd_num_warps")
        check_positive(self, "num_stages", "bwd_num_stages")

    def check_fits(self, mask_block: tuple[int, int]) -> None:
        for name, tile, block in (("block_q", self.block_q, mask_block[0]),
                                  ("block_k", self.block_k, mask_block[1]),
                                  ("bwd_block_q", self.bwd_block_q, mask_block[0]),
                                  ("bwd_block_k", self.bwd_block_k, mask_block[1])):
            if block % tile:
                raise ValueError(f"AttentionConfig.{name}={tile} must divide the BlockMask "
                                 f"block size {block} along its axis; use a smaller tile or a "
                                 "BlockMask with larger blocks.")


def heuristic_config(head_dim: int, mask_block: tuple[int, int], *, masked: bool,
                     triton_compiler: bool = False, score_mod: bool = False) -> AttentionConfig:
    """The default config for a head dim and a BlockMask block size; `masked`: the BlockMask
    has a mask_mod (partial blocks), which moves the D <= 64 optimum; `triton_compiler`: the
    `triton` package can compile the kernels; `score_mod`: the call has one."""
    # The fastest configs of the H100 tile sweeps (benchmarks/HISTORY.md, "FlexAttention").
    # Compiled by the `triton` package: D128 without a mask_mod 128x64 w4 s4, level with
    # torch's compiled flex_attention; with one 128x64 w4 s2, level with XLA's compile of the
    # same config (0.99-1.01x at L2048-4096, causal and documents) and launchable by the torch
    # ops without JAX; D <= 64 128x64 w4 s5. Without `triton`, XLA's best: 128x64 w4 s2 at
    # D128, at D64 64x128 w4 s3 without a mask_mod, 64x64 w4 s3 with one.
    # Backward: 64x64 w4 s2, fastest at every shape of the backward sweep. Compiled by `triton`
    # without a score_mod (1.01-1.04x XLA's compile, and the torch ops launch it without JAX);
    # with one XLA's (softcap: `triton`'s 0.78x; benchmarks/HISTORY.md).
    if head_dim > 64 and not triton_compiler:
        config = AttentionConfig(block_q=128, block_k=64, num_warps=4, num_stages=2)
    elif head_dim > 64:
        config = AttentionConfig(block_q=128, block_k=64, num_warps=4,
                                 num_stages=2 if masked else 4, compiler="triton")
    elif triton_compiler:
        config = AttentionConfig(block_q=128, block_k=64, num_warps=4, num_stages=5,
                                 compiler="triton")
    elif masked:
        config = AttentionConfig(block_q=64, block_k=64, num_warps=4, num_stages=3)
    else:
        config = AttentionConfig(block_q=64, block_k=128, num_warps=4, num_stages=3)

    def fit(tile: int, block: int) -> int:
        while block % tile and tile > MIN_DOT_TILE:
            tile //= 2
        if block % tile:
            raise ValueError(f"BlockMask block size {block} has no power-of-two divisor >= "
                             f"{MIN_DOT_TILE} for a kernel tile; use a multiple of 16.")
        return tile

    if triton_compiler and not score_mod:
        config = dataclasses.replace(config, bwd_compiler="triton")
    return dataclasses.replace(config, **{
        name: fit(getattr(config, name), mask_block[axis])
        for name, axis in (("block_q", 0), ("block_k", 1), ("bwd_block_q", 0),
                           ("bwd_block_k", 1))})
