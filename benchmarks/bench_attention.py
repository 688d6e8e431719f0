"""Flex attention on the GPU against torch FlexAttention, cuDNN, tokamax (where it imports) and
JAX's Pallas mha, same run.

    python -m benchmarks.bench_attention [--only CASE] [--masks full,causal] [--json out.json]
    (rows go to --json as they are measured)
    python -m benchmarks.bench_attention --sweep [--only CASE] [--masks ...]   # forward tiles

FLOPs: forward 4·B·H·L²·D times the mask's density (fraction of attended pairs); backward
2.5x forward; JAX backward time = time(forward + vjp) - time(forward), torch likewise with
autograd (eager launches; its forward ratio uses a CUDA-graph replay, the stricter baseline).
bf16. Each baseline does the same work (same mask, same score_mod); cuDNN, the Pallas mha
and tokamax's Mosaic GPU attention (its version recorded) run only where the mask is
expressible (full, causal). Also: first-call time, and create_block_mask at 32k / 128k causal
against torch's compiled builder.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from benchmarks import record, shapes
from benchmarks.timing import first_call_seconds, time_jax, time_torch, warm_up

COPIES = 3  # input sets rotated per timing pass (each is >= 200 MB here, so L2 is no help)


def _document_ids(kind: str, L: int) -> np.ndarray:
    """document8: 8 equal documents, on block boundaries (every block full or empty).
    packed_causal: 8 documents of random lengths (boundaries inside blocks), causal within."""
    if kind == "document8":
        return np.arange(L, dtype=np.int32) // (L // 8)
    starts = np.sort(np.random.default_rng(1).choice(np.arange(1, L), 7, replace=False))
    return np.cumsum(np.isin(np.arange(L), starts)).astype(np.int32)


def _mask_mod(kind: str, L: int):
    if kind == "causal" or kind in ("alibi", "softcap"):
        return jattn.masks.causal_mask if kind == "causal" else None
    if kind == "sliding1024":
        return jattn.masks.sliding_window(1024)
    if kind == "document8":
        return jattn.masks.document_mask(jnp.asarray(_document_ids(kind, L)))
    if kind == "packed_causal":
        return jattn.masks.and_masks(jattn.masks.causal_mask, jattn.masks.document_mask(
            jnp.asarray(_document_ids(kind, L))))
    return None


def _density(kind: str, L: int) -> float:
    q = np.arange(L)[:, None]
    kv = np.arange(L)[None, :]
    if kind == "causal":
        return float((q >= kv).mean())
    if kind == "sliding1024":
        return float(((q >= kv) & (q - kv < 1024)).mean())
    if kind in ("document8", "packed_causal"):
        lengths = np.bincount(_document_ids(kind, L))
        pairs = lengths * (lengths + 1) / 2 if kind == "packed_causal" else lengths ** 2
        return float(pairs.sum() / L ** 2)
    return 1.0


def _score_mod(kind: str, H: int):
    if kind == "alibi":
        return jattn.mods.alibi(jattn.mods.alibi_slopes(H))
    if kind == "softcap":
        return jattn.mods.softcap(30.0)
    return None


def _torch_mods(kind: str, H: int, L: int):
    import torch

    if kind == "alibi":
        slopes = torch.from_numpy(np.asarray(jattn.mods.alibi_slopes(H))).cuda()
        return (lambda s, b, h, q, kv: s + slopes[h] * (kv - q)), None
    if kind == "softcap":
        return (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0)), None
    if kind == "causal":
        return None, lambda b, h, q, kv: q >= kv
    if kind == "sliding1024":
        return None, lambda b, h, q, kv: (q >= kv) & (q - kv < 1024)
    if kind in ("document8", "packed_causal"):
        doc = torch.from_numpy(_document_ids(kind, L)).cuda()
        if kind == "document8":
            return None, lambda b, h, q, kv: doc[q] == doc[kv]
        return None, lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)
    return None, None


def _jax_fwd_bwd(fn, sets, flops):
    shape = jax.eval_shape(fn, *sets[0])
    cotangent = jnp.ones(shape.shape, shape.dtype)  # an input, not a fill inside the timing

    def fwd_bwd(*args):
        out, vjp = jax.vjp(fn, *args)
        return vjp(cotangent)

    # First: nothing of this shape compiled yet in this process (kernels compiled by the
    # `triton` package may still come from its on-disk cache of an earlier run).
    compile_s = first_call_seconds(jax.jit(fwd_bwd), *sets[0])
    t_fwd = time_jax(fn, sets)
    t_all = time_jax(fwd_bwd, sets)
    return {"fwd": flops / t_fwd / 1e12, "bwd": 2.5 * flops / max(t_all - t_fwd, 1e-9) / 1e12,
            "first_call_s": compile_s}


def bench_case(name, B, H, L, D, kind) -> dict:
    import torch
    from torch.nn.attention import flex_attention as tflex

    torch._dynamo.reset()  # a fresh compile per case (first-call time; no recompile limit)
    rng = np.random.default_rng(0)
    sets = [[jnp.asarray(rng.standard_normal((B, H, L, D)), jnp.bfloat16) for _ in range(3)]
            for _ in range(COPIES)]
    flops = 4 * B * H * L * L * D * _density(kind, L)
    mask_mod, score_mod = _mask_mod(kind, L), _score_mod(kind, H)
    start = time.perf_counter()
    block_mask = None if mask_mod is None else jattn.create_block_mask(mask_mod, None, None, L, L)
    if kind in ("alibi", "softcap"):
        block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
        flops = 4 * B * H * L * L * D * _density("causal", L)
    mask_s = time.perf_counter() - start
    row = {"case": name, "mask": kind, "create_block_mask_s": mask_s,
           "jattn": _jax_fwd_bwd(lambda q, k, v: jattn.flex_attention(q, k, v, score_mod,
                                                                      block_mask), sets, flops)}
    try:  # the Mosaic GPU forward and backward, where they support the call
        row["jattn_mosaic"] = _jax_fwd_bwd(lambda q, k, v: jattn.flex_attention(
            q, k, v, score_mod, block_mask, implementation="pallas_mosaic_gpu"), sets, flops)
    except ValueError as error:
        row["jattn_mosaic"] = {"error": str(error)[:200]}

    # torch FlexAttention, compiled, same mods (alibi/softcap are causal too)
    t_score, t_mask = _torch_mods(kind, H, L)
    if kind in ("alibi", "softcap"):
        t_mask = lambda b, h, q, kv: q >= kv  # noqa: E731
    t_block = None if t_mask is None else tflex.create_block_mask(t_mask, None, None, L, L,
                                                                  device="cuda")
    compiled = torch.compile(tflex.flex_attention)
    t_sets = [[torch.from_dlpack(x).requires_grad_() for x in s] for s in sets]
    grad = torch.ones_like(t_sets[0][0])
    start = time.perf_counter()
    compiled(*t_sets[0], score_mod=t_score, block_mask=t_block).backward(grad)
    torch.cuda.synchronize()
    t_first = time.perf_counter() - start
    fwd = lambda q, k, v: compiled(q, k, v, score_mod=t_score, block_mask=t_block)  # noqa: E731
    # Forward: CUDA-graph replay (no launch overhead, like the one jitted JAX pass). Backward:
    # autograd does not capture, so eager forward+backward minus eager forward.
    t_fwd = time_torch(fwd, [[x.detach() for x in s] for s in t_sets])
    t_fwd_eager = time_torch(fwd, t_sets, graph=False)
    t_all = time_torch(lambda q, k, v: fwd(q, k, v).backward(grad), t_sets, graph=False)
    row["torch_flex"] = {"fwd": flops / t_fwd / 1e12,
                         "bwd": 2.5 * flops / max(t_all - t_fwd_eager, 1e-9) / 1e12,
                         "fwd_eager": flops / t_fwd_eager / 1e12, "first_call_s": t_first}

    if kind in ("full", "causal"):
        causal = kind == "causal"
        blhd = [[jnp.swapaxes(x, 1, 2) for x in s] for s in sets]
        row["cudnn"] = _jax_fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"), blhd, flops)
        row["attention_mgpu_fp16"] = _attention_mgpu_forward(blhd, causal, flops)
        row["tokamax"] = _tokamax(blhd, causal, flops)
        try:
            from jax.experimental.pallas.ops.gpu import attention as pallas_mha

            row["pallas_mha"] = _jax_fwd_bwd(lambda q, k, v: pallas_mha.mha(
                q, k, v, segment_ids=None, causal=causal), blhd, flops)
        except Exception as error:  # deprecated module; report rather than fail the run
            row["pallas_mha"] = {"error": f"{type(error).__name__}: {error}"[:200]}
    for side in ("torch_flex", "cudnn"):
        if side in row:
            row[f"vs_{side}"] = {d: row["jattn"][d] / row[side][d] for d in ("fwd", "bwd")}
            if "fwd" in row["jattn_mosaic"]:
                row[f"mosaic_vs_{side}"] = {d: row["jattn_mosaic"][d] / row[side][d]
                                            for d in ("fwd", "bwd")}
    return row


def _tokamax(blhd_sets, causal: bool, flops: float) -> dict:
    """tokamax's Mosaic GPU attention (no mods), forward and backward, where it imports."""
    try:
        import tokamax
    except ImportError as error:
        return {"error": f"tokamax is not importable here: {error}"[:200]}
    try:
        row = _jax_fwd_bwd(lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=causal, implementation="mosaic"), blhd_sets, flops)
    except Exception as error:  # an unsupported shape or version; report rather than fail
        return {"error": f"{type(error).__name__}: {error}"[:200]}
    return {**row, "version": getattr(tokamax, "__version__", "unknown")}


def _attention_mgpu_forward(blhd_sets, causal: bool, flops: float) -> dict:
    """JAX's own Mosaic GPU flash attention forward (float16 only in jax 0.11), [B, L, H, D]."""
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                             causal=causal)
        sets = [[x.astype(jnp.float16) for x in s] for s in blhd_sets]
        seconds = time_jax(lambda q, k, v: attention_mgpu.attention(q, k, v, config), sets)
        return {"fwd": flops / seconds / 1e12}
    except Exception as error:  # an API that moves between JAX versions: report, go on
        return {"error": f"{type(error).__name__}: {error}"[:200]}


# Forward configs of the sweep by head dim: (block_q, block_k, num_warps, num_stages, compiler).
SWEEP = {
    128: [(128, 64, 4, 2, "xla"),
          *[(128, bk, w, st, "triton") for bk, w, st in (
              (64, 4, 3), (64, 4, 4), (64, 4, 5), (64, 8, 3), (64, 8, 5), (64, 8, 6))]],
    64: [(64, 128, 4, 3, "xla"),
         *[(bq, bk, w, st, "triton") for bq, bk, w, st in (
             (128, 128, 4, 3), (128, 128, 4, 4), (128, 128, 4, 5), (64, 128, 4, 3),
             (64, 128, 4, 4), (128, 64, 4, 4), (128, 64, 4, 5))]],
}


def sweep_forward(name, B, H, L, D, kind) -> list[dict]:
    """Forward TFLOP/s of each SWEEP[D] config, torch's compiled forward (CUDA-graph replay) timed
    before and after them in the same run."""
    import torch
    from torch.nn.attention import flex_attention as tflex

    torch._dynamo.reset()
    rng = np.random.default_rng(0)
    sets = [[jnp.asarray(rng.standard_normal((B, H, L, D)), jnp.bfloat16) for _ in range(3)]
            for _ in range(COPIES)]
    flops = 4 * B * H * L * L * D * _density(kind, L)
    mask_mod = _mask_mod(kind, L)
    block_mask = None if mask_mod is None else jattn.create_block_mask(mask_mod, None, None, L, L)
    _, t_mask = _torch_mods(kind, H, L)
    t_block = None if t_mask is None else tflex.create_block_mask(t_mask, None, None, L, L,
                                                                  device="cuda")
    compiled = torch.compile(tflex.flex_attention)
    t_sets = [[torch.from_dlpack(x) for x in s] for s in sets]

    def torch_fwd():
        return flops / time_torch(lambda q, k, v: compiled(q, k, v, block_mask=t_block),
                                  t_sets) / 1e12

    rows = [{"case": name, "mask": kind, "config": "torch (before)", "fwd": torch_fwd()}]
    for bq, bk, w, st, compiler in SWEEP[D]:
        config = jattn.AttentionConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st,
                                       compiler=compiler)
        try:
            tflops = flops / time_jax(lambda q, k, v, c=config: jattn.flex_attention(
                q, k, v, None, block_mask, config=c), sets) / 1e12
        except Exception as error:  # e.g. shared memory the config cannot get
            tflops = float("nan")
            print(f"    {type(error).__name__}: {str(error)[:120]}", flush=True)
        rows.append({"case": name, "mask": kind, "config": f"{bq}x{bk} w{w} s{st} {compiler}",
                     "fwd": tflops})
    rows.append({"case": name, "mask": kind, "config": "torch (after)", "fwd": torch_fwd()})
    for r in rows:
        print(f"  sweep {name} {kind:>7} {r['config']:>24}: {r['fwd']:6.1f}", flush=True)
    return rows


def bench_block_mask(L: int) -> dict:
    """create_block_mask(causal) at L x L: ours vs torch's compiled builder."""
    import torch
    from torch.nn.attention import flex_attention as tflex

    from jattn._src.masks.create import builder
    from jattn._src.tuning.autotune import median_seconds

    start = time.perf_counter()
    jax.block_until_ready(jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L))
    first = time.perf_counter() - start
    ours = median_seconds(lambda: jattn.create_block_mask(jattn.masks.causal_mask, None, None,
                                                          L, L).kv_indices, calls=3)
    program, arrays = builder(jattn.masks.causal_mask, 1, 1, L, L, (128, 128))
    compiled = program.lower(arrays).compile()
    working = compiled.memory_analysis().temp_size_in_bytes
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    tflex.create_block_mask(causal, None, None, L, L, device="cuda", _compile=True)
    torch.cuda.synchronize()
    t_first = time.perf_counter() - start
    t_med = median_seconds(lambda: tflex.create_block_mask(causal, None, None, L, L,
                                                           device="cuda", _compile=True),
                           calls=3, wait=lambda _: torch.cuda.synchronize())
    return {"L": L, "jattn_s": ours, "jattn_first_s": first, "jattn_working_MiB": working / 2**20,
            "torch_s": t_med, "torch_first_s": t_first,
            "torch_peak_MiB": (torch.cuda.max_memory_allocated() - base) / 2**20}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", help="run only the attention case whose name contains this")
    parser.add_argument("--masks", default=",".join(shapes.ATTENTION_MASKS))
    parser.add_argument("--block-mask", action="store_true", help="also time create_block_mask")
    parser.add_argument("--sweep", action="store_true",
                        help="sweep forward configs instead of the comparison")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    warm_up()
    rows = []
    for name, B, H, L, D in shapes.ATTENTION:
        if args.only and args.only not in name:
            continue
        for kind in args.masks.split(","):
            if args.sweep:
                rows.extend(sweep_forward(name, B, H, L, D, kind))
                continue
            r = bench_case(name, B, H, L, D, kind)
            rows.append(r)
            line = f"{name:>20} {kind:>11}: jattn {r['jattn']['fwd']:6.1f}/{r['jattn']['bwd']:6.1f}"
            for side in ("jattn_mosaic", "torch_flex", "cudnn", "tokamax", "pallas_mha"):
                if side in r and "fwd" in r[side]:
                    line += f"  {side} {r[side]['fwd']:6.1f}/{r[side]['bwd']:6.1f}"
            if "fwd" in r.get("attention_mgpu_fp16", {}):
                line += f"  attention_mgpu(fp16) {r['attention_mgpu_fp16']['fwd']:6.1f}"
            line += (f"  vs torch {r['vs_torch_flex']['fwd']:.2f}/{r['vs_torch_flex']['bwd']:.2f}"
                     f"  first call {r['jattn']['first_call_s']:.1f}s"
                     f" (torch {r['torch_flex']['first_call_s']:.1f}s"
                     + (f", mosaic {r['jattn_mosaic']['first_call_s']:.1f}s"
                        if "first_call_s" in r["jattn_mosaic"] else "") + ")")
            print(line, flush=True)
            record.write(args.json, rows)
    if args.block_mask:
        for L in (32768, 131072):
            r = bench_block_mask(L)
            rows.append(r)
            print(f"create_block_mask causal {L}: jattn {r['jattn_s'] * 1e3:.2f} ms (first "
                  f"{r['jattn_first_s']:.2f} s, working {r['jattn_working_MiB']:.0f} MiB)  "
                  f"torch {r['torch_s'] * 1e3:.2f} ms (first {r['torch_first_s']:.2f} s, peak "
                  f"{r['torch_peak_MiB']:.0f} MiB)", flush=True)
    record.write(args.json, rows)


if __name__ == "__main__":
    main()
