"""The weight-only quantized GEMM kernel (int8, or int4 two per byte) in Pallas, lowered to Triton.

a [M, K] (bf16 or f16) times a weight held as integers, stored output-channel-major (K
contiguous, as torch.nn.Linear keeps weights): int8 [N, K], or uint8 [N, K/2] with two int4
values per byte along K (even k in the low nibble, odd k in the high one, each stored + 8).
Each K step loads the integer tile [bn, chunk] (or [bn, chunk/2] bytes), widens it to a's dtype
in registers and runs a tensor-core dot against its transpose into fp32; the dequantised weight
never exists in memory. Read K-major, each byte already holds the two neighbouring k the dot
wants side by side: the nibbles are joined along a new minor axis, not interleaved through
memory. int4 values are widened by bit pattern (see _MAGIC; inline PTX for row tiles <= 16,
where the activations are split into even and odd columns instead); int8 by a conversion.

Scales: per channel ([1, N]) multiply the finished fp32 tile. Per group of `group_size` K rows
([K / group_size, N]) multiply each group's partial dot, so a K step is walked in chunks that lie
inside one group (the largest power of two dividing group_size, at most block_k).

Tiles, grid, split-K and tail masking are the dense GEMM's (pallas_triton).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jattn._src.gemm.config import MatmulConfig
from jattn._src.gemm.pallas_triton import _tile_coords, tile_grid, tile_outputs, walk_k
from jattn._src.pallas_triton.compile import compiler_params
from jattn._src.pallas_triton.masked import both, bounds, load, store
from jattn._src.tiling import cdiv


# Integer -> float without conversion instructions (a quarter-rate unit that bounded the int4
# kernel): OR-ing an unsigned u < 2^mantissa_bits into the bit pattern of a power of two `base`
# gives the float base + u exactly. A dot on such tiles exceeds the true one by
# (base + bias) · rowsum(a), which is subtracted in fp32 ((bits of base, base) per dtype).
_MAGIC = {jnp.dtype(jnp.bfloat16): (0x4300, 128), jnp.dtype(jnp.float16): (0x6400, 1024)}


def _biased(u, dtype):
    """int16 tile of values in [0, 2^mantissa_bits) -> `dtype` tile of base + u, bit-exactly."""
    return lax.bitcast_convert_type(u | jnp.int16(_MAGIC[jnp.dtype(dtype)][0]), dtype)


def _nibbles(q):
    """uint8 tile of packed int4 -> (low, high) nibbles as int16 tiles (element-wise jnp)."""
    packed = q.astype(jnp.int16)
    return packed & 15, packed >> 4


def _nibble_planes(q, dtype, interpret: bool):
    """uint8 tile of packed int4 (+8) -> (low, high) nibble planes as `dtype` tiles of
    base + nibble (see _MAGIC), bit-exactly.

    On the GPU, inline PTX per 4 bytes and plane: two byte permutes spread the bytes over 16-bit
    lanes, and one AND-OR (lop3) per pair of values masks a nibble into the float's mantissa:
    ~1.25 instructions per weight, where the element-wise jnp form costs ~4 (including an
    integer narrowing that runs at quarter rate). (One asm per plane: Pallas lowers only one
    result per inline asm.)
    """
    if interpret:
        return tuple(_biased(plane, dtype) for plane in _nibbles(q))
    magic = _MAGIC[jnp.dtype(dtype)][0] * 0x10001

    def plane(shift: int):
        # $2 holds bytes b0..b3; $0 gets the nibbles of (b0, b1), $1 those of (b2, b3).
        asm = f"""{{
        .reg .b32 t01, t23;
        prmt.b32 t01, $2, 0, 0x4140;
        prmt.b32 t23, $2, 0, 0x4342;
        {f"shr.u32 t01, t01, {shift};" if shift else ""}
        {f"shr.u32 t23, t23, {shift};" if shift else ""}
        lop3.b32 $0, t01, 0x000F000F, {magic:#x}, 0xEA;
        lop3.b32 $1, t23, 0x000F000F, {magic:#x}, 0xEA;
        }}"""
        return plgpu.elementwise_inline_asm(
            asm, args=[q], constraints="=r,=r,r", pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(q.shape, dtype)])[0]

    return plane(0), plane(4)


# Row tiles up to this size widen int4 with _nibble_planes' inline PTX, which is much faster
# than the jnp form at M=16 (H100, N=K=8192, 4 stages; benchmarks/HISTORY.md). At M=64 the
# split activation tile costs more than the widening saves, and joining the asm planes back
# into k order gives wrong results on the GPU, so larger tiles keep the jnp form.
ASM_WIDENING_ROWS = 16


def _row_sum(x):
    return jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)


def _dot_t(x, w):
    """x [m, k] @ w[n, k]ᵀ in fp32."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def group_chunk(group_size: int, block_k: int) -> int:
    """K rows the kernel multiplies per dot under per-group scales: a power of two dividing
    group_size (so a chunk never straddles two groups), at most block_k."""
    return min(block_k, group_size & -group_size)


def _mixed_kernel(a_ref, q_ref, s_ref, out_ref, *, m: int, n: int, k: int, bits: int,
                  group_size: int | None, config: MatmulConfig, interpret: bool):
    bm, bn, bk, split_k = config.block_m, config.block_n, config.block_k, config.split_k
    grid_ids = [pl.program_id(axis) for axis in range(2 if config.group_m == 1 else 1)]
    pid_m, pid_n = _tile_coords(grid_ids, cdiv(m, bm), cdiv(n, bn), config.group_m)
    m0, n0 = pid_m * bm, pid_n * bn
    row_mask = bounds(m0, bm, m if m % bm else None, 0)
    col_mask = bounds(n0, bn, n if n % bn else None, 1)
    channel_mask = bounds(n0, bn, n if n % bn else None, 0)  # the weight tile's rows
    chunk = bk if group_size is None else group_chunk(group_size, bk)
    width = chunk * bits // 8  # bytes of one weight row per chunk

    def chunk_dot(k0, w0, k_bound):
        """a[rows, k0:k0+chunk] @ the chunk's integer weight rows (unscaled), in fp32; w0 is
        the chunk's first weight byte."""
        a = load(a_ref, (slice(None), pl.ds(k0, chunk)),
                 both(row_mask, bounds(k0, chunk, k_bound, 1)))
        # K is even for int4, so a ragged tail ends on a whole byte.
        w_bound = None if k_bound is None else k_bound * bits // 8
        q = load(q_ref, (slice(None), pl.ds(w0, width)),
                 both(channel_mask, bounds(w0, width, w_bound, 1)))
        if bits == 8:
            return _dot_t(a, q.astype(a.dtype))
        # Each byte holds q + 8 for k = 2i (low nibble) and 2i + 1 (high).
        excess = (_MAGIC[a.dtype][1] + 8) * _row_sum(a)
        if bm <= ASM_WIDENING_ROWS:
            # The activations split into even and odd columns, each meeting one nibble plane.
            low, high = _nibble_planes(q, a.dtype, interpret)
            a_even, a_odd = lax.unstack(a.reshape(bm, chunk // 2, 2), axis=2)
            return _dot_t(a_even, low) + _dot_t(a_odd, high) - excess
        # The nibbles joined as neighbours, back in k order.
        nibbles = jnp.stack(_nibbles(q), axis=-1).reshape(bn, chunk)
        return _dot_t(a, _biased(nibbles, a.dtype)) - excess

    def k_step(step, acc, k_bound=None):
        static = isinstance(step, int)  # the ragged tail's step is known at trace time
        for c in range(bk // chunk):
            if static and step * bk + c * chunk >= k:
                break  # a chunk wholly past K (per-group tails end on a group boundary)
            if static:
                k0 = jnp.int32(step * bk + c * chunk)
                w0 = jnp.int32((step * bk + c * chunk) * bits // 8)
            else:  # offsets with alignment hints, so that Triton vectorises the loads
                step_bytes = bk * bits // 8
                k0 = pl.multiple_of(step * bk, bk) + c * chunk
                w0 = pl.multiple_of(step * step_bytes, step_bytes) + c * width
            part = chunk_dot(k0, w0, k_bound)
            if group_size is not None:
                scale = load(s_ref, (pl.ds(k0 // group_size, 1), slice(None)), col_mask)
                part = part * scale.astype(jnp.float32)
            acc = acc + part
        return acc

    acc = walk_k(k_step, k, bk, split_k, acc=jnp.zeros((bm, bn), jnp.float32),
                 split_id=pl.program_id(len(grid_ids)) if split_k > 1 else 0)
    if group_size is None:  # per-channel: linear, so split-K partials may carry it too
        acc = acc * load(s_ref, ..., col_mask).astype(jnp.float32)
    store(out_ref, ..., acc.astype(out_ref.dtype), both(row_mask, col_mask))


def mixed_matmul(a: jax.Array, qweight: jax.Array, scales: jax.Array, *, bits: int,
                 group_size: int | None, config: MatmulConfig, out_dtype,
                 interpret: bool = False) -> jax.Array:
    """a @ dequantise(qweight, scales), dequantising in registers, fp32 accumulation.

    a: [M, K] bfloat16 or float16. qweight: int8 [N, K] (bits=8) or uint8 [N, K/2] (bits=4,
    K even). scales: [1, N] (per channel, group_size None) or [K / group_size, N], any float
    dtype. group_size: a multiple of 16 (bits=8) or 32 (bits=4) dividing K, or None.
    Returns [M, N] of out_dtype, or with config.split_k > 1 the fp32 partial sums
    [split_k, M, N], to be added by the caller.
    """
    (m, k), n = a.shape, qweight.shape[0]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    grid, rows, cols = tile_grid(m, n, config)
    k_span = cdiv(k, bk) * bk  # whole K steps: windows past the end are masked (see matmul)
    in_specs = [
        pl.BlockSpec((bm, k_span), lambda *ids: (rows(*ids), 0)),
        pl.BlockSpec((bn, k_span * bits // 8), lambda *ids: (cols(*ids), 0)),
        pl.BlockSpec((scales.shape[0], bn), lambda *ids: (0, cols(*ids))),
    ]
    out_shape, out_specs = tile_outputs(m, n, config, out_dtype, rows, cols)
    kernel = functools.partial(_mixed_kernel, m=m, n=n, k=k, bits=bits, group_size=group_size,
                               config=config, interpret=interpret)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape[0],
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs[0],
        compiler_params=compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name=f"jattn_mixed_matmul_int{bits}",
    )(a, qweight, scales)


def mixed_product(a: jax.Array, qweight: jax.Array, scales: jax.Array, *, bits: int,
                  group_size: int | None, config: MatmulConfig, out_dtype,
                  interpret: bool = False) -> jax.Array:
    """MixedBackend.mixed_product: the kernel, its split-K partial sums added."""
    out = mixed_matmul(a, qweight, scales, bits=bits, group_size=group_size, config=config,
                       out_dtype=out_dtype, interpret=interpret)
    return out if config.split_k == 1 else out.sum(axis=0).astype(out_dtype)
