"""``engine-bench``'s Markdown tables and its plot of speedup against concurrency, from its summary."""

from __future__ import annotations

from pathlib import Path

from .bench_verdict import K0_NOTE
from .report import DPI, PLAIN_COLOR, method_color, plt

TABLE_NOTE = (
    "speedup: output tok/s over plain decoding's at the same concurrency (medians over repeats; in brackets the run-to-run "
    "spread of that row's tok/s, (max - min) / median). '<name> off': the export served with k = 0 at every batch size. "
    "Schedules: the schedule's tok/s over the best / the worst static config with the drafter loaded (its k rows and its off "
    "row); it holds when never below the best by more than the tolerance (the median spread) and faster than the worst over "
    "the levels. Plain decoding: its tok/s over the fastest server with the drafter loaded (any k, off, the schedule); bold: "
    "plain at least as fast; read a ratio within the spread as a tie. Latencies in ms, p50 / p99 over the level's requests. "
    "acc. length: 1 + accepted tokens per drafting step; per position: the share of drafts accepted at depth 1, 2, ... memory: "
    "the server's processes (proportional set size, peak over the sweep). " + K0_NOTE
)


def summary_table(summary: dict) -> str:
    """Speedup by concurrency per row, the schedules against the static configs, plain decoding against them all, every figure."""
    levels = summary["config"]["concurrency"]
    rows = summary["rows"]
    cell = {(r["method"], r["concurrency"]): r for r in rows}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    verdicts = summary["proposers"]
    lines = ["| method | " + " | ".join(f"c={c}" for c in levels) + " | stops paying at |", "|---|" + "---:|" * len(levels) + "---|"]
    for m in methods:
        speeds = " | ".join(_speedup(cell[(m, c)]) for c in levels)
        stop = verdicts[m]["stops_paying_at"] if m in verdicts else None
        stop_text = "-" if m not in verdicts else ("pays at every level" if stop is None else f"c={stop}")
        lines.append(f"| {m} | {speeds} | {stop_text} |")
    out = ["\n".join(lines)]
    scheduled = {name: v for name, v in verdicts.items() if "schedule_levels" in v}
    if scheduled:
        head = ["| proposer | schedule (batch sizes: k) | " + " | ".join(f"c={c}: of best / of worst" for c in levels) + " | holds |",
                "|---|---|" + "---:|" * len(levels) + "---|"]  # fmt: skip
        for name, v in scheduled.items():
            at = _by_level(v["schedule_levels"], levels)
            ratios = " | ".join(f"{a['of_best']:.2f} / {a['of_worst']:.2f}" for a in at)
            holds = "yes" if v["at_least_best_within_noise"] and v["faster_than_worst_overall"] else "no"
            head.append(f"| {name} | {v['schedule_text']} | {ratios} | {holds} (tolerance {v['tolerance']:.0%}) |")
        out.append("\n".join(head))
    plain = ["| plain decoding over the fastest server with | " + " | ".join(f"c={c}" for c in levels) + " | recommendation |",
             "|---|" + "---:|" * len(levels) + "---|"]  # fmt: skip
    for name, v in verdicts.items():
        at = _by_level(v["against_plain"]["levels"], levels)
        ratios = " | ".join(f"**{a['plain_over_best']:.2f}**" if a["plain_wins"] else f"{a['plain_over_best']:.2f}" for a in at)
        plain.append(f"| {name}'s drafter | {ratios} | {v['against_plain']['recommendation']} |")
    out.append("\n".join(plain))
    detail = [
        "| method | c | tok/s | spread | TTFT p50 / p99 | TPOT p50 / p99 | ITL p50 / p99 | E2E p50 / p99 | acc. length "
        "| per position | failed | memory MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lat = " | ".join(f"{r[f'p50_{n}_ms']:.0f} / {r[f'p99_{n}_ms']:.0f}" for n in ("ttft", "tpot", "itl", "e2el"))
        acc = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        pos = "-" if not r["per_position_acceptance"] else " ".join(f"{v:.2f}" for v in r["per_position_acceptance"])
        detail.append(f"| {r['method']} | {r['concurrency']} | {r['output_throughput']:.0f} | {r['throughput_spread']:.0%} | {lat} "
                      f"| {acc} | {pos} | {r['failed']} | {r['peak_memory_bytes'] / 2**20:.0f} |")  # fmt: skip
    out.append("\n".join(detail))
    if summary.get("not_served"):
        out.append(
            "\n".join(f"- {name}: the engine failed to serve it: {why.splitlines()[0]}" for name, why in summary["not_served"].items())
        )
    return "\n\n".join(out) + "\n\n" + TABLE_NOTE + "\n"


def _by_level(by_level: dict, levels: list[int]) -> list[dict]:
    """``by_level``'s entries in ``levels``' order, keyed by int or, read back from summary.json, by str."""
    return [by_level[c] if c in by_level else by_level[str(c)] for c in levels]


def _speedup(row: dict) -> str:
    spread = f" ({row['throughput_spread']:.0%})" if row["repeats"] > 1 else ""
    return f"{row['speedup']:.2f}x{spread}"


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<")  # one per proposer, so that close colours still tell apart


def plot_speedup(summary: dict, path: Path) -> None:
    """Speedup over plain against concurrency (log 2 axis), one line per proposer; its served schedule in a second panel.

    Left: each export at its own k (solid), extra static k dotted, k = 0 with the drafter loaded
    (``<name> off``) dash-dotted. Right (when schedules were
    served): each schedule, dashed, on the same scale. Bars span the repeats' lowest and highest speedup.
    """
    levels = summary["config"]["concurrency"]
    rows = [r for r in summary["rows"] if r["method"] != "plain"]
    cell = {(r["method"], r["concurrency"]): r for r in rows}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    proposers = list(dict.fromkeys(r["proposer"] for r in rows))
    marker = {name: MARKERS[i % len(MARKERS)] for i, name in enumerate(proposers)}
    scheduled = [m for m in methods if cell[(m, levels[0])]["k"] is None]
    panels = [("each export at its own k (dotted: other k; dash-dot: k = 0, drafter loaded)", [m for m in methods if m not in scheduled])]
    panels += [("each proposer's batch-size schedule, served", scheduled)] if scheduled else []
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels) + 2.2, 5.6), sharey=True, layout="constrained", squeeze=False)
    for ax, (title, names) in zip(axes[0], panels, strict=True):
        ax.axhline(1.0, color=PLAIN_COLOR, linestyle="--", linewidth=1.2)
        for m in names:
            _draw_line(ax, m, [cell[(m, c)] for c in levels], levels, marker)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(True, alpha=0.3)
        ax.set_title(title, loc="left", fontsize=10)
    axes[0][0].set_ylabel("speedup over plain decoding (output tok/s); < 1: it costs")
    repeats = summary["noise"]["repeats"]
    fig.suptitle(f"speculative decoding under load in vLLM (vllm bench serve), median of {repeats} run(s), bars span the runs", fontsize=11)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if scheduled:
        more, more_labels = axes[0][-1].get_legend_handles_labels()
        handles, labels = handles + more, labels + more_labels
    handles.insert(0, plt.Line2D([], [], color=PLAIN_COLOR, linestyle="--"))
    labels.insert(0, "plain decoding (1.0)")
    fig.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _draw_line(ax, method: str, cells: list[dict], levels: list[int], marker: dict) -> None:
    proposer, k = cells[0]["proposer"], cells[0]["k"]
    values = [c["speedup"] for c in cells]
    low = [v - min(c["speedups"]) for v, c in zip(values, cells, strict=True)]
    high = [max(c["speedups"]) - v for v, c in zip(values, cells, strict=True)]
    style = {"marker": marker[proposer], "markersize": 6, "capsize": 3}
    if k is None:
        style |= {"linestyle": "--", "linewidth": 2.0, "markerfacecolor": "white"}
    elif cells[0].get("speculation_off"):
        style |= {"linestyle": "-.", "linewidth": 1.3, "markersize": 4, "alpha": 0.85}
    elif method == proposer:
        style |= {"linestyle": "-", "linewidth": 2.2}
    else:
        style |= {"linestyle": ":", "linewidth": 1.3, "markersize": 4, "alpha": 0.85}
    ax.errorbar(levels, values, yerr=[low, high], color=method_color(proposer), label=method, **style)
