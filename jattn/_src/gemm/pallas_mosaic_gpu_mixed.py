"""The weight-only GEMM on Mosaic GPU (Hopper: TMA, wgmma, warp specialisation), for
`mixed_matmul`: bf16/fp16 activations times int8 or int4 weights.

A weight-only product is read-bound at small M: the weights are the traffic, so the kernel
computes outᵀ = W · aᵀ with the weight rows as wgmma's M dimension (64 a consumer warpgroup)
and the tokens as its N. A producer warpgroup streams a program's weight rows and the
activations by TMA into a ring of `num_stages` slots; each consumer loads its 64 weight rows of
a K-step into registers in the layout whose 16-bit widening is wgmma's operand layout, widens
them (int4: the stored nibbles are biased by 8, so the top bit of each signed nibble is
flipped first, one xor for eight weights), and multiplies them with the activations' tile
read transposed from shared memory. Per-channel scales multiply the finished accumulator;
grouped scales multiply each K-step's product before it is added (the scale is constant
within a step: the group size is a multiple of the K-step).

A program takes `block_n` weight rows: 128 (each consumer 64 rows) or 64 (the consumers take
alternate K-steps of the same rows, and the second adds its accumulator into the first's
through shared memory at the end), which doubles the programs at small N so that every SM
streams weights. Programs are persistent, one per SM, and walk (token tile, weight rows)
pairs with the token tiles of the same rows next to each other (they share the weight tile in
L2). The output is stored transposed back to [M, N] through shared memory by TMA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._src import compat, hardware
from jattn._src.attention.pallas_mosaic_gpu_tiles import (PRODUCER_REGISTERS, ROW, SWIZZLE,
                                                           load, load_vector, operand_transforms)
from jattn._src.gemm.config import MosaicMixedConfig
from jattn._src.mesh_axes import kernel_operands, kernel_results, out_struct

CONSUMERS = 2  # consumer warpgroups per program
ROWS = 64  # weight rows of one consumer's wgmma (its M dimension)
DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16)))
_UPCAST = {8: plgpu.Layout.WGMMA_UPCAST_2X, 4: plgpu.Layout.WGMMA_UPCAST_4X}


def unsupported(*, dtype=None, n=None, k=None, bits=None, group_size=None, config=None,
                **facts) -> str | None:
    """Why the Mosaic weight-only GEMM cannot run a call (None when it can)."""
    if not hardware.is_hopper():
        return f"it needs a Hopper GPU (sm_90), not {hardware.device_kind()}."
    if config is not None and not isinstance(config, MosaicMixedConfig):
        return (f"a {type(config).__name__} gives pallas_triton's tiles; pass a "
                "MosaicMixedConfig for these kernels.")
    if dtype is not None and jnp.dtype(dtype) not in DTYPES:
        return f"it takes bfloat16 or float16 activations, not {jnp.dtype(dtype)}."
    if n is None or bits is None:
        return None
    block_n = config.block_n if config is not None else ROWS
    block_k = config.block_k if config is not None else 128
    if n % block_n or k % block_k:
        return (f"it takes N a multiple of {block_n} and K of {block_k} (its tiles), not "
                f"N, K = {n}, {k}.")
    if group_size is not None and group_size % block_k:
        return (f"group_size={group_size} is not a multiple of its K-step {block_k} (a "
                "K-step's scale must be one value per weight row).")
    return None


# Weights read a second, N = K = 8192, H100 (bench_gemm_variants, same run; HISTORY.md,
# session 39): at M = 64 this kernel reads int4 at 1.32 TB/s against pallas_triton's 0.84,
# int8 at 2.14 against 1.51, int4 in groups of 128 at 1.13 against 0.78; at M = 16 and below
# pallas_triton's is as fast or faster (M = 16: int4 1.54 against 1.61, int8 2.25 against
# 2.50; M = 1: 1.41 against 1.73). M between 16 and 64 is not measured.
_MIN_ROWS = 64


def slower(*, m=None, **facts) -> str | None:
    """Why the default choice passes this kernel over for a call it supports (measured)."""
    if m is not None and m < _MIN_ROWS:
        return (f"at M = {m} < {_MIN_ROWS} tokens pallas_triton's weight-only kernel reads the "
                "weights as fast or faster (measured at M = 1 and 16 on the H100).")
    return None


def _weight_transforms(bits: int, block_k: int):
    """A weight tile's shared-memory transforms: rows of one swizzle span (or the whole row
    where it is shorter: 64 bytes of int4 at block_k 128)."""
    row_bytes = min(SWIZZLE, block_k * bits // 8)
    return (plgpu.TilingTransform((8, row_bytes * 8 // bits)), plgpu.SwizzleTransform(row_bytes))


def _kernel(x_ref, w_ref, scales_ref, out_ref, *, config: MosaicMixedConfig, bits: int,
            tiles: tuple[int, int], k_steps: int, group_steps: int | None, interpreted: bool):
    """x_ref [M, K] activations, w_ref [N, K] int8/int4, scales_ref float32 [groups, N] (one
    row: per channel), out_ref [M, N]."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    alternate = bn == ROWS  # the consumers take alternate K-steps of the same rows
    grouped = group_steps is not None
    wg = lax.axis_index("wg")
    rows = slice(None) if alternate else pl.ds(wg * ROWS, ROWS)

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), memory_registers=PRODUCER_REGISTERS,
            in_specs=[plgpu.BlockSpec((bm, bk), lambda s: (0, s),
                                      transforms=operand_transforms()),
                      plgpu.BlockSpec((bn, bk), lambda s: (0, s),
                                      transforms=_weight_transforms(bits, bk))],
            wg_axis="wg", num_compute_wgs=CONSUMERS, max_concurrent_steps=config.num_stages,
            compute_context=context)

    def body(pipeline_allocations, out_smem, widened_smem=None, sum_smem=None, sum_ready=None,
             sum_taken=None):
        def widened(w_smem):
            """This consumer's weight rows of a K-step, widened to the activations' dtype,
            as wgmma's register operand (interpreted: in shared memory, the interpreter's
            wgmma reading shared-memory operands only)."""
            w = load(w_smem.at[rows], _UPCAST[bits], optimized=True)
            if bits == 4:  # stored + 8: flip each nibble's top bit to get the signed value
                w = w ^ jnp.asarray(-8, jnp.int4)
            w = plgpu.layout_cast(w, plgpu.Layout.WGMMA).astype(x_ref.dtype)
            if not interpreted:
                return w
            widened_smem.at[wg][...] = w
            plgpu.commit_smem()
            return widened_smem.at[wg]

        def mine(step):
            """Whether this consumer multiplies K-step `step`."""
            return lax.rem(step, CONSUMERS) == wg

        def multiply(acc_ref, x_smem, w_smem):
            """acc_ref += this consumer's weight rows · the K-step's activationsᵀ."""
            plgpu.wgmma(acc_ref, widened(w_smem), x_smem.T)
            plgpu.wgmma_wait(0)

        def step_into(indices, x_smem, w_smem, acc_ref):
            if alternate:
                pl.when(mine(indices[0]))(lambda: multiply(acc_ref, x_smem, w_smem))
            else:
                multiply(acc_ref, x_smem, w_smem)
            return acc_ref

        def store(acc, m0, n):
            """Per-channel scales, rounding, and the transposed store of a consumer's
            [ROWS, bm] into out[m0:, n:]."""
            if not grouped:
                scale = load_vector(scales_ref.at[0, pl.ds(n, ROWS)], ROW)
                acc = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
            out = plgpu.layout_cast(acc.astype(out_ref.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read
            out_smem.at[wg].T[...] = out
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], out_ref.at[pl.ds(m0, bm), pl.ds(n, ROWS)])

        def finish(acc, m0, n):
            """Stores a consumer's rows from n; with alternate steps the second consumer's sum
            is added into the first's through shared memory, and the first stores."""
            if not alternate:
                store(acc, m0, n)
                return

            @pl.when(wg == 1)
            def _hand_over():
                sum_smem[...] = acc
                plgpu.barrier_arrive(sum_ready)
                plgpu.barrier_wait(sum_taken)  # (read before the next tile rewrites it)

            @pl.when(wg == 0)
            def _add_and_store():
                plgpu.barrier_wait(sum_ready)
                other = load(sum_smem, plgpu.Layout.WGMMA)
                plgpu.barrier_arrive(sum_taken)
                store(acc + other, m0, n)

        @plgpu.nd_loop((tiles[0] * tiles[1],), collective_axes="programs")
        def _tile(loop):
            (index,) = loop.index
            # The token tiles of the same weight rows one after another: they share them in L2.
            tile_n, tile_m = lax.div(index, tiles[0]), lax.rem(index, tiles[0])
            m0, n0 = tile_m * bm, tile_n * bn
            n = n0 + (0 if alternate else wg * ROWS)  # this consumer's first weight row

            def step_scaled(indices, x_smem, w_smem, acc):
                (step,) = indices

                def product(part_ref):
                    multiply(part_ref, x_smem, w_smem)
                    return part_ref[...]

                def scaled():
                    # (the scales' load first: its latency passes under the wgmma)
                    scale = load_vector(scales_ref.at[lax.div(step, group_steps),
                                                      pl.ds(n, ROWS)], ROW)
                    part = pl.run_scoped(product, plgpu.ACC((ROWS, bm), jnp.float32))
                    return acc + part * lax.broadcast_in_dim(scale, part.shape, [0])

                return lax.cond(mine(step), scaled, lambda: acc) if alternate else scaled()

            def context(run):
                if grouped:
                    zeros = plgpu.layout_cast(jnp.zeros((ROWS, bm), jnp.float32),
                                              plgpu.Layout.WGMMA)
                    finish(run(zeros), m0, n)
                    return

                def accumulate(acc_ref):
                    run(acc_ref)
                    finish(acc_ref[...], m0, n)

                pl.run_scoped(accumulate, plgpu.ACC((ROWS, bm), jnp.float32))

            pipeline(step_scaled if grouped else step_into, context)(
                x_ref.at[pl.ds(m0, bm), :], w_ref.at[pl.ds(n0, bn), :],
                allocations=pipeline_allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    ignore = lambda *args, **kwargs: None  # the allocations depend on the specs alone
    scratch = {}
    if interpreted:
        scratch["widened_smem"] = plgpu.SMEM((CONSUMERS, ROWS, bk), x_ref.dtype,
                                             transforms=operand_transforms())
    if alternate:
        scratch.update(sum_smem=plgpu.SMEM((ROWS, bm), jnp.float32),
                       sum_ready=plgpu.Barrier(num_arrivals=1),
                       sum_taken=plgpu.Barrier(num_arrivals=1))
    pl.run_scoped(
        body,
        pipeline(ignore, ignore).get_allocations(x_ref, w_ref),
        plgpu.SMEM((CONSUMERS, bm, ROWS), out_ref.dtype, transforms=operand_transforms()),
        **scratch,
        collective_axes="wg",
    )


def mixed_matmul(x: jax.Array, weight: jax.Array, scales: jax.Array, *, bits: int,
                 group_size: int | None, config: MosaicMixedConfig, out_dtype) -> jax.Array:
    """x [M, K] @ dequantise(weight, scales): [M, N] of out_dtype.

    weight: int8 [N, K] (bits 8) or uint8 [N, K/2] (bits 4: two values per byte along K, even
    k in the low nibble, each stored + 8; read as int4 [N, K] without a copy); scales [groups,
    N]. N and K must be multiples of config's tiles and group_size of its K-step
    (`unsupported`); M is padded to config.block_m.
    """
    m, k = x.shape
    if bits == 4:
        weight = lax.bitcast_convert_type(weight, jnp.int4).reshape(weight.shape[0], k)
    n = weight.shape[0]
    bm = config.block_m
    padded = -(-m // bm) * bm
    if padded != m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    tiles = (padded // bm, n // config.block_n)
    kernel = functools.partial(
        _kernel, config=config, bits=bits, tiles=tiles, k_steps=k // config.block_k,
        group_steps=None if group_size is None else group_size // config.block_k,
        interpreted=compat.mosaic_gpu_interpreted())
    operands, axes = kernel_operands(x, weight, scales.astype(jnp.float32))
    out = plgpu.kernel(
        kernel,
        out_type=out_struct((padded, n), jnp.dtype(out_dtype), operands[0]),
        grid=(min(hardware.num_sms(), tiles[0] * tiles[1]),),
        grid_names=("programs",),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
    )(*operands)
    return kernel_results(out, axes)[:m]


# ------------------------------------------------------------------------------------------------
# The op's entry point (gemm/protocols.py: MixedBackend)
# ------------------------------------------------------------------------------------------------

def mixed_product(a: jax.Array, qweight: jax.Array, scales: jax.Array, *, bits: int,
                  group_size: int | None, config: MosaicMixedConfig, out_dtype,
                  interpret: bool = False) -> jax.Array:
    """MixedBackend.mixed_product: the kernel."""
    del interpret
    return mixed_matmul(a, qweight, scales, bits=bits, group_size=group_size, config=config,
                        out_dtype=out_dtype)
