"""The host path: eager calls against jitted ones, per-step masks, and the torch training step.

    python -m benchmarks.bench_eager [--steps 10000] [--torch] [--json out.json]

1. Eager against jitted, each side in the same run (median ms per call, synchronised):
   flex_attention (B1 H4 L1024 E64, causal, ALiBi over a slope table new every call),
   flex_decode (B8 Hq32 Hkv8 S4096 E128, per-sequence lengths), matmul (1024^3, bias + a gelu
   epilogue scaled by a new array every call). Target: eager within 0.1 ms of jitted (GPU).
2. create_block_mask with new document ids every step (causal documents, L 2048 and 32768):
   ms per step after the first and XLA compilations after it (target <= 1 ms, none), JAX and,
   with --torch, jattn.torch's with a fresh closure over a new ids tensor, beside torch's
   compiled create_block_mask; then the resident memory over --steps such steps (flat).
3. With --torch, on CUDA: forward + backward of B2 H8 L1024 D64 causal through jattn.torch
   against torch's compiled flex_attention (target <= 1.0x).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from benchmarks import record
from benchmarks.process import CompileCounter, rss_mib
from benchmarks.timing import warm_up


def _median_ms(fn, arguments, calls: int = 50) -> float:
    """Median ms of fn(*args), args rotating through `arguments` (new arrays each call)."""
    rotation = itertools.cycle(arguments)
    for _ in range(3):
        jax.block_until_ready(fn(*next(rotation)))  # compilation and first-call caches
    times = []
    for _ in range(calls):
        args = next(rotation)
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _eager_cases():
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q, k, v = (normal(1, 4, 1024, 64) for _ in range(3))
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 1024, 1024)

    def attention(q, k, v, slopes):
        return jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi),
                                    mask)

    dq, dk, dv = normal(8, 32, 1, 128), normal(8, 8, 4096, 128), normal(8, 8, 4096, 128)
    lengths = jnp.asarray(rng.integers(1024, 4097, 8), jnp.int32)

    def decode(q, k, v, kv_len):
        return jattn.flex_decode(q, k, v, kv_len=kv_len)

    a, b, bias = normal(1024, 1024), normal(1024, 1024), normal(1024)

    def matmul(a, b, bias, gain):
        return jattn.matmul(a, b, bias=bias, epilogue=lambda x: jax.nn.gelu(x) * gain[0])

    fresh = lambda make: [make() for _ in range(8)]  # noqa: E731  (a new array per call)
    return [("flex_attention B1 H4 L1024 E64 causal+alibi", attention,
             fresh(lambda: (q, k, v, normal(4)))),
            ("flex_decode B8 Hq32 Hkv8 S4096 E128", decode,
             fresh(lambda: (dq, dk, dv, lengths))),
            ("matmul 1024^3 bias+gelu*gain", matmul, fresh(lambda: (a, b, bias, normal(1))))]


def _eager_rows() -> list[dict]:
    rows = []
    for name, fn, arguments in _eager_cases():
        counter = CompileCounter()
        eager = _median_ms(fn, arguments, calls=200)
        jitted = _median_ms(jax.jit(fn), arguments, calls=200)
        counter.count = 0
        eager = min(eager, _median_ms(fn, arguments, calls=200))  # (the two sides alternate)
        row = {"case": name, "eager_ms": round(eager, 3), "jit_ms": round(jitted, 3),
               "eager_minus_jit_ms": round(eager - jitted, 3),
               "compiles_when_warm": counter.count}
        rows.append(row)
        print(f"{name:48s} eager {eager:8.3f} ms  jit {jitted:8.3f} ms  "
              f"({eager - jitted:+.3f} ms; compiles when warm: {counter.count})")
    return rows


def _document_ids(rng, L: int) -> np.ndarray:
    return np.sort(rng.integers(0, max(2, L // 512), L)).astype(np.int32)


def _mask_step_rows(lengths, with_torch: bool) -> list[dict]:
    rng = np.random.default_rng(1)
    rows = []
    for L in lengths:
        ids = [jnp.asarray(_document_ids(rng, L)) for _ in range(8)]

        def jax_step(ids):
            mod = jattn.masks.and_masks(jattn.masks.causal_mask, jattn.masks.document_mask(ids))
            return jattn.create_block_mask(mod, None, None, L, L).kv_indices

        row = {"case": f"create_block_mask L{L}", "jax": _per_step(jax_step, ids)}
        if with_torch:
            row.update(_torch_mask_steps(L, rng))
        rows.append(row)
        print(f"{row['case']:28s} " + "  ".join(
            f"{side} {r['ms']:.3f} ms/step ({r['compiles']} compiles, first {r['first_s']:.2f} s)"
            for side, r in row.items() if isinstance(r, dict)))
    return rows


def _per_step(step, arguments, steps: int = 30) -> dict:
    start = time.perf_counter()
    jax.block_until_ready(step(arguments[0]))
    first = time.perf_counter() - start
    counter = CompileCounter()
    times = []
    for args in itertools.islice(itertools.cycle(arguments), steps):
        start = time.perf_counter()
        result = step(args)
        (result.cpu() if hasattr(result, "cpu") and not isinstance(result, jax.Array) else
         jax.block_until_ready(result))
        times.append(time.perf_counter() - start)
    return {"ms": round(1e3 * statistics.median(times), 3), "compiles": counter.count,
            "first_s": round(first, 3)}


def _torch_mask_steps(L: int, rng) -> dict:
    import torch
    from torch.nn.attention import flex_attention as tflex

    import jattn.torch as jt
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = [torch.as_tensor(_document_ids(rng, L), device=device) for _ in range(8)]

    def closure(ids):
        return lambda b, h, q, kv: (q >= kv) & (ids[q] == ids[kv])

    ours = _per_step(lambda t: jt.create_block_mask(closure(t), None, None, L, L,
                                                    device).kv_indices, ids)
    theirs = _per_step(lambda t: tflex.create_block_mask(closure(t), None, None, L, L, device,
                                                         _compile=True).kv_indices, ids)
    return {"jattn.torch": ours, "torch compiled": theirs}


def _memory_rows(steps: int) -> dict:
    """Resident memory over `steps` create_block_mask + flex_attention steps, new ids each."""
    rng = np.random.default_rng(2)
    L = 2048
    q = jnp.ones((1, 2, L, 64), jnp.bfloat16)
    counter, rss = CompileCounter(), {}
    for step in range(1, steps + 1):
        ids = jnp.asarray(_document_ids(rng, L))
        mod = jattn.masks.and_masks(jattn.masks.causal_mask, jattn.masks.document_mask(ids))
        mask = jattn.create_block_mask(mod, None, None, L, L)
        jattn.flex_attention(q, q, q, block_mask=mask).block_until_ready()
        if step == 1:
            counter.count = 0
        if step in (steps // 10, steps // 2, steps):
            rss[step] = round(rss_mib(), 1)
    print(f"{steps} steps of create_block_mask + flex_attention, new ids each: RSS {rss} MiB; "
          f"compilations after the first step: {counter.count}")
    return {"rss_mib": rss, "compiles_after_first": counter.count}


def _training_step_row() -> dict:
    import torch
    from torch.nn.attention import flex_attention as tflex

    import jattn.torch as jt
    B, H, L, D = 2, 8, 1024, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    causal = lambda b, h, qi, ki: qi >= ki  # noqa: E731
    ours_mask = jt.create_block_mask(causal, None, None, L, L, "cuda")
    torch_mask = tflex.create_block_mask(causal, None, None, L, L, "cuda")
    compiled = torch.compile(tflex.flex_attention)
    grad = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def step(attend, mask):
        def run():
            out = attend(q, k, v, block_mask=mask)
            out.backward(grad)
        return run

    def median_ms(run, calls=100):
        """(median wall ms per step, synchronised; median host ms until run() returns)."""
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        walls, hosts = [], []
        for _ in range(calls):
            start = time.perf_counter()
            run()
            hosts.append(time.perf_counter() - start)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
        return 1e3 * statistics.median(walls), 1e3 * statistics.median(hosts)

    # Rounds alternate the two sides, and each side keeps its best round: host-bound steps
    # vary with what the host does meanwhile, so one sample of each can differ 2x.
    ours_step, theirs_step = step(jt.flex_attention, ours_mask), step(compiled, torch_mask)
    rounds = [(median_ms(ours_step), median_ms(theirs_step)) for _ in range(3)]
    ours, ours_host = min(r[0] for r in rounds)
    theirs, theirs_host = min(r[1] for r in rounds)
    floor = _jax_training_step_ms(B, H, L, D)
    row = {"case": "torch fwd+bwd B2 H8 L1024 D64 causal", "jattn_ms": round(ours, 3),
           "jattn_host_ms": round(ours_host, 3), "torch_compiled_ms": round(theirs, 3),
           "torch_compiled_host_ms": round(theirs_host, 3),
           "jax_jit_ms": round(floor, 3), "ratio": round(ours / theirs, 3),
           "rounds_ms": [[round(r[0][0], 3), round(r[1][0], 3)] for r in rounds]}
    print(f"{row['case']}: jattn.torch {ours:.3f} ms (host {ours_host:.3f}), torch compiled "
          f"{theirs:.3f} ms (host {theirs_host:.3f}): {ours / theirs:.2f}x; the same kernels "
          f"under jax.jit(grad) {floor:.3f} ms")
    return row


def _jax_training_step_ms(B: int, H: int, L: int, D: int) -> float:
    """Forward + backward of the training step's problem in one jitted JAX program: the
    kernels' time without the bridge."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, grad = (jax.random.normal(key, (B, H, L, D), jnp.bfloat16) for key in keys)
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)

    @jax.jit
    def step(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: jattn.flex_attention(q, k, v, block_mask=mask),
                           q, k, v)
        return vjp(grad)
    return _median_ms(step, [(q, k, v)], calls=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 32768])
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    warm_up()
    results = {"eager": _eager_rows()}
    record.write(args.json, results)
    results["masks"] = _mask_step_rows(args.lengths, args.torch)
    record.write(args.json, results)
    results["memory"] = _memory_rows(args.steps)
    record.write(args.json, results)
    if args.torch and jax.default_backend() == "gpu":
        results["training_step"] = _training_step_row()
    record.write(args.json, results)


if __name__ == "__main__":
    main()
