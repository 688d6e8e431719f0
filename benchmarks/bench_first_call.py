"""The first call of a fresh process, with JAX's persistent compilation cache cold and warm.

    python -m benchmarks.bench_first_call [--json out.json]

For the Pallas-Triton path and the default one (the Mosaic GPU forward on Hopper): two fresh
processes in a row share an empty `jax_compilation_cache_dir`; each times its first
`jax.jit(jax.grad(...))` call of flex_attention (B4 H16 L4096 D128 bf16, causal), block mask
included. The second process reads what the first wrote.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from benchmarks import record

_CHILD = """
import json, sys, time
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import jattn
implementation = None if sys.argv[2] == "default" else sys.argv[2]
q, k, v = (jnp.ones((4, 16, 4096, 128), jnp.bfloat16) for _ in range(3))
start = time.perf_counter()
mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 4096, 4096)
loss = lambda q, k, v: jattn.flex_attention(q, k, v, block_mask=mask,
                                            implementation=implementation).astype(
    jnp.float32).sum()
jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def _first_call(cache_dir: str, implementation: str) -> float:
    out = subprocess.run([sys.executable, "-c", _CHILD, cache_dir, implementation],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for implementation in ("pallas_triton", "default"):
        with tempfile.TemporaryDirectory() as cache_dir:
            cold = _first_call(cache_dir, implementation)
            warm = _first_call(cache_dir, implementation)
        rows.append({"implementation": implementation, "cold_s": round(cold, 2),
                     "warm_s": round(warm, 2)})
        print(f"{implementation:14s} first call: cold cache {cold:6.2f} s, warm cache "
              f"{warm:6.2f} s")
    record.write(args.json, rows)


if __name__ == "__main__":
    main()
