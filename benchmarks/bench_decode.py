"""Flex decoding on the GPU: GB/s of K+V read against the copy ceiling and three decoders.

    python -m benchmarks.bench_decode [--only B8] [--sweep] [--json out.json]

Problem (issue 5): one query per sequence, Hq 32, Hkv 8, D 128, bf16; B in {1, 8, 32}, kv
length in {8k, 32k, 128k}. Bytes: K and V read once, 2·B·Hkv·S·D·2; GB/s = bytes / median time.
Same run, same inputs (shared with torch through DLPack, no copies):
- the device copy ceiling: torch `dst.copy_(src)` of 2 GiB, counted as read + write bytes;
- torch SDPA (`scaled_dot_product_attention(enable_gqa=True)`), CUDA-graph replay;
- torch flex decoding: `torch.compile(flex_attention)(enable_gqa=True)` with q_len 1, replay;
- JAX's Pallas decode (`jax.experimental.pallas.ops.gpu.decode_attention.gqa`, defaults), called
  on its own layout [B, S, Hkv, D] (it transposes K and V inside, which it pays for).
jattn: `flex_decode` with its default config, and at the two target shapes also with per-batch
lengths (`kv_len` array: the serving path) and through a paged cache (64-position pages in
random pool order). `--sweep` times tile/stage/split variants at the target shapes.
Each row is written to --json as soon as it is measured, so a cut-off run keeps its rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import record
from benchmarks.timing import first_call_seconds, input_copies, time_jax, time_torch, warm_up
from jattn._src.decoding.api import flex_decode
from jattn._src.attention.split_kv import make_problem
from jattn._src.attention.split_kv_config import DecodeConfig
from jattn._src.hardware import num_sms
from jattn._src.decoding.paged import PagedKVCache

HQ, HKV, D = 32, 8, 128
CASES = [(B, S) for B in (1, 8, 32) for S in (8192, 32768, 131072)]
TARGETS = {(8, 32768), (1, 131072)}  # >= 2.4 TB/s and >= 3x torch flex decoding here
PAGE = 64
COPY_BYTES = 2 * 2**30


def copy_ceiling() -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written)."""
    import torch

    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    seconds = time_torch(lambda a, b: b.copy_(a), [[src, dst]])
    return 2 * COPY_BYTES / seconds / 1e9


def _input_sets(B: int, S: int):
    kv_bytes = 2 * B * HKV * S * D * 2
    rng = np.random.default_rng(0)
    sets = []
    for i in range(input_copies(kv_bytes)):
        key = jax.random.key(i)
        q = jnp.asarray(rng.standard_normal((B, HQ, 1, D)), jnp.bfloat16)
        k, v = (jax.random.normal(jax.random.fold_in(key, j), (B, HKV, S, D), jnp.bfloat16)
                for j in range(2))
        sets.append([q, k, v])
    return sets, kv_bytes


def _paged(sets, S: int):
    """Each set's K/V moved into a pool of PAGE-position pages in random order."""
    rng = np.random.default_rng(1)
    paged = []
    for q, k, v in sets:
        B = k.shape[0]
        pages = B * S // PAGE
        order = rng.permutation(pages)  # logical page (b, j) -> physical page order[b*n + j]
        pools = [jnp.zeros((HKV, pages, PAGE, D), jnp.bfloat16).at[:, order].set(
            jnp.swapaxes(x, 0, 1).reshape(HKV, pages, PAGE, D)) for x in (k, v)]
        table = jnp.asarray(order.reshape(B, S // PAGE), jnp.int32)
        paged.append([q, PagedKVCache(*pools, table)])
    return paged


def _gbps(kv_bytes: int, seconds: float) -> float:
    return kv_bytes / seconds / 1e9


def _jattn(sets, kv_bytes, **kwargs) -> dict:
    fn = lambda q, k, v: flex_decode(q, k, v, **kwargs)  # noqa: E731
    first = first_call_seconds(jax.jit(fn), *sets[0])
    return {"GBps": _gbps(kv_bytes, time_jax(fn, sets)), "first_call_s": first}


def _error(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:200]


def _torch_sides(sets, kv_bytes) -> dict:
    """torch SDPA and torch flex decoding (GB/s, or the error text if one fails)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import flex_attention as tflex

    torch._dynamo.reset()  # a fresh compile per shape (no recompile limit)
    t_sets = [[torch.from_dlpack(x) for x in s] for s in sets]
    sides = {}
    try:
        sides["torch_sdpa"] = _gbps(kv_bytes, time_torch(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), t_sets))
    except Exception as error:
        sides["torch_sdpa"] = _error(error)
    try:
        compiled = torch.compile(tflex.flex_attention)
        start = time.perf_counter()
        compiled(*t_sets[0], enable_gqa=True)
        torch.cuda.synchronize()
        sides["torch_flex_first_call_s"] = time.perf_counter() - start
        sides["torch_flex"] = _gbps(kv_bytes, time_torch(
            lambda q, k, v: compiled(q, k, v, enable_gqa=True), t_sets))
    except Exception as error:
        sides["torch_flex"] = _error(error)
    return sides


def _pallas_gqa(sets, kv_bytes) -> float | str:
    try:
        from jax.experimental.pallas.ops.gpu import decode_attention

        own_layout = [[q[:, :, 0], jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)]
                      for q, k, v in sets]
        return _gbps(kv_bytes, time_jax(decode_attention.gqa, own_layout))
    except Exception as error:  # deprecated module, or out of memory at 128k x 32
        return _error(error)


def bench_case(B: int, S: int) -> dict:
    sets, kv_bytes = _input_sets(B, S)
    problem = make_problem(B=B, Hq=HQ, Hkv=HKV, Lq=1, S=S, E=D, Ev=D, kv_batch=B,
                           page_size=None, num_pages=None, block_mask=None, score_mod=None,
                           mask_mod=None, score_set=None, mask_set=None, static_length=True,
                           queries_last=True, scale=1.0, interpret=False, config=None)
    row = {"case": f"B{B} S{S // 1024}k", "B": B, "S": S, "kv_GB": kv_bytes / 1e9,
           "splits": problem.config.num_splits, "jattn": _jattn(sets, kv_bytes)}
    if (B, S) in TARGETS:
        lengths = jnp.full((B,), S, jnp.int32)
        row["jattn_kv_len"] = _jattn(sets, kv_bytes, kv_len=lengths)
        paged = _paged(sets, S)
        row["jattn_paged"] = {"GBps": _gbps(kv_bytes, time_jax(
            lambda q, cache: flex_decode(q, cache, None, kv_len=lengths), paged))}
        del paged
    row.update(_torch_sides(sets, kv_bytes))
    row["pallas_gqa"] = _pallas_gqa(sets, kv_bytes)
    ours = row["jattn"]["GBps"]
    row["vs"] = {side: ours / row[side] for side in ("torch_sdpa", "torch_flex", "pallas_gqa")
                 if isinstance(row[side], float)}
    return row


def sweep(B: int, S: int) -> list[dict]:
    """Tiles, stages and compilers at the heuristic split count, then split counts around the
    best."""
    sets, kv_bytes = _input_sets(B, S)
    rows = []

    def run(config: DecodeConfig) -> float:
        try:
            seconds = time_jax(lambda q, k, v: flex_decode(q, k, v, config=config), sets)
            gbps = _gbps(kv_bytes, seconds)
        except Exception as error:  # a config the compiler rejects (shared memory)
            gbps = float("nan")
            print(f"    {config}: {type(error).__name__}", flush=True)
        rows.append({"case": f"B{B} S{S // 1024}k", **dataclasses.asdict(config), "GBps": gbps})
        print(f"  sweep B{B} S{S // 1024}k {config}: {gbps:7.1f} GB/s", flush=True)
        return gbps

    tiles = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 4, 5), (32, 4, 6), (128, 4, 2),
             (128, 4, 3), (128, 8, 3), (64, 8, 4)]
    configs = [DecodeConfig(block_k=bk, num_warps=w, num_stages=s, compiler=compiler)
               for compiler in ("xla", "triton") for bk, w, s in tiles]
    best = max(configs, key=run)
    heuristic = make_problem(B=B, Hq=HQ, Hkv=HKV, Lq=1, S=S, E=D, Ev=D, kv_batch=B,
                             page_size=None, num_pages=None, block_mask=None, score_mod=None,
                             mask_mod=None, score_set=None, mask_set=None, static_length=True,
                             queries_last=True, scale=1.0, interpret=False,
                             config=best).config.num_splits
    for factor in (0.5, 0.75, 1.5, 2.0):
        splits = max(1, round(heuristic * factor))
        if splits != heuristic:
            run(dataclasses.replace(best, num_splits=splits))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", help="run only the cases whose name contains this, e.g. B8")
    parser.add_argument("--sweep", action="store_true", help="also sweep configs at the targets")
    parser.add_argument("--json", help="write the rows to this file (after every row)")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind} ({num_sms()} SMs); jax {jax.__version__}")
    warm_up()
    rows = [{"copy_ceiling_GBps": copy_ceiling()}]
    ceiling = rows[0]["copy_ceiling_GBps"]
    print(f"copy ceiling (read + write): {ceiling:.0f} GB/s", flush=True)

    def save():
        record.write(args.json, rows)

    save()
    for B, S in CASES:
        name = f"B{B} S{S // 1024}k"
        if args.only and args.only not in name:
            continue
        r = bench_case(B, S)
        r["vs_copy_ceiling"] = r["jattn"]["GBps"] / ceiling
        rows.append(r)
        save()
        extra = "".join(f"  {side} {r[side]['GBps']:6.0f}" for side in ("jattn_kv_len",
                                                                        "jattn_paged") if side in r)
        number = lambda x: x if isinstance(x, float) else float("nan")  # noqa: E731
        print(f"{name:>12} (splits {r['splits']:3d}): jattn {r['jattn']['GBps']:6.0f} GB/s "
              f"({r['vs_copy_ceiling']:.2f} of copy){extra}  sdpa "
              f"{number(r['torch_sdpa']):6.0f}  torch flex {number(r['torch_flex']):6.0f}  "
              f"pallas gqa {number(r['pallas_gqa']):6.0f}  |  x flex "
              f"{r['vs'].get('torch_flex', float('nan')):.2f}  x sdpa "
              f"{r['vs'].get('torch_sdpa', float('nan')):.2f}  first call "
              f"{r['jattn']['first_call_s']:.1f}s (torch flex "
              f"{r.get('torch_flex_first_call_s', float('nan')):.1f}s)", flush=True)
        for side in ("torch_sdpa", "torch_flex", "pallas_gqa"):
            if not isinstance(r[side], float):
                print(f"    {side}: {r[side]}", flush=True)
    if args.sweep:
        for B, S in sorted(TARGETS):
            if not args.only or args.only in f"B{B} S{S // 1024}k":
                rows.extend(sweep(B, S))
            save()


if __name__ == "__main__":
    main()
