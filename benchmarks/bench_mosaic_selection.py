"""Which flex_attention forward to pick on Hopper: Mosaic GPU against Pallas-Triton, same run.

    python -m benchmarks.bench_mosaic_selection [--json out.json]

Forward TFLOP/s of implementation="pallas_mosaic_gpu" and "pallas_triton" (the backward is the
same Triton kernel behind either) over head dims 64 and 128, lengths 1k, 4k and 16k (32k
tokens a batch: B = 32768 / L; H = 16 at D128, 32 at D64) and full, causal, sliding-window and
softcap (causal) attention, bf16. The ratio is what the default selection on sm90 follows.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

import jattn
from benchmarks import record
from benchmarks.timing import time_jax, warm_up

LENGTHS = (1024, 4096, 16384)
HEADS = {64: 32, 128: 16}
MASKS = ("full", "causal", "sliding1024", "softcap")


def _mods(kind: str, L: int):
    """(score_mod, BlockMask or None, density)."""
    q, kv = np.arange(L)[:, None], np.arange(L)[None, :]
    if kind == "full":
        return None, None, 1.0
    if kind == "sliding1024":
        mask_mod, density = jattn.masks.sliding_window(1024), ((q >= kv) & (q - kv < 1024)).mean()
    else:
        mask_mod, density = jattn.masks.causal_mask, (q >= kv).mean()
    score_mod = jattn.mods.softcap(30.0) if kind == "softcap" else None
    return score_mod, jattn.create_block_mask(mask_mod, None, None, L, L), float(density)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    warm_up()
    rows = []
    for D, H in HEADS.items():
        for L in LENGTHS:
            B = 32768 // L
            rng = np.random.default_rng(0)
            sets = [[jnp.asarray(rng.standard_normal((B, H, L, D)), jnp.bfloat16)
                     for _ in range(3)] for _ in range(2)]
            for kind in MASKS:
                score_mod, block_mask, density = _mods(kind, L)
                flops = 4 * B * H * L * L * D * density
                row = {"D": D, "L": L, "B": B, "H": H, "mask": kind}
                for name in ("pallas_triton", "pallas_mosaic_gpu"):
                    seconds = time_jax(lambda q, k, v, name=name: jattn.flex_attention(
                        q, k, v, score_mod, block_mask, implementation=name), sets)
                    row[name] = flops / seconds / 1e12
                row["mosaic_over_triton"] = row["pallas_mosaic_gpu"] / row["pallas_triton"]
                rows.append(row)
                print(f"D{D} L{L:>6} B{B:<2} H{H} {kind:>11}: triton {row['pallas_triton']:6.1f}"
                      f"  mosaic {row['pallas_mosaic_gpu']:6.1f}  ratio "
                      f"{row['mosaic_over_triton']:.2f}", flush=True)
                record.write(args.json, rows)


if __name__ == "__main__":
    main()
