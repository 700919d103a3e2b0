"""Evaluation summaries as a Markdown table and PNG plots."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def markdown_table(rows: list[dict]) -> str:
    """One line per domain x method: tau, speedup, tok/s, acceptance at depths 1-3, TTFT, identical."""
    head = "| domain | method | tau | speedup | tok/s | accept@1 | accept@2 | accept@3 | TTFT ms | identical |\n"
    head += "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    lines = []
    for r in rows:
        acc = [f"{a:.2f}" for a in r["acceptance_by_depth"][:3]] + ["-"] * 3
        ttft = f"{r['ttft_ms']:.1f}" if r["ttft_ms"] is not None else "-"
        lines.append(
            f"| {r['domain']} | {r['method']} | {r['tau']:.2f} | {r['speedup']:.2f}x | {r['tokens_per_s']:.1f} "
            f"| {acc[0]} | {acc[1]} | {acc[2]} | {ttft} | {r['identical'] or '-'} |"
        )
    return head + "\n".join(lines) + "\n"


def _grid(rows: list[dict]) -> tuple[list[str], list[str]]:
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    return domains, methods


def plot_domains(rows: list[dict], path: Path) -> None:
    """Grouped bars per domain: tau (left) and speedup over plain decoding (right), one bar per method."""
    domains, methods = _grid(rows)
    lookup = {(r["domain"], r["method"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.5 * len(domains) + 4), 4.5))
    width = 0.8 / len(methods)
    for ax, key, title in ((axes[0], "tau", "tau (tokens per target forward)"), (axes[1], "speedup", "speedup vs plain decoding")):
        for j, method in enumerate(methods):
            values = [lookup[(d, method)][key] if (d, method) in lookup else 0.0 for d in domains]
            bars = ax.bar([i + j * width for i in range(len(domains))], values, width, label=method)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(domains))], domains)
        ax.set_title(title)
    axes[1].legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(rows: list[dict], path: Path) -> None:
    """Unconditional acceptance rate against draft depth, one line per domain x proposer."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        acc = r["acceptance_by_depth"]
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{r['domain']} / {r['method']}")
    ax.set_xlabel("draft depth")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by draft depth")
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
