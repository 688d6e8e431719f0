"""What bitwise-reproducible gradients of captured arrays cost, and what they fix.

    python -m benchmarks.bench_capture_gradients [--json out.json]

Forward + backward of flex_attention with a learnable relative-position bias (table [H, 2·512+1],
`jattn.mods.relative_position_bias`), causal, B4 H16 L4096 D128 bf16, gradients for q, k, v and
the table, on the default implementation; the table's gradient from the integer-summed
scatter-adds (`jattn._src.deterministic`, today's path) against jax.vjp's float scatter-add (the
path before it), same run. Target: ≤ 10% slower. For each, the largest difference of the table's
gradient between two runs (0 = bitwise reproducible).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jattn  # noqa: E402
from jattn._src import deterministic  # noqa: E402
from jattn._src.attention import api as attention_api  # noqa: E402
from jattn._src.attention import xla as attention_xla  # noqa: E402
from jattn._src.tuning.autotune import median_seconds  # noqa: E402
from benchmarks import record  # noqa: E402
from benchmarks.timing import warm_up  # noqa: E402

B, H, L, D, RADIUS = 4, 16, 4096, 128, 512
COST_TARGET = 1.10


def _grad_fn():
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)

    def loss(q, k, v, table, cotangent):
        out = jattn.flex_attention(q, k, v, jattn.mods.relative_position_bias(table), mask)
        return jnp.vdot(out.astype(jnp.float32), cotangent.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    q, k, v, cotangent = (jnp.asarray(rng.standard_normal((B, H, L, D)), jnp.bfloat16)
                          for _ in range(4))
    table = jnp.asarray(0.1 * rng.standard_normal((H, 2 * RADIUS + 1)), jnp.float32)
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
          f"B{B} H{H} L{L} D{D} causal, relative-position table {tuple(table.shape)}")
    warm_up()
    rows = {}
    for name, pullback in (("integer scatter-add", deterministic.vjp),
                           ("float scatter-add (jax.vjp)", jax.vjp)):
        attention_xla.capture_vjp = pullback
        jax.clear_caches()  # the pullback is read when the backward is traced: trace again
        attention_api._PROGRAMS.clear()
        grad = _grad_fn()
        seconds = median_seconds(lambda: grad(q, k, v, table, cotangent), calls=3, samples=5)
        first, second = (np.asarray(grad(q, k, v, table, cotangent)[3]) for _ in range(2))
        rows[name] = {"ms": round(1e3 * seconds, 3),
                      "table_grad_run_to_run": float(np.max(np.abs(first - second)))}
    attention_xla.capture_vjp = deterministic.vjp
    ours, before = rows["integer scatter-add"], rows["float scatter-add (jax.vjp)"]
    ratio = ours["ms"] / before["ms"]
    for name, row in rows.items():
        print(f"{name:30s} fwd+bwd {row['ms']:9.3f} ms   table gradient, run to run: "
              f"max |diff| {row['table_grad_run_to_run']:.3g}")
    print(f"cost: {ratio:.3f}x ({'ok' if ratio <= COST_TARGET else 'above'} {COST_TARGET})")
    record.write(args.json, rows, ratio=ratio)


if __name__ == "__main__":
    main()
