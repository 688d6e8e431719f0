"""benchmarks/summarize.py: RESULTS.md's tables and plots from the benchmarks' JSON rows."""

import json

import pytest

from benchmarks import summarize

ENVIRONMENT = {"date": "2026-11-25", "device": "NVIDIA H100 80GB HBM3", "python": "3.11",
               "jax": "0.11.2", "jaxlib": "0.11.2", "torch": "2.11.0", "triton": "3.6.0"}
ATTENTION = [
    {"case": "B4 H16 L4096 D128", "mask": "causal", "jattn": {"fwd": 400.0, "bwd": 340.0},
     "vs_torch_flex": {"fwd": 1.08, "bwd": 1.06}, "vs_cudnn": {"fwd": 0.81, "bwd": 0.74}},
    {"case": "B4 H16 L4096 D128", "mask": "softcap", "jattn": {"fwd": 220.0, "bwd": 200.0},
     "vs_torch_flex": {"fwd": 1.2, "bwd": 1.1}},
    {"L": 32768, "jattn_s": 0.001},  # a create_block_mask row
]
DECODE = [{"copy_ceiling_GBps": 3000.0},
          {"case": "B8 S32k", "jattn": {"GBps": 3008.0}, "torch_sdpa": 3038.0,
           "torch_flex": 967.0, "vs": {"torch_flex": 3.11, "torch_sdpa": 0.99}},
          {"case": "B1 S8k", "jattn": {"GBps": 900.0}, "torch_sdpa": "error: unsupported",
           "torch_flex": 50.0, "vs": {"torch_flex": 18.0}}]
MATMUL = [{"case": "8192^3", "default": "pallas_mosaic_gpu",
           "tflops": {"pallas_triton": 675.0, "pallas_mosaic_gpu": 740.0, "xla": 723.0,
                      "torch": 706.0},
           "vs_xla": {"pallas_triton": 0.933, "pallas_mosaic_gpu": 1.023},
           "vs_torch": {"pallas_triton": 0.956, "pallas_mosaic_gpu": 1.048}}]


@pytest.fixture
def results(tmp_path):
    for name, rows in (("attention", ATTENTION), ("decode", DECODE), ("matmul", MATMUL)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"environment": ENVIRONMENT,
                                                           "rows": rows}))
    return tmp_path


def test_tables_hold_the_ratios_of_every_row(results):
    text = summarize.summarize(results, plots=None)
    assert "| B4 H16 L4096 D128 causal | 400 / 340 | 1.08 / 1.06 | 0.81 / 0.74 |" in text
    assert "| B4 H16 L4096 D128 softcap | 220 / 200 | 1.20 / 1.10 | — / — |" in text
    assert "| B8 S32k | 3008 | 3.11 | 0.99 |" in text and "| B1 S8k | 900 | 18.00 | — |" in text
    assert "| 8192^3 | pallas_triton | 675 | 0.93 | 0.96 |" in text
    assert "| 8192^3 | pallas_mosaic_gpu (default) | 740 | 1.02 | 1.05 |" in text
    assert text.count("NVIDIA H100 80GB HBM3, 2026-11-25") == 3


def test_plots_are_drawn_for_each_file_present(results, tmp_path):
    (results / "matmul.json").unlink()
    summarize.summarize(results, plots=tmp_path / "plots")
    drawn = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert drawn == ["attention.png", "decode.png"]
    assert all((tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG" for name in drawn)


def _context_parallel(devices, speedups, auto):
    """Rows of bench_context_parallel for 32k causal: {(strategy, layout): speed-up}, and
    {layout: what auto runs}."""
    rows = [{"length": 32768, "mask": "causal", "devices": devices, "layout": layout,
             "strategy": strategy, "ring_ms": 10.0 / speedup, "whole_one_device_ms": 10.0,
             "speedup_vs_one_device": speedup}
            for (strategy, layout), speedup in speedups.items()]
    return rows + [{"length": 32768, "mask": "causal", "devices": devices, "layout": layout,
                    "auto_runs": runs, "best": runs, "auto_over_best": 1.0}
                   for layout, runs in auto.items()]


def test_context_parallel_scaling_is_what_auto_runs_in_the_faster_layout(tmp_path):
    for devices, speedups, auto in (
            (2, {("ring", "zigzag"): 1.9, ("heads", "zigzag"): 1.8, ("heads", "contiguous"): 1.7},
             {"zigzag": "ring", "contiguous": "heads"}),
            (4, {("ring", "zigzag"): 3.1, ("heads", "zigzag"): 3.5, ("heads", "contiguous"): 3.6},
             {"zigzag": "heads", "contiguous": "heads"})):
        (tmp_path / f"context_parallel_{devices}gpu.json").write_text(json.dumps(
            {"environment": ENVIRONMENT, "rows": _context_parallel(devices, speedups, auto)}))
    text = summarize.summarize(tmp_path, plots=tmp_path / "plots")
    assert "| 32k, causal | 1.90 | 3.60 |" in text
    assert "| 32k, causal | 10.00 | — | 1.90 | — | — | 1.70 | 1.80 | heads (1.00× best) / ring" in text
    assert (tmp_path / "plots" / "context_parallel_scaling.png").read_bytes()[:4] == b"\x89PNG"
