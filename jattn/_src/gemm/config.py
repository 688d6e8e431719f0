"""GEMM tunables: a validated config, the heuristic default and the autotuning search space."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jattn._src.hardware import SHARED_MEMORY_BYTES, num_sms
from jattn._src.tiling import check_positive, check_tiles, check_warps, dot_tile


def _fit(block: int, size: int) -> int:
    """A tile side of at most `block` that covers `size` (no larger than needed)."""
    return min(block, dot_tile(size))


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tile shape and launch parameters of the GEMM kernel.

    block_m, block_n, block_k: output tile rows, columns and the K step (powers of two, >= 16).
    group_m: row tiles walked together before moving to the next column (L2 reuse).
    num_warps, num_stages: Triton's warps per program and software-pipelining depth.
    split_k: programs sharing one output tile along K; > 1 writes fp32 partial sums that XLA adds
      (use it when M·N has too few tiles to fill the GPU, e.g. decode-shaped M).

    All fields are Python ints: tiles powers of two >= 16, warps 1, 2, 4, 8 or 16, the others
    >= 1; invalid values raise ValueError. Frozen and hashable.

    Example::

        config = jattn.MatmulConfig(block_m=64, block_n=64, block_k=32, num_stages=2)
        a, b = jnp.ones((128, 64), jnp.bfloat16), jnp.ones((64, 256), jnp.bfloat16)
        out = jattn.matmul(a, b, config=config)  # (xla ignores the config)
        print(out.shape, out.dtype)  # (128, 256) bfloat16
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1

    def __post_init__(self):
        check_tiles(self, "block_m", "block_n", "block_k")
        check_warps(self, "num_warps")
        check_positive(self, "group_m", "num_stages", "split_k")

    def shared_memory_bytes(self, itemsize: int) -> int:
        """Bytes of shared memory the pipelined A and B tiles need."""
        tile_bytes = (self.block_m + self.block_n) * self.block_k * itemsize
        return tile_bytes * max(1, self.num_stages - 1)

    def fit_to(self, m: int, n: int, k: int) -> MatmulConfig:
        """Shrinks tiles larger than the problem (never below 16), keeping everything else."""
        return dataclasses.replace(
            self, block_m=_fit(self.block_m, m), block_n=_fit(self.block_n, n),
            block_k=_fit(self.block_k, k),
        )


def _split_k_for(m: int, n: int, k: int, config: MatmulConfig) -> int:
    """K splits for problems with too few output tiles to half-fill the GPU.

    Each split keeps >= 4 K steps. On the H100, M=16 N=K=8192 (128 tiles) runs as fast
    without a split, so splitting starts only below half the SMs.
    """
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    k_steps = -(-k // config.block_k)
    split = 1
    while 2 * tiles * split < num_sms() and k_steps // (2 * split) >= 4:
        split *= 2
    return split


def heuristic_config(m: int, n: int, k: int, dtype: np.dtype, fast_accum: bool = False,
                     batch: int = 1) -> MatmulConfig:
    """The default config for an [m, k] @ [k, n] product of `dtype` inputs (fp8's
    accumulation mode, `fast_accum`, and the products in one launch, `batch`, do not change
    these tiles).

    The tile shapes are the H100 autotuning winners of benchmarks/HISTORY.md for bf16.
    """
    itemsize = np.dtype(dtype).itemsize
    if m <= 64:
        # Decode-shaped: bandwidth-bound on B, so long K steps.
        config = MatmulConfig(block_m=16, block_n=64, block_k=512 // itemsize, group_m=1,
                              num_warps=4, num_stages=3)
    elif m <= 256:
        config = MatmulConfig(block_m=64, block_n=128, block_k=256 // itemsize, group_m=1,
                              num_warps=4, num_stages=4)
    elif itemsize == 1 and m * n > 2048 * 2048:
        # fp8 (scaled_matmul): promoting every 128 K, 128 x 256 tiles (whose doubled
        # accumulator does not fit) run far slower at 8192^3 on the H100; with fast
        # accumulation the two are close (benchmarks/HISTORY.md).
        config = MatmulConfig(block_m=256, block_n=128, block_k=128, group_m=8, num_warps=8,
                              num_stages=4)
    elif itemsize <= 2 and m * n > 2048 * 2048:
        # The plain row-major tile order (group_m=1) beats group_m = 4, 8 and 16 at 4096^3 and
        # 8192^3.
        config = MatmulConfig(block_m=128, block_n=256, block_k=64, group_m=1, num_warps=8,
                              num_stages=3)
    elif m * n > 1024 * 1024:
        config = MatmulConfig(block_m=128, block_n=128, block_k=128 // itemsize, group_m=1,
                              num_warps=4, num_stages=3)
    else:  # narrower tiles keep enough programs for the SMs without splitting K
        config = MatmulConfig(block_m=128, block_n=64, block_k=256 // itemsize, group_m=1,
                              num_warps=8, num_stages=3)
    config = config.fit_to(m, n, k)
    return dataclasses.replace(config, split_k=_split_k_for(m, n, k, config))


def heuristic_mixed_config(m: int, n: int, k: int, bits: int,
                           group_size: int | None = None) -> MatmulConfig:
    """The default config of `jattn.mixed_matmul` on pallas_triton: 16-bit activations [m, k],
    a [k, n] weight of `bits`-bit integers (any group_size: the kernel chunks its K-steps by
    groups).

    Decode-shaped M (<= 64) streams the weight once; one row tile covers all of M. The H100
    sweep winners at M=16, N=K=8192 (benchmarks/HISTORY.md): int8 64 x 512 tiles, 4 stages, no
    split; int4 128 x 128, 4 stages, split 4 (no config of the int4 sweep over tiles, warps,
    stages and splits 1-8 is faster). Larger M runs the dense bf16 tiles.
    """
    if m > 64:
        config = heuristic_config(m, n, k, np.float16)  # it reads only the 2-byte itemsize
    elif bits == 8:
        config = MatmulConfig(block_m=64, block_n=64, block_k=512, group_m=1, num_warps=4,
                              num_stages=4).fit_to(m, n, k)
    else:
        config = MatmulConfig(block_m=64, block_n=128, block_k=128, group_m=1, num_warps=4,
                              num_stages=4).fit_to(m, n, k)
        k_steps = -(-k // config.block_k)
        config = dataclasses.replace(config, split_k=max(1, min(4, k_steps // 4)))
    # Shorter K steps until the pipelined activation and weight tiles fit in shared memory
    # (Triton asks for num_stages copies plus 32 KiB: 425984 bytes at M=64 int8 on the H100).
    while (config.block_k > 32 and 32 * 1024 + config.num_stages * config.block_k
           * (2 * config.block_m + config.block_n * bits // 8) > SHARED_MEMORY_BYTES):
        config = dataclasses.replace(config, block_k=config.block_k // 2)
    # int4 reads 16-byte weight rows per K step at least (see quantize.check_group_size).
    return dataclasses.replace(config, block_k=max(config.block_k, 32 if bits == 4 else 16))


def search_space(m: int, n: int, k: int, dtype: np.dtype, fast_accum: bool = False,
                 batch: int = 1) -> list[MatmulConfig]:
    """Candidate configs for the autotuner, fitted to the shape and to shared memory (whatever
    fp8's accumulation mode or the number of products in a launch)."""
    itemsize = np.dtype(dtype).itemsize
    if m <= 64:
        tiles = itertools.product((16, 32, 64), (32, 64, 128), (128, 256, 512), (4,), (3, 4, 6))
        group_ms = (1,)
    else:
        tiles = itertools.product((64, 128, 256), (64, 128, 256), (64, 128), (4, 8), (3, 4, 5))
        group_ms = (1, 8)
    seen: dict[MatmulConfig, None] = {}
    for (bm, bn, bk, warps, stages), group_m in itertools.product(tiles, group_ms):
        if bm * bn >= 256 * 256 or (bm * bn >= 128 * 256 and warps < 8):
            continue  # accumulator would not fit in registers
        config = MatmulConfig(bm, bn, bk, group_m, warps, stages).fit_to(m, n, k)
        if config.shared_memory_bytes(itemsize) > SHARED_MEMORY_BYTES:
            continue
        for split in {1, _split_k_for(m, n, k, config)}:
            seen[dataclasses.replace(config, split_k=split)] = None
    return list(seen)


# One TMA box row and wgmma swizzle span of an operand: 128 bytes (block_k = 128 // itemsize:
# 64 elements of 16-bit operands, 128 of fp8).
MOSAIC_OPERAND_ROW_BYTES = 128
# A Mosaic GEMM consumer stores its output through shared memory in pieces of 64 rows of 128
# bytes (one swizzle span), two in flight: 32 KiB for the two consumers.
MOSAIC_STAGING_BYTES = 2 * 2 * 64 * 128
# Accumulator values one consumer warpgroup holds when fp8 partial sums are promoted into a
# second float32 accumulator (both in registers).
MOSAIC_PROMOTED_VALUES = 64 * 128


def mosaic_block_k(dtype) -> int:
    """The Mosaic GEMM's K step for operands of `dtype`: one 128-byte swizzle span."""
    return MOSAIC_OPERAND_ROW_BYTES // np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class MosaicMatmulConfig:
    """Tiles and tile order of the Mosaic GPU GEMM kernel (Hopper, `pallas_mosaic_gpu`).

    block_m, block_n: one program's output tile. Its two consumer warpgroups each hold half of
      it as a float32 accumulator, split along `split` ("m": two [block_m / 2, block_n]
      halves; "n": two [block_m, block_n / 2]); a half is [64 or 128, 64 to 256] with at most
      128 x 128 values (the registers of one warpgroup).
    block_k: the K step, one 128-byte swizzle span: 64 for 16-bit operands, 128 for fp8.
    num_stages: K steps of A and B tiles in flight in shared memory (the producer warpgroup's
      TMA ring).
    minor, group: the order programs take output tiles in: `group` tiles along `minor` ("m" or
      "n"), then the next band, snaking back (neighbouring programs share A or B in L2).

    Programs are persistent (one per SM) and walk tiles in that order. Invalid values raise
    ValueError. Frozen and hashable.

    Example::

        config = jattn.MosaicMatmulConfig(block_m=128, block_n=256, num_stages=4)
        print(config.warpgroup_tile)  # (128, 128)
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_stages: int = 4
    split: str = "n"
    minor: str = "n"
    group: int = 8

    def __post_init__(self):
        check_positive(self, "block_m", "block_n", "num_stages", "group")
        for name in ("split", "minor"):
            if getattr(self, name) not in ("m", "n"):
                raise ValueError(f"MosaicMatmulConfig.{name} must be 'm' or 'n', got "
                                 f"{getattr(self, name)!r}.")
        if self.block_k not in (64, 128):
            raise ValueError(f"MosaicMatmulConfig.block_k must be 64 (16-bit operands) or 128 "
                             f"(fp8): one 128-byte swizzle span, got {self.block_k}.")
        rows, cols = self.warpgroup_tile
        if rows not in (64, 128) or cols % 64 or not 64 <= cols <= 256 or rows * cols > 128 * 128:
            raise ValueError(
                f"MosaicMatmulConfig: block_m={self.block_m}, block_n={self.block_n} split "
                f"along {self.split!r} gives each consumer warpgroup a [{rows}, {cols}] tile; "
                "it must be [64 or 128, a multiple of 64 up to 256] with at most 128 x 128 "
                "values (e.g. block_m=128, block_n=256, split='n').")

    @property
    def warpgroup_tile(self) -> tuple[int, int]:
        """The [rows, columns] of the output tile one consumer warpgroup accumulates."""
        if self.split == "m":
            return self.block_m // 2, self.block_n
        return self.block_m, self.block_n // 2

    def shared_memory_bytes(self, itemsize: int) -> int:
        """Bytes of shared memory: the ring of A and B tiles and the output staging."""
        ring = self.num_stages * (self.block_m + self.block_n) * self.block_k * itemsize
        return ring + MOSAIC_STAGING_BYTES


def _fp8(dtype) -> bool:
    return np.dtype(dtype).itemsize == 1


def _mosaic_tiles(dtype, fast_accum: bool) -> tuple[tuple[int, int, str], ...]:
    """(block_m, block_n, split) candidates, largest first. fp8 whose partial sums are
    promoted takes 128 x 128 split along m: a consumer's [64, 128] leaves the registers for a
    second accumulator."""
    if _fp8(dtype) and not fast_accum:
        return ((128, 128, "m"),)
    return ((128, 256, "n"), (256, 128, "m"), (128, 128, "m"), (128, 64, "m"))


# A tile count that fills an H100 well enough: at 1024 x 4096 and 2048^2 the 128 x 256 tiles'
# 128 (of 132 SMs) ran as fast as XLA; below it smaller tiles won (1024^3: 128 x 64 1.9x
# 128 x 256's 32 tiles; 512 x 4096: 128 x 128 1.5x 128 x 256's 64).
_WAVE_FILL = 0.75
# Most K steps in flight for fp8 (8192^3: 4 stages measured faster than 6); 16-bit operands
# take as many as shared memory holds (small products: 128 x 128 tiles 1-9% faster at 6
# stages than 4, 128 x 64 at 1024^3 1.6% faster at 8 than 6).
_FP8_STAGES = 4
_MOST_STAGES = 8


def _tiles(m: int, n: int, block_m: int, block_n: int) -> int:
    return (m // block_m) * (n // block_n)


def _deepest(config: MosaicMatmulConfig, itemsize: int, k: int) -> MosaicMatmulConfig:
    """config with as many stages as shared memory holds (fp8: at most 4), at most one per
    K step."""
    most = _FP8_STAGES if itemsize == 1 else _MOST_STAGES
    stages = max(1, min(most, k // config.block_k))
    while stages > 1 and dataclasses.replace(config, num_stages=stages).shared_memory_bytes(
            itemsize) > SHARED_MEMORY_BYTES:
        stages -= 1
    return dataclasses.replace(config, num_stages=stages)


def heuristic_mosaic_config(m: int, n: int, k: int, dtype: np.dtype, fast_accum: bool = False,
                            batch: int = 1) -> MosaicMatmulConfig:
    """The default Mosaic GEMM config: the largest tile (128 x 256, 256 x 128, 128 x 128,
    128 x 64; fp8 promoted: 128 x 128) that divides [m, n] into enough tiles to fill the SMs
    (counting the `batch` products of one launch; else the one giving the most tiles), with
    as many stages as shared memory holds."""
    candidates = _mosaic_tiles(dtype, fast_accum)
    fitting = [tile for tile in candidates
               if m % tile[0] == 0 and n % tile[1] == 0] or [candidates[-1]]
    tiles = lambda tile: batch * _tiles(m, n, *tile[:2])
    enough = [tile for tile in fitting if tiles(tile) >= _WAVE_FILL * num_sms()]
    block_m, block_n, split = (enough or [max(fitting, key=tiles)])[0]
    config = MosaicMatmulConfig(block_m=block_m, block_n=block_n, block_k=mosaic_block_k(dtype),
                                split=split)
    return _deepest(config, np.dtype(dtype).itemsize, k)


def mosaic_search_space(m: int, n: int, k: int, dtype: np.dtype, fast_accum: bool = False,
                        batch: int = 1) -> list[MosaicMatmulConfig]:
    """Candidate Mosaic GEMM configs: the tiles that divide [m, n], stages, tile orders, and
    the heuristic's choice for `batch` products in a launch."""
    itemsize = np.dtype(dtype).itemsize
    candidates = []
    for (block_m, block_n, split), stages, minor, group in itertools.product(
            _mosaic_tiles(dtype, fast_accum), (3, 4, 6, 8), ("m", "n"), (4, 8, 16)):
        if m % block_m or n % block_n:
            continue
        config = MosaicMatmulConfig(block_m=block_m, block_n=block_n,
                                    block_k=mosaic_block_k(dtype), num_stages=stages,
                                    split=split, minor=minor, group=group)
        if config.shared_memory_bytes(itemsize) <= SHARED_MEMORY_BYTES:
            candidates.append(config)
    heuristic = heuristic_mosaic_config(m, n, k, dtype, fast_accum, batch)
    return candidates + [heuristic] * (heuristic not in candidates)


@dataclasses.dataclass(frozen=True)
class MosaicMixedConfig:
    """Tiles of the Mosaic GPU weight-only GEMM (`mixed_matmul` on Hopper, `pallas_mosaic_gpu`).

    block_m: tokens (rows of a) per tile, a multiple of 8 up to 256 (wgmma's N; M is padded to
      a multiple of it).
    block_n: weight rows (output columns) per program: 128 (each of the two consumer warpgroups
      multiplies 64) or 64 (the two take alternate K-steps of the same rows and add their sums
      at the end: twice the programs, for N too small to give every SM 128 rows).
    block_k: the K-step, 128 or 256 weights; a group_size must be a multiple of it.
    num_stages: K-steps of activations and weights in flight in shared memory.

    Invalid values raise ValueError. Frozen and hashable.

    Example::

        config = jattn.MosaicMixedConfig(block_m=16, block_n=64, block_k=256, num_stages=8)
        print(config.shared_memory_bytes(bits=4))  # 139264
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    num_stages: int = 4

    def __post_init__(self):
        check_positive(self, "block_m", "num_stages")
        if self.block_m % 8 or self.block_m > 256:
            raise ValueError(f"MosaicMixedConfig.block_m must be a multiple of 8 up to 256 "
                             f"(wgmma's N), got {self.block_m}.")
        if self.block_n not in (64, 128):
            raise ValueError(f"MosaicMixedConfig.block_n must be 64 or 128 weight rows, got "
                             f"{self.block_n}.")
        if self.block_k not in (128, 256):
            raise ValueError(f"MosaicMixedConfig.block_k must be 128 or 256, got "
                             f"{self.block_k}.")

    def shared_memory_bytes(self, bits: int) -> int:
        """Bytes of shared memory: the ring of activation (16-bit) and weight tiles, the
        output staging and the second consumer's sum."""
        step = self.block_m * self.block_k * 2 + self.block_n * self.block_k * bits // 8
        return self.num_stages * step + self.block_m * 128 * 2 + 64 * self.block_m * 4


# Most K-steps in flight for the weight-only kernel (shared memory permitting).
_MIXED_STAGES = 8


def heuristic_mosaic_mixed_config(m: int, n: int, k: int, bits: int,
                                  group_size: int | None = None) -> MosaicMixedConfig:
    """The default Mosaic weight-only config: one token tile covering M (up to 128), K-steps
    of 256 weights where the groups allow (else 128), 64 weight rows per program where 128
    would leave SMs without weights to stream, and as many stages as shared memory holds."""
    block_m = min(128, -(-m // 8) * 8)
    block_k = 256 if group_size is None or group_size % 256 == 0 else 128
    token_tiles = -(-m // block_m)
    block_n = 64 if token_tiles * (n // 128) < _WAVE_FILL * num_sms() else 128
    stages = max(1, min(_MIXED_STAGES, k // block_k))
    config = MosaicMixedConfig(block_m=block_m, block_n=block_n, block_k=block_k,
                               num_stages=stages)
    while config.num_stages > 1 and config.shared_memory_bytes(bits) > SHARED_MEMORY_BYTES:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


# The widest output side a b2b program holds in registers as its fp32 accumulator: [64, 256]
# is 128 fp32 registers a thread at 4 warps (64 at 8); wider runs as two matmuls instead.
B2B_MAX_HELD = 256


@dataclasses.dataclass(frozen=True)
class B2BConfig:
    """Tiles and launch parameters of the back-to-back GEMM kernel (`jattn.b2b_matmul`).

    block_out: output rows (side="left") or columns (side="right") each program owns; it holds
      the whole other output side, padded to a power of two (at most B2B_MAX_HELD).
    block_inner: width of the intermediate chunk computed, passed through fn and consumed per
      step (the intermediate never exists in memory whole).
    block_k: step along the first product's contraction dim K.
    num_warps, num_stages: Triton's warps per program and software-pipelining depth.

    All fields are Python ints: tiles powers of two >= 16, warps 1, 2, 4, 8 or 16, stages
    >= 1; invalid values raise ValueError. Frozen and hashable.

    Example::

        config = jattn.B2BConfig(block_out=32, block_inner=32, block_k=32)
        a = jnp.ones((128, 64), jnp.float16)  # [M, K]
        b, c = jnp.ones((64, 96), jnp.float16), jnp.ones((96, 32), jnp.float16)  # [K, P], [P, N]
        out = jattn.b2b_matmul(a, b, c, config=config)  # (xla ignores the config)
        print(out.shape)  # (128, 32)
    """

    block_out: int = 64
    block_inner: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_tiles(self, "block_out", "block_inner", "block_k")
        check_warps(self, "num_warps")
        check_positive(self, "num_stages")


def b2b_held_width(size: int) -> int:
    """The power-of-two width a b2b program holds for an output side of `size`.

    The kernel runs when this is <= B2B_MAX_HELD; `jattn.b2b_matmul` falls back otherwise.
    """
    return dot_tile(size)


def heuristic_b2b_config(outer: int, held: int, inner: int, k: int,
                         dtype: np.dtype) -> B2BConfig:
    """Default b2b tiles: `outer` output rows/columns split over programs, `held` kept whole.

    Held side <= 128: the H100 sweep winner at M=8192, K=N=128, P=8192 in bf16 (64 x 128
    chunks, block_k 128, 4 warps, 3 stages; benchmarks/HISTORY.md).
    Wider held sides (untuned) get 8 warps and a narrower chunk so that accumulator and chunk
    stay in registers.
    """
    wide = held > 128
    return B2BConfig(block_out=_fit(64, outer), block_inner=_fit(32 if wide else 128, inner),
                     block_k=_fit(128 // max(1, np.dtype(dtype).itemsize // 2), k),
                     num_warps=8 if wide else 4, num_stages=3)
