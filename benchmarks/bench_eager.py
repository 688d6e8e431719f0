"""Eager calls against jitted ones: what a notebook user pays for not writing `jax.jit`.

    python -m benchmarks.bench_eager [--calls 10000] [--json out.json]

For flex_attention (B1 H4 L1024 E64, causal, ALiBi over a captured slope table), flex_decode
(B8 Hq32 Hkv8 S4096 E128, per-sequence lengths) and matmul (1024³, bias + gelu epilogue) on
the default device: the median time of an eager call and of the same call under `jax.jit`,
their ratio (target ≤ 1.5 on the CPU), the compilations after the first call (none), and the
process's resident memory over `--calls` eager flex_attention calls that each close over a
new array (flat).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from benchmarks import record
from benchmarks.process import CompileCounter, rss_mib
from benchmarks.timing import warm_up

RATIO_TARGET = 1.5


def _median_ms(fn, *args, calls: int = 30) -> float:
    jax.block_until_ready(fn(*args))  # warm-up: compilation and first-call caches
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _cases():
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q, k, v = (normal(1, 4, 1024, 64) for _ in range(3))
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 1024, 1024)
    slopes = jattn.mods.alibi_slopes(4)

    def attention(q, k, v, slopes):
        return jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi),
                                    mask)

    dq, dk, dv = normal(8, 32, 1, 128), normal(8, 8, 4096, 128), normal(8, 8, 4096, 128)
    lengths = jnp.asarray(rng.integers(1024, 4097, 8), jnp.int32)

    def decode(q, k, v, kv_len):
        return jattn.flex_decode(q, k, v, kv_len=kv_len)

    a, b, bias = normal(1024, 1024), normal(1024, 1024), normal(1024)

    def matmul(a, b, bias):
        return jattn.matmul(a, b, bias=bias, epilogue=lambda x: jax.nn.gelu(x))

    return [("flex_attention B1 H4 L1024 E64 causal+alibi", attention, (q, k, v, slopes)),
            ("flex_decode B8 Hq32 Hkv8 S4096 E128", decode, (dq, dk, dv, lengths)),
            ("matmul 1024^3 bias+gelu", matmul, (a, b, bias))]


def _memory_loop(calls: int) -> dict:
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2, 128, 16)), jnp.float32) for _ in range(3))
    counter = CompileCounter()
    rss = {}
    for step in range(1, calls + 1):
        offset = jnp.asarray(np.float32(step % 7))  # a new captured array every call
        jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + offset).block_until_ready()
        if step == 1:
            counter.count = 0
        if step in (calls // 10, calls // 2, calls):
            rss[step] = round(rss_mib(), 1)
    return {"rss_mib": rss, "compiles_after_first": counter.count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    warm_up()
    rows = []
    for name, fn, inputs in _cases():
        counter = CompileCounter()
        eager = _median_ms(fn, *inputs)
        compiles = counter.count
        counter.count = 0
        eager = min(eager, _median_ms(fn, *inputs))
        jitted = _median_ms(jax.jit(fn), *inputs)
        row = {"case": name, "eager_ms": round(eager, 3), "jit_ms": round(jitted, 3),
               "ratio": round(eager / jitted, 3), "first_call_compiles": compiles}
        rows.append(row)
        verdict = "ok" if row["ratio"] <= RATIO_TARGET else f"above {RATIO_TARGET}"
        print(f"{name:48s} eager {eager:8.3f} ms  jit {jitted:8.3f} ms  "
              f"ratio {row['ratio']:.2f} ({verdict})")
    memory = _memory_loop(args.calls)
    print(f"{args.calls} eager flex_attention calls, each over a new captured array: RSS "
          f"{memory['rss_mib']} MiB; compilations after the first call: "
          f"{memory['compiles_after_first']}")
    record.write(args.json, rows, memory=memory)


if __name__ == "__main__":
    main()
