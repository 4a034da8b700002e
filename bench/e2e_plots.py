"""PNG plots of ``kvtier bench e2e --plot DIR``: token sources over time, load-latency CDFs,
TTFT with and without kvtier (and with vLLM's CPU offloading), token sources per workload.

matplotlib is optional (the ``bench`` extra); ``pyplot()`` raises ``ImportError`` naming the
install line, which the benchmark checks before it runs anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.ttft import percentile

INSTALL = "pip install -c constraints.txt -e '.[bench]'  (in a kvtier checkout; or: make bench)"
COLORS = {
    "device": "#9e9e9e",
    "host": "#1f77b4",
    "disk": "#ff7f0e",
    "remote": "#2ca02c",
    "recomputed": "#d62728",
}
NAMES = {"remote": "peer"}  # the remote tier is a kvtier peer in this benchmark


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            f"--plot needs matplotlib, which does not import ({exc}); install it: {INSTALL}"
        ) from exc
    return plt


def rolling_share(
    per_request: Sequence[dict[str, int]], sources: Sequence[str], of: Sequence[str], window: int
) -> np.ndarray:
    """Tokens from ``sources`` over tokens from ``of``, in the last ``window`` requests, per request."""
    served = np.array([sum(t[s] for s in sources) for t in per_request], dtype=float)
    total = np.array([sum(t[s] for s in of) for t in per_request], dtype=float)
    kernel = np.ones(window)
    num = np.convolve(served, kernel)[: len(served)]
    den = np.convolve(total, kernel)[: len(total)]
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


TIERS = ("host", "disk", "remote")
MISSED = (*TIERS, "recomputed")  # what the device cache lacked
BAR_COLORS = {"vLLM CPU lru": "#fdae6b", "vLLM CPU arc": "#e6550d", "kvtier host": "#9ecae1"}
ROW_STYLES = {"vLLM CPU lru": ":", "vLLM CPU arc": "--", "kvtier host": "-."}


def plot_hit_ratio(
    plt: Any, path: Path, series: dict[str, dict[str, Sequence[dict[str, int]]]], chain: dict[str, str]
) -> None:
    """Per workload over the run: the share of the blocks the device lacked that each of
    kvtier's tiers served (stacked), and the share vLLM's CPU tier and kvtier's host tier
    alone served (lines), under the same device cache and host capacity."""
    names = list(series)
    cols = min(2, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.4 * rows + 1.3), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        per_row = series[name]
        ours = per_row[chain[name]]
        window = max(1, len(ours) // 15)
        x = np.arange(1, len(ours) + 1)
        stack = [rolling_share(ours, [s], MISSED, window) for s in TIERS]
        labels = [f"{chain[name]}: {NAMES.get(s, s)} tier" for s in TIERS]
        ax.stackplot(x, stack, labels=labels, colors=[COLORS[s] for s in TIERS], alpha=0.8)
        for row, style in ROW_STYLES.items():
            if row in per_row:
                host = rolling_share(per_row[row], ["host"], MISSED, window)
                label = f"{row} (host tier alone)" if row.startswith("kvtier") else f"{row} (CPU tier)"
                ax.plot(x, host, style, color="black", lw=1.2, label=label)
        ax.set_title(f"{name} (rolling mean over {window} requests)", fontsize=10)
        ax.set_xlim(1, len(ours))
        ax.set_ylim(0, 1)
        ax.set_xlabel("request (trace order)")
        ax.set_ylabel("hit ratio (of blocks not on device)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("Blocks the device prefix cache lacked, served by each tier (the rest recomputed)")
    fig.tight_layout(rect=(0, 0.9 / (3.4 * rows + 1.3), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdf(plt: Any, path: Path, latencies: dict[str, Sequence[float]]) -> None:
    """CDF of per-request load latency (engine's lookup to loaded), by the slowest tier used."""
    fig, ax = plt.subplots(figsize=(7, 5))
    for kind, values in latencies.items():
        if not values:
            continue
        ms = np.sort(np.asarray(values) * 1e3)
        p50, p99 = percentile(list(ms), 50), percentile(list(ms), 99)  # as the printed table
        label = f"{NAMES.get(kind, kind)} ({len(ms)} requests, p50 {p50:.2f} ms, p99 {p99:.2f} ms)"
        ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", color=COLORS[kind], label=label)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("load latency per request, ms (first lookup until its blocks are in the device cache)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Load latency by the slowest tier a request used")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft(
    plt: Any, path: Path, side: dict[str, dict[str, Any]], measured: dict[str, Any], cost: str
) -> None:
    """Modelled mean TTFT per workload and row (at achieved and at ceiling GB/s), and the
    prefill-vs-load measured on this machine."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), gridspec_kw={"width_ratios": [3, 3, 1.2]})
    workloads = list(side)
    rows = ["recompute all", *next(iter(side.values()))]
    width = 0.8 / len(rows)
    palette = {"recompute all": COLORS["recomputed"], **BAR_COLORS}
    for ax, bound in zip(axes[:2], ("achieved", "ceiling"), strict=True):
        for i, row in enumerate(rows):
            values = []
            for w in workloads:
                first = next(iter(side[w].values()))["ttft"][bound]
                fig_row = first if row == "recompute all" else side[w][row]["ttft"][bound]
                key = "no_kvtier_mean_ms" if row == "recompute all" else "mean_ms"
                values.append(fig_row.get(key, 0.0))
            x = np.arange(len(workloads)) + (i - (len(rows) - 1) / 2) * width
            color = palette.get(row, "#08519c")  # kvtier's whole chain
            ax.bar(x, values, width, label=row, color=color)
        ax.set_xticks(np.arange(len(workloads)), workloads)
        ax.set_ylabel("mean TTFT, ms (modelled)")
        ax.set_title(f"loads at each tier's {bound} GB/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    m = measured
    ax = axes[2]
    bars = ax.bar(
        ["prefill", "load KV\n(host tier)"],
        [m["prefill_ms"], m["cached_load_ms"]],
        color=["#d62728", "#1f77b4"],
    )
    ax.bar_label(bars, fmt="%.1f ms", fontsize=9)  # the load is too small to see as a bar
    ax.margins(y=0.12)
    ax.set_ylabel("ms (measured here, CPU)")
    ax.set_title(f"{m['prompt_tokens']}-token prompt, tiny model", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"TTFT modelled for {cost}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tokens(plt: Any, path: Path, tokens: dict[str, dict[str, int]]) -> None:
    """Token sources per workload of kvtier's chain, as stacked shares."""
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = np.zeros(len(tokens))
    for source in COLORS:
        share = np.array([t[source] / max(1, sum(t.values())) for t in tokens.values()])
        ax.bar(list(tokens), share, bottom=bottom, label=NAMES.get(source, source), color=COLORS[source])
        bottom += share
    ax.set_ylabel("share of prompt tokens")
    ax.set_title("Where each workload's prompt tokens came from (kvtier, all tiers)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(
    directory: str,
    series: dict[str, dict[str, Sequence[dict[str, int]]]],
    chain: dict[str, str],
    latencies: dict[str, Sequence[float]],
    side: dict[str, dict[str, Any]],
    measured: dict[str, Any],
    cost: str,
) -> list[Path]:
    """All four PNGs into ``directory`` (created); their paths."""
    plt = pyplot()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"e2e_{name}.png" for name in ("hit_ratio", "load_latency_cdf", "ttft", "tokens")]
    plot_hit_ratio(plt, paths[0], series, chain)
    plot_latency_cdf(plt, paths[1], latencies)
    plot_ttft(plt, paths[2], side, measured, cost)
    plot_tokens(
        plt,
        paths[3],
        {w: {s: sum(t[s] for t in rows[chain[w]]) for s in COLORS} for w, rows in series.items()},
    )
    return paths
