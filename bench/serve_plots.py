"""PNG plots of ``kvtier bench serve --plot DIR``: each request's TTFT per row, where each
row's prompt tokens came from, and every workload's mean and p90 TTFT side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.e2e_plots import COLORS, pyplot
from bench.serve_workloads import Workload

__all__ = ["pyplot", "write_all"]

ROW_COLORS = {"vllm": "#7f7f7f", "host": "#1f77b4", "disk": "#ff7f0e", "peer": "#2ca02c"}
ROW_NAMES = {"vllm": "vLLM alone", "host": "+host", "disk": "+host+disk", "peer": "+host+peer"}
SOURCES = ("computed", "device", "host", "disk", "remote")
SOURCE_COLORS = {**COLORS, "computed": COLORS["recomputed"]}


def _sources(tokens: dict[str, Any]) -> dict[str, int]:
    by_tier = tokens["kvtier_by_tier"]
    return {
        "computed": tokens["computed"],
        "device": tokens["device"],
        **{t: by_tier.get(t, 0) for t in SOURCES[2:]},
    }


def workload_plot(
    plt: Any,
    path: Path,
    workload: Workload,
    figure: dict[str, Any],
    requests: dict[str, list[dict[str, Any]]],
) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for row, outputs in requests.items():
        ttft = [o["ttft_s"] for o in outputs]
        left.plot(range(len(ttft)), ttft, "o-", ms=3, lw=1, color=ROW_COLORS[row], label=ROW_NAMES[row])
    classes = figure.get("classes") or []
    for i, name in enumerate(classes):
        if name == "device-miss":
            left.axvspan(i - 0.4, i + 0.4, color="#d62728", alpha=0.08, lw=0)
    left.set_yscale("log")
    left.set_xlabel("request (shaded: vLLM alone's device cache had lost a prefix seen before)")
    left.set_ylabel("TTFT (s)")
    left.set_title(f"{workload.name}: time to first token per request")
    left.legend(fontsize=8)
    rows = list(figure["rows"])
    bottom = np.zeros(len(rows))
    for source in SOURCES:
        values = np.array([_sources(figure["rows"][r]["tokens"])[source] for r in rows], dtype=float)
        if values.any():
            name = "peer" if source == "remote" else source
            right.bar(
                [ROW_NAMES[r] for r in rows], values, bottom=bottom, color=SOURCE_COLORS[source], label=name
            )
            bottom += values
    right.set_ylabel("prompt tokens")
    right.set_title("where prompt tokens came from")
    right.tick_params(axis="x", labelsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_plot(plt: Any, path: Path, figures: dict[str, dict[str, Any]]) -> Path:
    names = list(figures)
    rows = list(next(iter(figures.values()))["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(rows)
    for ax, stat in zip(axes, ("mean", "p90"), strict=True):
        for k, row in enumerate(rows):
            values = [figures[n]["rows"][row]["ttft"][stat] for n in names]
            ax.bar(
                np.arange(len(names)) + k * width, values, width, color=ROW_COLORS[row], label=ROW_NAMES[row]
            )
        ax.set_xticks(np.arange(len(names)) + width * (len(rows) - 1) / 2, names)
        ax.set_ylabel(f"{stat} TTFT (s)")
        ax.set_title(f"{stat} time to first token, same engine, same requests")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(
    directory: Path,
    workloads: list[Workload],
    figures: dict[str, dict[str, Any]],
    requests: dict[str, dict[str, list[dict[str, Any]]]],
) -> list[Path]:
    """Every plot of a run into ``directory``; returns their paths."""
    plt = pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    paths = [
        workload_plot(
            plt,
            directory / f"serve-{w.name}.png",
            w,
            figures[w.name],
            {row: per_workload[w.name] for row, per_workload in requests.items()},
        )
        for w in workloads
    ]
    paths.append(summary_plot(plt, directory / "serve-summary.png", figures))
    return paths
