"""What the optional features cost: the same flex_attention call with and without them, same run.

    python -m benchmarks.bench_features [--json out.json]

Sinks (`sinks=`, per-head logits in the softmax denominator) forward + backward (their
gradient included), dropout (`dropout_rate=0.1`, a key per input set) forward + backward, and
the rows' largest scores (`return_max_scores=True`) forward, each against the plain call on
the same inputs: ratio = time with / time without. Forward mode: jax.jvp in q, k and v (the
tangent kernel), against the same jvp with the XLA JVP as the tangents (the path a moving
captured array takes) and against forward + backward. Dropout runs on pallas_triton by
default, so it is also timed against the plain call on pallas_triton, and on the Mosaic
kernels against theirs. bf16, causal, jitted, inputs rotated out of L2 (`benchmarks.timing`).
"""

from __future__ import annotations

import argparse
import contextlib
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from benchmarks import record
from benchmarks.timing import time_jax, warm_up
from jattn._src.attention import pallas_triton, xla

CASES = [(4, 16, 4096, 128), (4, 32, 4096, 64), (1, 16, 16384, 128)]
COPIES = 3


@contextlib.contextmanager
def _xla_tangents():
    """The kernels' tangents taken by the XLA JVP, as where a captured array moves. The
    caches are emptied on entry and exit: traces made on one side must not serve the other."""
    kernel = pallas_triton.tangents
    pallas_triton.tangents = xla.tangents
    jattn.clear_caches()
    jax.clear_caches()
    try:
        yield
    finally:
        pallas_triton.tangents = kernel
        jattn.clear_caches()
        jax.clear_caches()


def _fwd_bwd(fn):
    def step(*args):
        out, vjp = jax.vjp(fn, *args)
        return vjp(jnp.ones(out.shape, out.dtype))
    return step


def bench_case(B: int, H: int, L: int, D: int) -> dict:
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
    rng = np.random.default_rng(0)
    sets = [[jnp.asarray(rng.standard_normal((B, H, L, D)), jnp.bfloat16) for _ in range(3)]
            + [jnp.asarray(rng.standard_normal(H), jnp.float32), jax.random.key(i)]
            for i in range(COPIES)]

    def plain(q, k, v, sinks, key, implementation=None):
        return jattn.flex_attention(q, k, v, block_mask=mask, implementation=implementation)

    def with_sinks(q, k, v, sinks, key):
        return jattn.flex_attention(q, k, v, block_mask=mask, sinks=sinks)

    def with_dropout(q, k, v, sinks, key, implementation=None):
        return jattn.flex_attention(q, k, v, block_mask=mask, dropout_rate=0.1,
                                    dropout_key=key, implementation=implementation)

    def with_max(q, k, v, sinks, key):
        return jattn.flex_attention(q, k, v, block_mask=mask, return_max_scores=True)

    def keyed_fwd_bwd(fn):  # forward + backward in q, k, v and the sinks
        return lambda q, k, v, sinks, key: _fwd_bwd(
            lambda q, k, v, sinks: fn(q, k, v, sinks, key))(q, k, v, sinks)

    def jvp(q, k, v, sinks, key):
        return jax.jvp(lambda q, k, v: plain(q, k, v, sinks, key), (q, k, v), (v, q, k))

    with _xla_tangents():
        xla_jvp = time_jax(jvp, sets)
    times = {"plain_fwd_bwd": time_jax(keyed_fwd_bwd(plain), sets),
             "sinks_fwd_bwd": time_jax(keyed_fwd_bwd(with_sinks), sets),
             "dropout_fwd_bwd": time_jax(keyed_fwd_bwd(with_dropout), sets),
             "triton_fwd_bwd": time_jax(keyed_fwd_bwd(
                 lambda *args: plain(*args, implementation="pallas_triton")), sets),
             "mosaic_fwd_bwd": time_jax(keyed_fwd_bwd(
                 lambda *args: plain(*args, implementation="pallas_mosaic_gpu")), sets),
             "mosaic_dropout_fwd_bwd": time_jax(keyed_fwd_bwd(
                 lambda *args: with_dropout(*args, implementation="pallas_mosaic_gpu")), sets),
             "plain_fwd": time_jax(plain, sets),
             "max_scores_fwd": time_jax(with_max, sets),
             "jvp": time_jax(jvp, sets), "jvp_xla_tangents": xla_jvp}
    row = {"case": f"B{B} H{H} L{L} D{D} causal",
           **{name: round(1e3 * t, 4) for name, t in times.items()},
           "sinks_ratio": round(times["sinks_fwd_bwd"] / times["plain_fwd_bwd"], 4),
           "dropout_ratio": round(times["dropout_fwd_bwd"] / times["plain_fwd_bwd"], 4),
           "dropout_vs_triton_ratio": round(times["dropout_fwd_bwd"] / times["triton_fwd_bwd"],
                                            4),
           "mosaic_dropout_ratio": round(times["mosaic_dropout_fwd_bwd"]
                                         / times["mosaic_fwd_bwd"], 4),
           "max_scores_ratio": round(times["max_scores_fwd"] / times["plain_fwd"], 4),
           "jvp_vs_fwd_bwd": round(times["jvp"] / times["plain_fwd_bwd"], 4),
           "xla_tangents_vs_kernel": round(times["jvp_xla_tangents"] / times["jvp"], 4)}
    print(f"{row['case']}: sinks fwd+bwd {row['sinks_fwd_bwd']:.3f} vs "
          f"{row['plain_fwd_bwd']:.3f} ms ({row['sinks_ratio']:.3f}x); dropout fwd+bwd "
          f"{row['dropout_fwd_bwd']:.3f} ms ({row['dropout_ratio']:.3f}x, "
          f"{row['dropout_vs_triton_ratio']:.3f}x pallas_triton's plain; Mosaic "
          f"{row['mosaic_dropout_fwd_bwd']:.3f} ms, {row['mosaic_dropout_ratio']:.3f}x its "
          f"plain); max scores fwd "
          f"{row['max_scores_fwd']:.3f} vs {row['plain_fwd']:.3f} ms "
          f"({row['max_scores_ratio']:.3f}x); jvp {row['jvp']:.3f} ms "
          f"({row['jvp_vs_fwd_bwd']:.3f}x fwd+bwd; XLA tangents {row['jvp_xla_tangents']:.3f} ms, "
          f"{row['xla_tangents_vs_kernel']:.2f}x)", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    warm_up()
    rows = []
    for case in CASES:
        rows.append(bench_case(*case))
        record.write(args.json, rows)


if __name__ == "__main__":
    main()
