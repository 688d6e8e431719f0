"""RESULTS.md's tables and plots, from the benchmarks' JSON files.

    python -m benchmarks.summarize [--results benchmarks/results] [--plots benchmarks/plots]

Reads attention.json, decode.json, matmul.json, context_parallel_2gpu.json and
context_parallel_4gpu.json (each written by its benchmark's --json), prints one Markdown table
per file and draws one PNG per file (matplotlib, the `bench` extra), then the scaling of
strategy="auto" over the context-parallel files present (a table and
context_parallel_scaling.png). Files that are missing are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from collections.abc import Callable

HERE = pathlib.Path(__file__).resolve().parent


def _ratio(value) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) and math.isfinite(value) else "—"


def _number(value) -> float:
    return value if isinstance(value, (int, float)) else math.nan


def attention_rows(rows: list[dict]) -> list[dict]:
    """One entry per (shape, mask): forward/backward TFLOP/s and ratios."""
    out = []
    for row in rows:
        if "jattn" not in row:  # create_block_mask rows
            continue
        entry = {"label": f"{row['case']} {row['mask']}", "jattn": row["jattn"]}
        for side in ("torch_flex", "cudnn"):
            ratio = row.get(f"vs_{side}", {})
            entry[side] = (_number(ratio.get("fwd")), _number(ratio.get("bwd")))
        out.append(entry)
    return out


def attention_table(rows: list[dict]) -> str:
    lines = ["| shape, mask | jattn fwd / bwd TFLOP/s | × torch flex fwd / bwd | × cuDNN fwd / bwd |",
             "|---|---|---|---|"]
    for e in attention_rows(rows):
        lines.append(f"| {e['label']} | {e['jattn']['fwd']:.0f} / {e['jattn']['bwd']:.0f} | "
                     f"{_ratio(e['torch_flex'][0])} / {_ratio(e['torch_flex'][1])} | "
                     f"{_ratio(e['cudnn'][0])} / {_ratio(e['cudnn'][1])} |")
    return "\n".join(lines)


def decode_rows(rows: list[dict]) -> list[dict]:
    return [row for row in rows if "jattn" in row]


def decode_table(rows: list[dict]) -> str:
    lines = ["| batch, cache | jattn GB/s | × torch flex decoding | × SDPA (no mods) |",
             "|---|---|---|---|"]
    for row in decode_rows(rows):
        lines.append(f"| {row['case']} | {row['jattn']['GBps']:.0f} | "
                     f"{_ratio(row['vs'].get('torch_flex'))} | "
                     f"{_ratio(row['vs'].get('torch_sdpa'))} |")
    return "\n".join(lines)


def _matmul_entries(rows: list[dict]) -> list[tuple[str, str, dict]]:
    """(problem, kernel, row) for each kernel that ran each problem."""
    return [(row["case"], name, row) for row in rows for name in row["vs_xla"]]


def matmul_table(rows: list[dict]) -> str:
    lines = ["| problem | kernel | TFLOP/s | × XLA | × torch |", "|---|---|---|---|---|"]
    for case, name, row in _matmul_entries(rows):
        kernel = f"{name} (default)" if row.get("default") == name else name
        lines.append(f"| {case} | {kernel} | {row['tflops'][name]:.0f} | "
                     f"{_ratio(row['vs_xla'][name])} | {_ratio(row['vs_torch'][name])} |")
    return "\n".join(lines)


def _bars(axis, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        axis.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    axis.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=30,
                    ha="right", fontsize=8)
    axis.set_ylabel(ylabel)
    axis.legend(fontsize=8)


def _title(environment: dict, what: str) -> str:
    return f"{what} — {environment['device']}, {environment['date']}, jax {environment['jax']}"


def attention_plot(data: dict, figure) -> None:
    entries = attention_rows(data["rows"])
    labels = [e["label"] for e in entries]
    for column, (axis, direction) in enumerate(zip(figure.subplots(1, 2), ("forward", "backward"))):
        _bars(axis, labels, {f"× {name}": [e[side][column] for e in entries]
                             for side, name in (("torch_flex", "torch FlexAttention"),
                                                ("cudnn", "cuDNN"))},
              f"jattn {direction} speed ratio")
        axis.axhline(1.0, color="black", linewidth=0.8)
    figure.suptitle(_title(data["environment"], "FlexAttention (bf16), higher is better"))


def decode_plot(data: dict, figure) -> None:
    rows = decode_rows(data["rows"])
    axis = figure.subplots()
    _bars(axis, [row["case"] for row in rows],
          {"jattn": [row["jattn"]["GBps"] for row in rows],
           "torch SDPA (no mods)": [_number(row["torch_sdpa"]) for row in rows],
           "torch flex decoding": [_number(row["torch_flex"]) for row in rows]},
          "K+V read, GB/s")
    ceiling = next((row["copy_ceiling_GBps"] for row in data["rows"]
                    if "copy_ceiling_GBps" in row), None)
    if ceiling:
        axis.axhline(ceiling, color="black", linewidth=0.8, linestyle="--",
                     label="copy ceiling (read + write)")
        axis.legend(fontsize=8)
    figure.suptitle(_title(data["environment"], "Flex decoding, Hq32 Hkv8 D128 bf16"))


def matmul_plot(data: dict, figure) -> None:
    entries = _matmul_entries(data["rows"])
    axis = figure.subplots()
    _bars(axis, [f"{case} {name}" for case, name, _ in entries],
          {"× XLA": [row["vs_xla"][name] for _, name, row in entries],
           "× torch": [row["vs_torch"][name] for _, name, row in entries]},
          "jattn.matmul speed ratio")
    axis.axhline(1.0, color="black", linewidth=0.8)
    figure.suptitle(_title(data["environment"], "GEMM (bf16), higher is better"))


_STRATEGY_COLUMNS = [(strategy, layout) for strategy in ("ring", "all_gather", "heads")
                     for layout in ("contiguous", "zigzag")]


def _context_parallel_cases(rows: list[dict]) -> list[tuple[int, str]]:
    return list(dict.fromkeys((row["length"], row["mask"]) for row in rows if "strategy" in row))


def _speedups(rows: list[dict], length: int, mask: str) -> dict[tuple[str, str], float]:
    return {(row["strategy"], row["layout"]): row["speedup_vs_one_device"] for row in rows
            if "strategy" in row and (row["length"], row["mask"]) == (length, mask)}


def context_parallel_table(rows: list[dict]) -> str:
    lines = ["| sequence, mask | one GPU ms | " + " | ".join(
                 f"{strategy} {layout}" for strategy, layout in _STRATEGY_COLUMNS) +
             " | auto runs (contiguous / zigzag) |",
             "|---" * (len(_STRATEGY_COLUMNS) + 3) + "|"]
    for length, mask in _context_parallel_cases(rows):
        speedups = _speedups(rows, length, mask)
        one = next(row["whole_one_device_ms"] for row in rows if "strategy" in row and
                   (row["length"], row["mask"]) == (length, mask))
        auto = {row["layout"]: row for row in rows if "auto_runs" in row and
                (row["length"], row["mask"]) == (length, mask)}
        chosen = " / ".join(
            f"{auto[layout]['auto_runs']} ({auto[layout]['auto_over_best']:.2f}× best)"
            if layout in auto else "—" for layout in ("contiguous", "zigzag"))
        lines.append(f"| {length // 1024}k, {mask} | {one:.2f} | " + " | ".join(
            _ratio(speedups.get(column)) for column in _STRATEGY_COLUMNS) + f" | {chosen} |")
    return "\n".join(lines)


def context_parallel_plot(data: dict, figure) -> None:
    rows = data["rows"]
    cases = _context_parallel_cases(rows)
    devices = next(row["devices"] for row in rows if "strategy" in row)
    axis = figure.subplots()
    _bars(axis, [f"{length // 1024}k {mask}" for length, mask in cases],
          {f"{strategy} {layout}": [_number(_speedups(rows, *case).get((strategy, layout)))
                                    for case in cases]
           for strategy, layout in _STRATEGY_COLUMNS},
          "speed-up over one GPU")
    axis.axhline(devices, color="black", linewidth=0.8, linestyle="--")
    figure.suptitle(_title(data["environment"], f"Context parallelism on {devices} GPUs, "
                           "forward + backward (B1 H16 D128 bf16), higher is better"))


def auto_speedups(rows: list[dict]) -> dict[tuple[int, str], dict[int, float]]:
    """{(length, mask): {devices: speed-up over one GPU of what strategy="auto" runs, in the
    faster layout}}."""
    scaling: dict[tuple[int, str], dict[int, float]] = {}
    for row in rows:
        if "auto_runs" not in row:
            continue
        case = (row["length"], row["mask"])
        speedup = _speedups([r for r in rows if r.get("devices") == row["devices"]], *case).get(
            (row["auto_runs"], row["layout"]), math.nan)
        known = scaling.setdefault(case, {}).get(row["devices"], -math.inf)
        scaling[case][row["devices"]] = max(known, speedup)
    return scaling


def scaling_table(scaling: dict[tuple[int, str], dict[int, float]]) -> str:
    counts = sorted({devices for by_count in scaling.values() for devices in by_count})
    lines = ["| sequence, mask | " + " | ".join(f"{n} GPUs" for n in counts) + " |",
             "|---" * (len(counts) + 1) + "|"]
    for (length, mask), by_count in scaling.items():
        lines.append(f"| {length // 1024}k, {mask} | " + " | ".join(
            _ratio(by_count.get(n)) for n in counts) + " |")
    return "\n".join(lines)


def scaling_plot(scaling: dict[tuple[int, str], dict[int, float]], figure) -> None:
    axis = figure.subplots()
    counts = sorted({1, *(devices for by_count in scaling.values() for devices in by_count)})
    for (length, mask), by_count in scaling.items():
        shown = [1, *sorted(by_count)]
        axis.plot(shown, [1.0, *(by_count[n] for n in shown[1:])], marker="o",
                  label=f"{length // 1024}k {mask}")
    axis.plot(counts, counts, color="black", linewidth=0.8, linestyle="--", label="linear")
    axis.set_xticks(counts)
    axis.set_xlabel("GPUs")
    axis.set_ylabel("speed-up over one GPU")
    axis.legend(fontsize=8)
    figure.suptitle('Context parallelism, strategy="auto" in the faster layout, forward + '
                    "backward (B1 H16 D128 bf16)")


SUMMARIES: dict[str, tuple[Callable[[list], str], Callable]] = {
    "attention": (attention_table, attention_plot),
    "decode": (decode_table, decode_plot),
    "matmul": (matmul_table, matmul_plot),
    "context_parallel_2gpu": (context_parallel_table, context_parallel_plot),
    "context_parallel_4gpu": (context_parallel_table, context_parallel_plot),
}


def summarize(results: pathlib.Path, plots: pathlib.Path | None) -> str:
    """The Markdown tables of every results file present; draws their plots into `plots`."""
    sections, context_parallel_rows = [], []
    for name, (table, plot) in SUMMARIES.items():
        path = results / f"{name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        environment = data["environment"]
        sections.append(f"{name}.json: {environment['device']}, {environment['date']}, jax "
                        f"{environment['jax']}, torch {environment['torch']}, triton "
                        f"{environment['triton']}\n\n{table(data['rows'])}")
        if plot is context_parallel_plot:
            context_parallel_rows += data["rows"]
        _draw(plots, name, lambda figure: plot(data, figure))
    scaling = auto_speedups(context_parallel_rows)
    if scaling:
        sections.append(f"strategy=\"auto\" over one GPU\n\n{scaling_table(scaling)}")
        _draw(plots, "context_parallel_scaling", lambda figure: scaling_plot(scaling, figure))
    return "\n\n".join(sections)


def _draw(plots: pathlib.Path | None, name: str, plot: Callable) -> None:
    """plot(figure), saved as plots/name.png (nothing where plots is None)."""
    if plots is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5), layout="constrained")
    plot(figure)
    plots.mkdir(parents=True, exist_ok=True)
    figure.savefig(plots / f"{name}.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=HERE / "results")
    parser.add_argument("--plots", type=pathlib.Path, default=HERE / "plots")
    args = parser.parse_args()
    print(summarize(args.results, args.plots))


if __name__ == "__main__":
    main()
