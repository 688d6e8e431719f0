"""ring_flex_attention across devices against flex_attention on one device, same run.

    python -m benchmarks.bench_context_parallel [--lengths 32768,131072]
                                                [--masks causal,document,packed]
                                                [--strategies ring,all_gather,heads]
                                                [--devices 1,2,4,8] [--layouts contiguous,zigzag]
                                                [--kv-heads 16]
                                                [--smoke] [--json out.json]

For each device count (1, 2, 4, 8 where present, or --devices), layout and strategy:
forward+backward time of ring_flex_attention over a mesh of that many devices, and of
flex_attention on the whole sequence on one device where it fits; both sides get one BlockMask
of the whole sequence, built outside the timed step (the ring cuts its pairs' blocks from it).
Then what strategy="auto" runs and its time over the best's. Also, for 2, 4 and 8 devices
whatever is present, the work balance of a ring: the most (query, key) blocks one device's
queries visit over the mean, under each layout.
--smoke: small shapes, for a CPU with forced host devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jattn
from benchmarks import record
from benchmarks.timing import time_jax, warm_up
from jattn._src.ring import strategy as strategies
from jattn._src.ring.schedule import work_balance

SEQ = P(None, None, "seq")
BLOCK = 128


def _mask(kind: str, length: int):
    """causal; document: equal documents of 4k tokens (boundaries on shard and block
    boundaries); packed: documents of random lengths, 4k on average (boundaries inside
    blocks; one spans each shard boundary); causal inside documents."""
    if kind == "causal":
        return jattn.masks.causal_mask
    if kind == "packed":
        sizes = np.random.default_rng(length).integers(1024, 7169, length // 1024)
        ids = jnp.asarray(np.repeat(np.arange(sizes.size), sizes)[:length], jnp.int32)
        return jattn.masks.and_masks(jattn.masks.causal_mask, jattn.masks.document_mask(ids))
    documents = max(1, length // 4096)

    def document(b, h, q_idx, kv_idx):
        return (q_idx // (length // documents) == kv_idx // (length // documents)) & (
            q_idx >= kv_idx)

    return document


def _loss_grad(attention):
    """jit of (q, k, v, cotangent) -> the gradients of <attention(q, k, v), cotangent>: the
    cotangent an argument, as a training step's is (captured, the ring would slice each
    device's shard out of a constant of the whole sequence)."""
    return jax.jit(jax.grad(lambda q, k, v, cotangent: jnp.vdot(
        attention(q, k, v).astype(jnp.float32), cotangent), argnums=(0, 1, 2)))


def time_ring(devices: int, layout: str, strategy: str, block_mask, q, k, v,
              cotangent) -> float:
    mesh = Mesh(np.array(jax.devices()[:devices]), ("seq",))

    def local(q, k, v):
        return jattn.ring_flex_attention(q, k, v, axis_name="seq", layout=layout,
                                         block_mask=block_mask, strategy=strategy,
                                         enable_gqa=k.shape[1] < q.shape[1])

    ring = jax.shard_map(local, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
    sharded = NamedSharding(mesh, SEQ)
    args = [jax.device_put(x, sharded) for x in (q, k, v, cotangent)]
    return time_jax(_loss_grad(ring), [args])


def time_whole(block_mask, q, k, v, cotangent) -> float:
    step = _loss_grad(lambda q, k, v: jattn.flex_attention(
        q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] < q.shape[1]))
    return time_jax(step, [[q, k, v, cotangent]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--masks", default="causal,document,packed")
    parser.add_argument("--strategies", default="ring,all_gather,heads")
    parser.add_argument("--devices", default="1,2,4,8",
                        help="device counts to time, those present of them")
    parser.add_argument("--layouts", default="contiguous,zigzag")
    parser.add_argument("--kv-heads", type=int, help="GQA: fewer k/v heads than the 16 "
                        "query heads (default: as many)")
    parser.add_argument("--smoke", action="store_true", help="small shapes (CPU)")
    parser.add_argument("--json")
    args = parser.parse_args()
    heads, dim, dtype = (2, 32, jnp.float32) if args.smoke else (16, 128, jnp.bfloat16)
    lengths = [2048] if args.smoke else [int(x) for x in args.lengths.split(",")]
    present = len(jax.devices())
    counts = [d for d in map(int, args.devices.split(",")) if d <= present]
    print(f"device: {jax.devices()[0].device_kind} x {present}; jax {jax.__version__}")
    warm_up()
    rows = []
    for length in lengths:
        keys = jax.random.split(jax.random.key(0), 4)
        kv_heads = args.kv_heads or heads
        q, cotangent = (jax.random.normal(key, (1, heads, length, dim), dtype)
                        for key in keys[:2])
        k, v = (jax.random.normal(key, (1, kv_heads, length, dim), dtype) for key in keys[2:])
        for kind in args.masks.split(","):
            mask_mod = _mask(kind, length)
            # One BlockMask of the whole sequence, built outside the timed step for both
            # sides (as a training loop builds it once per batch): the ring cuts its pairs'
            # blocks from it.
            block_mask = jattn.create_block_mask(mask_mod, None, None, length, length,
                                                 block_size=BLOCK)
            try:
                whole = time_whole(block_mask, q, k, v, cotangent)
            except Exception as error:  # out of memory at the longest lengths
                whole = float("nan")
                print(f"  one device, whole sequence: {type(error).__name__}", flush=True)
            for devices in counts:
                for layout in args.layouts.split(","):
                    timed = {}
                    for strategy in args.strategies.split(","):
                        if strategy == "heads" and kv_heads % devices:
                            continue
                        seconds = time_ring(devices, layout, strategy, block_mask, q, k, v,
                                            cotangent)
                        timed[strategy] = seconds
                        rows.append({"length": length, "mask": kind, "devices": devices,
                                     "heads": heads, "kv_heads": kv_heads, "layout": layout,
                                     "strategy": strategy, "ring_ms": seconds * 1e3,
                                     "whole_one_device_ms": whole * 1e3,
                                     "speedup_vs_one_device": whole / seconds})
                        print(f"L {length:>6} Hkv {kv_heads:>2} {kind:>8} {devices} devices "
                              f"{layout:>10} {strategy:>10}: {seconds * 1e3:9.2f} ms  one "
                              f"device {whole * 1e3:9.2f} ms  speed-up {whole / seconds:5.2f}",
                              flush=True)
                        record.write(args.json, rows)
                    # "auto" runs the strategy ring_flex_attention resolves it to
                    chosen = strategies.resolved(
                        "auto", block_mask=block_mask, has_mask_mod=False, num_devices=devices,
                        layout=layout, heads=heads, kv_heads=kv_heads)
                    if chosen in timed:
                        best = min(timed, key=timed.get)
                        rows.append({"length": length, "mask": kind, "devices": devices,
                                     "layout": layout, "auto_runs": chosen, "best": best,
                                     "auto_over_best": timed[chosen] / timed[best]})
                        print(f"L {length:>6} Hkv {kv_heads:>2} {kind:>8} {devices} devices "
                              f"{layout:>10}       auto: runs {chosen}, best {best}, "
                              f"{timed[chosen] / timed[best]:.3f}x the best's time", flush=True)
            for devices in (2, 4, 8):
                balance = {layout: work_balance(block_mask, devices, layout)
                           for layout in ("contiguous", "zigzag")}
                rows.append({"length": length, "mask": kind, "balance_devices": devices,
                             "work_max_over_mean": balance})
                print(f"L {length:>6} {kind:>8} ring of {devices}: work max/mean "
                      f"contiguous {balance['contiguous']:.2f}, zigzag {balance['zigzag']:.2f}",
                      flush=True)
    record.write(args.json, rows)


if __name__ == "__main__":
    main()
