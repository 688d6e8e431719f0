"""The GEMM kernel on Mosaic GPU (Hopper: TMA, wgmma, warp specialisation), for `matmul`, `bmm`
and `scaled_matmul`.

Programs are persistent, one per SM, and take output tiles in a snaking band order
(`MosaicMatmulConfig.minor` / `group`) so that the programs running at once share A rows and B
columns in L2. Each has three warpgroups: a producer streams the tile's A and B K-steps by TMA
into a ring of `num_stages` shared-memory slots, and two consumers each accumulate half of the
tile with wgmma in float32 registers. A consumer then scales its rows and columns (fp8), adds
the bias, rounds to the output dtype and stores through shared memory in pieces of 64 rows by
128 bytes by TMA, two in flight, while the producer already streams the next tile's K-steps.
A batch of matrices (bmm, jax.vmap) is one launch: the programs walk every matrix's tiles.

fp8 operands are read K-major (b as its transpose [N, K], as wgmma takes 8-bit operands).
Without fast accumulation each K-step's partial sums go to a second float32 accumulator that
is added to the first, so the tensor cores' reduced-precision accumulation spans 128 K
elements only (as `torch._scaled_mm` and DeepGEMM promote).

What it runs is narrower than pallas_triton's kernel (`unsupported` says what): 16-bit or fp8
operands, M and N multiples of its tiles and K of its K-step, no epilogue. A product of a
backward pass it cannot tile runs on the op's default choice for that product (`gemm.api`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._src import hardware
from jattn._src.attention.pallas_mosaic_gpu_tiles import (COLUMN, PRODUCER_REGISTERS, ROW,
                                                           SWIZZLE, load_vector)
from jattn._src.gemm.config import (MOSAIC_PROMOTED_VALUES, MatmulConfig, MosaicMatmulConfig,
                                    mosaic_block_k)
from jattn._src.mesh_axes import kernel_operands, kernel_results, out_struct
from jattn._src.user_functions import TracedFunction

CONSUMERS = 2  # consumer warpgroups per program
DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn,
                               jnp.float8_e5m2)))
_PIECE_ROWS = 64  # an output piece: 64 rows of one swizzle span (config.MOSAIC_STAGING_BYTES)


def unsupported(*, dtype=None, m=None, n=None, k=None, epilogue=False, config=None,
                **facts) -> str | None:
    """Why the Mosaic GEMM cannot run a call (None when it can)."""
    if not hardware.is_hopper():
        return f"it needs a Hopper GPU (sm_90), not {hardware.device_kind()}."
    if isinstance(config, MatmulConfig):
        return ("a MatmulConfig gives pallas_triton's tiles; pass a MosaicMatmulConfig for "
                "these kernels.")
    if dtype is not None and jnp.dtype(dtype) not in DTYPES:
        return f"it takes bfloat16, float16 or fp8 operands, not {jnp.dtype(dtype)}."
    if epilogue:
        return "an epilogue is fused by pallas_triton's kernel only."
    step = None if dtype is None else mosaic_block_k(dtype)
    if isinstance(config, MosaicMatmulConfig) and step is not None and config.block_k != step:
        return (f"{jnp.dtype(dtype)} operands take MosaicMatmulConfig.block_k={step} (one "
                f"128-byte swizzle span), not {config.block_k}.")
    if m is not None and step is not None:
        rows, cols = ((config.block_m, config.block_n)
                      if isinstance(config, MosaicMatmulConfig) else (128, 128))
        if m % rows or n % cols or k % step:
            return (f"it takes M a multiple of {rows}, N of {cols} and K of {step} "
                    f"(its tiles), not M, N, K = {m}, {n}, {k}.")
    return None


# With its default tiles (`heuristic_mosaic_config`: smaller tiles where the 128 x 256 ones
# would leave SMs idle) this kernel ran 1.22x pallas_triton's at 1024^3 and 512 x 4096 x 4096,
# 1.28x at a bmm of 64 [512, 128] x [128, 512] products (2**24 outputs in one launch), and
# within 1% of it at M = 128, N = K = 8192 (H100, bf16). Skinny products stay on
# pallas_triton, which also splits K; below 2**20 outputs a launch is not measured.
_SKINNY_ROWS = 256
_SMALL_OUTPUT = 2**20
# A torch op call launches pallas_triton's kernel without JAX's dispatch, saving 0.3-0.6 ms of
# host time (measured for flex_attention's forward); this kernel saves 4% of the Triton
# kernel's GPU time at 4096^3 and 8192^3 and ~1.5 us at 1024^3, which repays that only from
# ~4·10^12 FLOPs (an estimate from those measurements, beyond 8192^3).
TORCH_EAGER_MIN_WORK = 4 * 10**12


def slower(*, m=None, n=None, batch=1, torch_eager_work=None, **facts) -> str | None:
    """Why the default choice passes this kernel over for a call it supports (measured).
    batch: products of this shape in one launch (bmm)."""
    if m is not None and m < _SKINNY_ROWS:
        return (f"a product of M = {m} < {_SKINNY_ROWS} rows runs as fast on pallas_triton's "
                "kernel (measured at M = 128), which also splits K.")
    if m is not None and batch * m * n < _SMALL_OUTPUT:
        return (f"an output of {batch} x {m} x {n} < 2**20 values: pallas_triton's small "
                "tiles (not measured against this kernel there).")
    if torch_eager_work is not None and torch_eager_work < TORCH_EAGER_MIN_WORK:
        return ("a torch op call launches pallas_triton's kernel without JAX's dispatch, which "
                "saves more host time than this kernel saves GPU time below 4·10^12 FLOPs.")
    return None


# Vector operands after a and b, in this order where present: per-row and per-column scales
# (float32 [M], [N]) multiply the accumulator, then the bias (float32 [N]) is added.
VECTORS = ("row_scale", "col_scale", "bias")


def _kernel(a_ref, b_ref, *refs, config: MosaicMatmulConfig, tiles: tuple[int, int],
            k_steps: int, transpose_a: bool, transpose_b: bool, vectors: tuple[str, ...],
            promote: bool):
    """Over a batch: a_ref [batch or 1, ...], b_ref likewise, out_ref [batch, M, N]; an operand
    of batch 1 is shared by every matrix."""
    vector_refs = dict(zip(vectors, refs))
    out_ref = refs[-1]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    rows, cols = config.warpgroup_tile
    epi_rows, epi_cols = _PIECE_ROWS, SWIZZLE // jnp.dtype(out_ref.dtype).itemsize
    wg = lax.axis_index("wg")
    wg_rows = pl.ds(wg * rows, rows) if config.split == "m" else slice(None)
    wg_cols = pl.ds(wg * cols, cols) if config.split == "n" else slice(None)
    transforms = (plgpu.TilingTransform((8, bk)), plgpu.SwizzleTransform(SWIZZLE))
    a_block, a_index = ((bk, bm), lambda s: (s, 0)) if transpose_a else ((bm, bk),
                                                                         lambda s: (0, s))
    b_block, b_index = ((bn, bk), lambda s: (0, s)) if transpose_b else ((bk, bn),
                                                                         lambda s: (s, 0))

    def pipeline(body, context):
        spec = functools.partial(plgpu.BlockSpec, transforms=transforms)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), memory_registers=PRODUCER_REGISTERS,
            in_specs=[spec(a_block, a_index), spec(b_block, b_index)],
            wg_axis="wg", num_compute_wgs=CONSUMERS,
            max_concurrent_steps=config.num_stages, compute_context=context)

    def operands(a_smem, b_smem):
        a = a_smem.at[:, wg_rows].T if transpose_a else a_smem.at[wg_rows]
        b = b_smem.at[wg_cols].T if transpose_b else b_smem.at[:, wg_cols]
        return a, b

    def mma(indices, a_smem, b_smem, acc_ref):
        plgpu.wgmma(acc_ref, *operands(a_smem, b_smem))
        # The slot goes back to the producer when this returns. (Leaving one wgmma in flight
        # across steps, releasing slots a step later, measured the same: HISTORY.md.)
        plgpu.wgmma_wait(0)
        return acc_ref

    def mma_promoted(indices, a_smem, b_smem, acc):
        def partial(part_ref):
            plgpu.wgmma(part_ref, *operands(a_smem, b_smem))
            plgpu.wgmma_wait(0)
            return part_ref[...]

        return acc + pl.run_scoped(partial, plgpu.ACC((rows, cols), jnp.float32))

    def store(acc, out_mat, out_m0, out_n0, out_smem):
        """Scales, bias, rounding, then the TMA stores of a consumer's [rows, cols] into
        out_mat."""
        if "row_scale" in vectors:
            scale = load_vector(vector_refs["row_scale"].at[pl.ds(out_m0, rows)], ROW)
            acc = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
        for name in ("col_scale", "bias"):
            if name in vectors:
                vector = load_vector(vector_refs[name].at[pl.ds(out_n0, cols)], COLUMN)
                vector = lax.broadcast_in_dim(vector, acc.shape, [1])
                acc = acc * vector if name == "col_scale" else acc + vector
        out = acc.astype(out_ref.dtype)
        # The previous tile's stores have read the staging before it is rewritten.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        pieces = [(i, j) for i in range(rows // epi_rows) for j in range(cols // epi_cols)]
        for piece, (i, j) in enumerate(pieces):
            slot = out_smem.at[wg, piece % 2]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            slot[...] = out[i * epi_rows:(i + 1) * epi_rows, j * epi_cols:(j + 1) * epi_cols]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                slot, out_mat.at[pl.ds(out_m0 + i * epi_rows, epi_rows),
                                 pl.ds(out_n0 + j * epi_cols, epi_cols)])

    def body(pipeline_allocations, out_smem):
        minor = 0 if config.minor == "m" else 1
        per_matrix = tiles[0] * tiles[1]

        # Matrix by matrix, each one's tiles in the snaking band order.
        @plgpu.nd_loop((out_ref.shape[0] * per_matrix,), collective_axes="programs")
        def _tile(loop):
            (index,) = loop.index
            matrix, index = lax.div(index, per_matrix), lax.rem(index, per_matrix)
            tile_m, tile_n = plgpu.planar_snake(index, tiles, minor, config.group)
            m0, n0 = tile_m * bm, tile_n * bn
            a_mat = a_ref.at[matrix if a_ref.shape[0] > 1 else 0]
            b_mat = b_ref.at[matrix if b_ref.shape[0] > 1 else 0]
            a_panel = (a_mat.at[:, pl.ds(m0, bm)] if transpose_a
                       else a_mat.at[pl.ds(m0, bm), :])
            b_panel = (b_mat.at[pl.ds(n0, bn), :] if transpose_b
                       else b_mat.at[:, pl.ds(n0, bn)])
            out_m0 = m0 + (wg * rows if config.split == "m" else 0)
            out_n0 = n0 + (wg * cols if config.split == "n" else 0)

            def context(run):
                if promote:
                    zeros = jnp.zeros((rows, cols), jnp.float32)
                    store(run(plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)), out_ref.at[matrix],
                          out_m0, out_n0, out_smem)
                    return

                def accumulate(acc_ref):
                    run(acc_ref)
                    store(acc_ref[...], out_ref.at[matrix], out_m0, out_n0, out_smem)

                pl.run_scoped(accumulate, plgpu.ACC((rows, cols), jnp.float32))

            pipeline(mma_promoted if promote else mma, context)(
                a_panel, b_panel, allocations=pipeline_allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_transforms = (plgpu.TilingTransform((8, epi_cols)), plgpu.SwizzleTransform(SWIZZLE))
    ignore = lambda *args, **kwargs: None  # the allocations depend on the specs alone
    pl.run_scoped(
        body,
        pipeline(ignore, ignore).get_allocations(a_ref.at[0], b_ref.at[0]),
        plgpu.SMEM((CONSUMERS, 2, epi_rows, epi_cols), out_ref.dtype,
                   transforms=out_transforms),
        collective_axes="wg",
    )


def matmul(a: jax.Array, b: jax.Array, *, config: MosaicMatmulConfig, out_dtype,
           transpose_a: bool = False, transpose_b: bool = False,
           row_scale: jax.Array | None = None, col_scale: jax.Array | None = None,
           bias: jax.Array | None = None, promote: bool = False) -> jax.Array:
    """(op(a) @ op(b)) · row_scale[:, None] · col_scale[None, :] + bias, accumulated in float32:
    [M, N] of out_dtype.

    a: [M, K] ([K, M] with transpose_a); b: [K, N] ([N, K] with transpose_b), 16-bit or fp8
    (fp8: transpose_b, transpose_a False); row_scale [M], col_scale and bias [N], any float
    dtype (None: left out). promote: each K-step's partial sums go to a second accumulator
    (fp8's precise accumulation). M and N must be multiples of config's tile and K of its
    K-step (`unsupported`). Under jax.vmap the matrices of a batch run in one launch, its
    programs walking every matrix's tiles (an operand the vmap does not batch is shared).
    """
    rows, cols = config.warpgroup_tile
    if promote and rows * cols > MOSAIC_PROMOTED_VALUES:
        raise ValueError(
            f"promoted accumulation needs a second accumulator: a consumer's [{rows}, {cols}] "
            f"tile must hold at most {MOSAIC_PROMOTED_VALUES} values (e.g. "
            "MosaicMatmulConfig(block_m=128, block_n=128, block_k=128, split='m')), or pass "
            "use_fast_accum=True.")
    given = dict(row_scale=row_scale, col_scale=col_scale, bias=bias)
    vectors = tuple(name for name in VECTORS if given[name] is not None)
    launch = _batched_launch(config, jnp.dtype(out_dtype), transpose_a, transpose_b, vectors,
                             promote)
    return launch(a[None], b[None], *(given[name] for name in vectors))[0]


def _batched_launch(config: MosaicMatmulConfig, out_dtype, transpose_a: bool, transpose_b: bool,
                    vectors: tuple[str, ...], promote: bool):
    """The kernel over a batch of matrices: a [batch or 1, ...] and b [batch or 1, ...] to
    [batch, M, N], with a vmap rule that folds the vmapped axis into the batch."""

    @jax.custom_batching.custom_vmap
    def launch(a, b, *vector_values):
        m, k = a.shape[:0:-1] if transpose_a else a.shape[1:]
        n = b.shape[1] if transpose_b else b.shape[2]
        batch = max(a.shape[0], b.shape[0])
        tiles = (m // config.block_m, n // config.block_n)
        kernel = functools.partial(_kernel, config=config, tiles=tiles,
                                   k_steps=k // config.block_k, transpose_a=transpose_a,
                                   transpose_b=transpose_b, vectors=vectors, promote=promote)
        operands, axes = kernel_operands(a, b, *(x.astype(jnp.float32) for x in vector_values))
        out = plgpu.kernel(
            kernel,
            out_type=out_struct((batch, m, n), out_dtype, operands[0]),
            grid=(min(hardware.num_sms(), batch * tiles[0] * tiles[1]),),
            grid_names=("programs",),
            num_threads=CONSUMERS + 1,
            thread_name="wg",
        )(*operands)
        return kernel_results(out, axes)

    @launch.def_vmap
    def _vmapped(size, in_batched, a, b, *vector_values):
        if any(in_batched[2:]):  # per-instance scales or bias: one launch per instance
            args = [x if batched else jnp.broadcast_to(x, (size,) + x.shape)
                    for x, batched in zip((a, b, *vector_values), in_batched)]
            return lax.map(lambda xs: launch(*xs), tuple(args)), True
        batch = max(x.shape[int(batched)] for x, batched in zip((a, b), in_batched))
        a, b = (_folded(x, batched, size, batch) for x, batched in zip((a, b), in_batched[:2]))
        out = launch(a, b, *vector_values)
        return out.reshape((size, batch) + out.shape[1:]), True

    return launch


def _folded(x: jax.Array, batched: bool, size: int, batch: int) -> jax.Array:
    """An operand [batch or 1, ...] (vmapped: [size, batch or 1, ...]) as one of a batch of
    size · batch matrices: [size · batch, ...], or [1, ...] where every matrix shares it
    (copied only where it is shared along one of the two axes but not the other)."""
    if not batched and x.shape[0] == 1:
        return x
    x = jnp.broadcast_to(x if batched else x[None], (size, batch) + x.shape[1 + batched:])
    return x.reshape((size * batch,) + x.shape[2:])


# ------------------------------------------------------------------------------------------------
# The ops' entry points (gemm/protocols.py: MatmulBackend, ScaledBackend)
# ------------------------------------------------------------------------------------------------

def matmul_product(a: jax.Array, b: jax.Array, bias: jax.Array | None, captures: Sequence[Any],
                   *, config: MosaicMatmulConfig, out_dtype, transpose_a: bool = False,
                   transpose_b: bool = False, epilogue_tile: TracedFunction | None = None,
                   epilogue_full: TracedFunction | None = None, save_preact: bool = False,
                   interpret: bool = False):
    """MatmulBackend.matmul_product: the kernel (calls with an epilogue never resolve here)."""
    del captures, epilogue_tile, epilogue_full, save_preact, interpret
    return matmul(a, b, config=config, out_dtype=out_dtype, transpose_a=transpose_a,
                  transpose_b=transpose_b, bias=bias)


def scaled_product(a: jax.Array, b: jax.Array, scale_a: jax.Array, scale_b: jax.Array,
                   bias: jax.Array | None, *, config: MosaicMatmulConfig, out_dtype,
                   use_fast_accum: bool = False, interpret: bool = False) -> jax.Array:
    """ScaledBackend.scaled_product: b read as its transpose [N, K] (K-major, as wgmma takes fp8;
    under jit XLA cancels the transpose of weights stored [N, K]); a tensor-wise scale_a
    folds into the column scales."""
    del interpret
    (m, _), n = a.shape, b.shape[1]
    col_scale = jnp.broadcast_to(scale_b.reshape(-1), (n,))
    row_scale = None
    if scale_a.size == 1:
        col_scale = col_scale * scale_a.reshape(())
    else:
        row_scale = scale_a.reshape(m)
    return matmul(a, b.T, config=config, out_dtype=out_dtype, transpose_b=True,
                  row_scale=row_scale, col_scale=col_scale, bias=bias,
                  promote=not use_fast_accum)
