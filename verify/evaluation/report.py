"""Evaluation summaries as a Markdown table and PNG plots."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

TABLE_NOTE = (
    "accept@d: steps that emitted >= d accepted draft tokens / steps whose verification reached depth d (conditional). "
    "tau = emitted tokens / target forwards; from rates: (R + S - truncated + sum_d A_d) / (R + S), R requests, S steps; "
    "iid model: (1 - a^(K+1)) / (1 - a) per step that drafted, a pooled accept@d, K mean draft depth. "
    "speedup (median): per-prompt tok/s ratios to plain; (Spec-Bench): mean tok/s over plain's. "
    "tok/s: median. nodes/step: draft nodes verified per step; plain steps: the share the speculation controller planned "
    "plain (it drafts only where that is expected to pay here; adaptive: false keeps each proposer's fixed config). "
    "transformers peers have no per-depth counts (-)."
)


def markdown_table(rows: list[dict]) -> str:
    """One line per domain x method: tau (measured, from rates, iid model), speedups, tok/s, acceptance at depths 1-3, TTFT, identical."""
    head = (
        "| domain | method | tau | tau from rates | tau (iid model) | speedup (median) | speedup (Spec-Bench) | tok/s "
        "| nodes/step | plain steps | accept@1 | accept@2 | accept@3 | TTFT ms | identical |\n"
    )
    head += "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    lines = []
    for r in rows:
        rates = r["acceptance_by_depth"]["given_reached"] if r["acceptance_by_depth"] else []
        acc = [_fmt(a) for a in rates[:3]] + ["-"] * 3
        lines.append(
            f"| {r['domain']} | {r['method']} | {r['tau']:.2f} | {_fmt(r['tau_from_rates'])} | {_fmt(r['tau_iid'])} "
            f"| {r['speedup']:.2f}x | {r['speedup_spec_bench']:.2f}x | {r['tokens_per_s']:.1f} "
            f"| {_fmt(r.get('nodes_per_step'), '.1f')} | {_fmt(r.get('plain_share'), '.0%')} "
            f"| {acc[0]} | {acc[1]} | {acc[2]} | {_fmt(r['ttft_ms'], '.1f')} | {r['identical'] or '-'} |"
        )
    return head + "\n".join(lines) + "\n\n" + TABLE_NOTE + "\n"


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


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


FEW_STEPS = 20  # points measured on fewer steps are drawn hollow


def plot_acceptance(rows: list[dict], path: Path) -> None:
    """Conditional acceptance (given reached) against draft depth, one panel per domain, one line per proposer.

    Each point is labelled with its denominator, the steps that reached that depth, and
    drawn hollow under ``FEW_STEPS``, so a deep point from three steps is not read as a
    measured rate. Lines are nudged apart sideways so coinciding points stay readable.
    """
    rows = [r for r in rows if r["acceptance_by_depth"] and r["drafted_by_depth"]]
    domains = list(dict.fromkeys(r["domain"] for r in rows)) or ["(no drafts)"]
    fig, axes = plt.subplots(1, len(domains), figsize=(4.2 * len(domains) + 1, 4.5), sharey=True, squeeze=False)
    for ax, domain in zip(axes[0], domains, strict=True):
        lines = [r for r in rows if r["domain"] == domain]
        for j, r in enumerate(lines):
            rates, reached = r["acceptance_by_depth"]["given_reached"], r["reached_by_depth"]
            points = [(d + 1, rate, reached[d]) for d, rate in enumerate(rates) if rate is not None]
            if not points:
                continue
            nudge = 0.12 * (j - (len(lines) - 1) / 2)
            xs = [x + nudge for x, _, _ in points]
            (line,) = ax.plot(xs, [y for _, y, _ in points], label=r["method"])
            color = line.get_color()
            for x, (_, y, n) in zip(xs, points, strict=True):
                ax.plot(x, y, "o", color=color, markerfacecolor=color if n >= FEW_STEPS else "white")
                ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(3, 5 if j % 2 == 0 else -11), fontsize=7, color=color)
        ax.set_title(domain)
        ax.set_xlabel("draft depth d")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.1)
        if lines:
            ax.legend(fontsize=7, loc="lower left")
    axes[0][0].set_ylabel("acceptance given depth d reached")
    fig.suptitle(f"conditional acceptance by draft depth (labels: steps that reached depth d; hollow: < {FEW_STEPS})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
