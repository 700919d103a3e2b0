"""Evaluation summaries as a Markdown table and PNG plots."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

TABLE_NOTE = (
    "accept@d: steps that emitted >= d accepted draft tokens / steps whose verification reached depth d (conditional). "
    "tau = emitted tokens / target forwards; from rates: (R + S - truncated + sum_d A_d) / (R + S), R requests, S steps; "
    "iid model: (1 - a^(K+1)) / (1 - a) per step that drafted, a pooled accept@d, K mean draft depth. "
    "speedup (median): per-prompt (a question's: per-turn) tok/s ratios to plain; (Spec-Bench): the mean over questions of "
    "tokens / wall time summed over a question's turns (a prompt: one turn), over plain's. "
    "identical: outputs equal to plain's, per prompt or turn. "
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


# Method colours: one per method, from its name. A family shares a hue (greens: lookup, oranges: a draft model,
# blues and purples: heads trained on the target, pinks: transformers peers), so a plot reads by family at a glance.
PLAIN_COLOR = "#222222"
FAMILY_PALETTES = {  # a name not in KNOWN_COLORS gets one of its family's by a stable hash of the name
    "lookup": ("#1b7837", "#7fbf7b", "#00838f", "#5fc9d6", "#4d9221"),
    "draft": ("#d94801", "#fdae6b", "#f16913", "#a63603"),
    "heads": ("#6a51a3", "#9e80d0", "#9ecae1", "#4292c6", "#08306b", "#3f2a8c"),
    "peers": ("#ae017e", "#f768a1", "#dd3497", "#7a0177"),
    "other": ("#8c564b", "#bcbd22", "#c49c94", "#dbdb8d", "#e7ba52"),  # browns and olives, off every family's hue
}
KNOWN_COLORS = {  # the project's methods, each its own colour of its family's palette
    "ngram": "#1b7837",
    "ngram_tree": "#7fbf7b",
    "suffix": "#00838f",
    "suffix+ngram": "#5fc9d6",
    "demo_draft": "#d94801",
    "suffix+draft": "#fdae6b",
    "medusa": "#6a51a3",
    "mtp": "#9e80d0",
    "eagle1": "#9ecae1",
    "eagle2": "#4292c6",
    "eagle3": "#08306b",
    "dflash": "#3f2a8c",
    "hf_prompt_lookup[ngram]": "#ae017e",
    "hf_assisted[demo_draft]": "#f768a1",
}
FAMILY_ORDER = ("plain", "lookup", "draft", "heads", "peers", "other")


def method_family(name: str) -> str:
    """plain, lookup, draft, heads, peers (transformers' ``hf_*[...]``) or other."""
    if name == "plain":
        return "plain"
    if name.startswith("hf_"):
        return "peers"
    if name.startswith(("medusa", "eagle", "mtp", "dflash")):
        return "heads"
    if "draft" in name:
        return "draft"
    if "ngram" in name or "suffix" in name:
        return "lookup"
    return "other"


def method_color(name: str) -> str:
    """The colour of a method, the same in every plot and run whatever other methods are drawn."""
    family = method_family(name)
    if family == "plain":
        return PLAIN_COLOR
    if name in KNOWN_COLORS:
        return KNOWN_COLORS[name]
    palette = FAMILY_PALETTES[family]
    return palette[zlib.crc32(name.encode()) % len(palette)]  # crc32, not hash(): str hashes change between runs


def _by_family(methods: list[str]) -> list[str]:
    """The methods grouped by family (plain first), in their given order within a family."""
    return sorted(methods, key=lambda m: FAMILY_ORDER.index(method_family(m)))


DPI = 110
MAX_WIDTH_IN = 14.5  # 1595 px at DPI: a figure fits a screen whatever the number of domains
MARGIN_IN = 2.5  # what the axis labels and the legend take of the width
BAR_IN = 0.085  # the narrowest bar, in inches; domains that would make bars narrower wrap onto another row
LABEL_IN = 0.22  # bars at least this wide get their values written on them; narrower, only the best of each domain
LABEL_BOX = {"facecolor": "white", "edgecolor": "none", "pad": 0.5}  # the 1.0 line does not strike through a value
FEW_STEPS = 20  # acceptance measured on fewer steps that reached the depth is drawn faint, with hollow markers


def plot_domains(rows: list[dict], path: Path) -> None:
    """Speedup over plain decoding (top) and tau (below): a group of bars per domain, a bar per method, families side by side."""
    domains, methods = _grid(rows)
    methods = [m for m in _by_family(methods) if m != "plain"]  # plain decoding is the dashed 1.0 line
    cells = {(r["domain"], r["method"]): r for r in rows}
    _, group = _bar_offsets(methods)
    per_row = max(1, int((MAX_WIDTH_IN - MARGIN_IN) / (group * BAR_IN)))
    chunks = [domains[i : i + per_row] for i in range(0, len(domains), per_row)]
    width = min(MAX_WIDTH_IN, max(7.0, MARGIN_IN + len(chunks[0]) * group * BAR_IN))
    label_all = (width - MARGIN_IN) / (len(chunks[0]) * group) >= LABEL_IN
    panels = [("speedup", chunk) for chunk in chunks] + [("tau", chunk) for chunk in chunks]
    heights = [3] * len(chunks) + [2] * len(chunks)  # speedup is what people come for; tau explains it
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, 1.0 + 5.0 * len(chunks)), height_ratios=heights, layout="constrained")
    for ax, (key, chunk) in zip(axes, panels, strict=True):
        values = {m: [cells[(d, m)][key] if (d, m) in cells else None for d in chunk] for m in methods}
        _draw_bars(ax, chunk, values, label_all)
        ax.set_xlim(-1.5, len(chunks[0]) * group - 1.5)  # a last, shorter row keeps the bar width of the others
        ax.set_ylabel("speedup vs plain" if key == "speedup" else "tau")
    axes[0].set_title("speedup over plain decoding (median of per-prompt tok/s ratios)", loc="left", fontsize=10)
    axes[len(chunks)].set_title("tau: tokens emitted per target forward", loc="left", fontsize=10)
    handles = [Line2D([], [], color=PLAIN_COLOR, linestyle="--", label="plain (1.0)")]
    handles += [Patch(color=method_color(m), label=m) for m in methods]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _bar_offsets(methods: list[str]) -> tuple[dict[str, float], float]:
    """Each method's x within a domain's group of bars (half a bar between families), and a group's width with the gap after it."""
    offsets, x = {}, 0.0
    for prev, method in zip([None, *methods], methods, strict=False):
        if prev is not None:
            x += 1.5 if method_family(method) != method_family(prev) else 1.0
        offsets[method] = x
    return offsets, x + 3.0


def _draw_bars(ax, domains: list[str], values: dict[str, list[float | None]], label_all: bool) -> None:
    """One panel: ``values[method][i]``, the method's value in ``domains[i]`` (None: not run), as bars under the 1.0 line.

    Every bar has its value written on it where ``label_all``, else only the tallest of each domain (one label a group never collides).
    """
    offsets, group = _bar_offsets(list(values))
    best: dict[int, tuple[float, float]] = {}  # domain index -> (value, x) of its tallest bar
    for method, row in values.items():
        xs = [d * group + offsets[method] for d, v in enumerate(row) if v is not None]
        bars = ax.bar(xs, [v for v in row if v is not None], 1.0, color=method_color(method), label=method)
        if label_all:
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1, bbox=LABEL_BOX)
        for d, v in enumerate(row):
            if v is not None and v > best.get(d, (-math.inf, 0.0))[0]:
                best[d] = (v, d * group + offsets[method])
    if not label_all:
        for value, x in best.values():
            ax.annotate(f"{value:.2f}", (x, value), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=8, bbox=LABEL_BOX)
    ax.axhline(1.0, color=PLAIN_COLOR, linewidth=1.0, linestyle="--", zorder=2.5)  # over the bars, under the labels
    ax.set_xticks([d * group + (group - 3) / 2 for d in range(len(domains))], domains)
    ax.margins(y=0.12)
    ax.spines[["top", "right"]].set_visible(False)


def plot_acceptance(rows: list[dict], path: Path) -> None:
    """Conditional acceptance (given depth d reached) against draft depth d: a panel per domain, a line per method.

    Transformers peers have no per-depth counts and are left out. Depths that fewer than ``FEW_STEPS``
    steps reached are drawn faint with hollow markers, so a rate from three steps does not read as measured.
    """
    lines = [(r["domain"], r["method"], _depth_points(r)) for r in rows]
    lines = [line for line in lines if line[2]]
    domains = list(dict.fromkeys(domain for domain, _, _ in lines)) or ["(no method drafted)"]
    ncols = min(4, len(domains))
    nrows = math.ceil(len(domains) / ncols)
    figsize = (min(MAX_WIDTH_IN, max(7.0, 3.1 * ncols + 2.0)), 0.8 + 2.6 * nrows)
    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, sharey=True, squeeze=False, layout="constrained")
    depth = max((points[-1][0] for _, _, points in lines), default=3)
    for ax, domain in zip(axes.flat, domains, strict=False):
        for _, method, points in (line for line in lines if line[0] == domain):
            xs, ys = [x for x, _, _ in points], [y for _, y, _ in points]
            measured = [y if n >= FEW_STEPS else math.nan for _, y, n in points]  # NaN breaks the line: few-step depths stay faint
            ax.plot(xs, ys, color=method_color(method), alpha=0.45, linewidth=1.0, marker="o", markersize=3.5, markerfacecolor="white")
            ax.plot(xs, measured, color=method_color(method), linewidth=1.6, marker="o", markersize=3.5, label=method)
        ax.set_title(domain, fontsize=10)
        ax.set_xlim(0.5, depth + 0.5)
        ax.set_ylim(-0.03, 1.05)  # a rate of 0 stays in view
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(domains) :]:
        ax.set_visible(False)
    fig.supxlabel("draft depth d", fontsize=10)
    fig.supylabel("acceptance given depth d reached", fontsize=10)
    fig.suptitle(f"conditional acceptance by draft depth (faint, hollow: fewer than {FEW_STEPS} steps reached d)", fontsize=10)
    methods = _by_family(list(dict.fromkeys(method for _, method, _ in lines)))
    handles = [Line2D([], [], color=method_color(m), marker="o", markersize=4, label=m) for m in methods]
    handles.append(
        Line2D([], [], color="grey", alpha=0.45, marker="o", markersize=4, markerfacecolor="white", label=f"< {FEW_STEPS} steps")
    )
    if methods:
        fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _depth_points(row: dict) -> list[tuple[int, float, int]]:
    """(depth d, acceptance given d reached, steps that reached d) of a row; none for a transformers peer or a row that never drafted."""
    if not row["acceptance_by_depth"]:
        return []
    rates = row["acceptance_by_depth"]["given_reached"]
    return [(d + 1, rate, n) for d, (rate, n) in enumerate(zip(rates, row["reached_by_depth"], strict=False)) if rate is not None]
