"""The speculation controller against plain decoding and against every fixed config, side by side, over several runs.

    python -m benchmarks.bench_controller --part demo [--runs 3] [--temperature 0.7] [--depth 32] [--json FILE]
    python -m benchmarks.bench_controller --part grid [--runs 3] [--domains code,prose,long] [--depth 32] [--json FILE]
    python -m benchmarks.bench_controller --part random [--runs 3] [--json FILE]
    python -m benchmarks.bench_controller --depths 8=FILE 32=FILE   # what the controller drafted, per method and demo run

- ``demo``: every demo domain and every demo method with the controller on (``adaptive``),
  each against plain decoding in the same evaluation (interleaved prompt by prompt). Per
  row: the median speedup of each run, how many runs reach 0.97x, greedy identity, the
  nodes verified per step and the share of plain steps, and the controller's own
  seconds per step against a plain step's.
- ``grid``: for each trained family (``demo_draft``, ``medusa``, the EAGLE-1 head as
  ``eagle1`` and ``eagle2``, ``eagle3``, ``mtp``) its shipped config with the controller,
  the shipped config fixed, and a grid of fixed configs (chains of depth 1-6, trees of 2, 4,
  8, 16 and 24 nodes), all in one evaluation. Per domain: the controller's speed over the
  best fixed config's (the best in the same run, and the config best on the other runs,
  measured in this one: no winner's curse) and over the shipped one's.
- ``random``: a proposer of random drafts (useless) with the controller, against plain; and
  one that never drafts (``no_draft``: plain decoding's work through a proposer's decoder),
  whose spread around 1.00 is the noise floor of this machine and harness.

``--depth`` runs it all on the demo target padded with zero-output layers to that many
layers (``bench_depth.padded_target``: the same function, a costlier step), with the same
configs. Timings are medians of per-prompt ratios to plain decoding in the same run, plain
decoding's speed for a prompt being the median of its ``--plain-repeats`` runs (3; 1 before
2026-12-06, ``c20`` and earlier).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from benchmarks.bench_depth import padded_heads, padded_target
from draftsmith.proposers.core.proposer import ProposerBase
from draftsmith.proposers.core.types import Draft, ProposeContext
from draftsmith.proposers.registry import REGISTRY
from draftsmith.training.demo.run import heldout_documents
from draftsmith.verify.evaluation.demo import DEMO_PROPOSERS, DEMO_TARGET, build_domains, trained_drafts
from draftsmith.verify.evaluation.evaluate import DomainFile, EvalConfig, evaluate

CHAINS = range(1, 7)
TREES = (2, 4, 8, 16, 24)
GRID_FAMILIES = ("demo_draft", "medusa", "eagle1", "eagle2", "eagle3", "mtp")
HEAD_OF = {"eagle2": "eagle1"}  # rows sharing a head share its grid


def grid_configs(name: str, shipped: dict) -> dict[str, dict]:
    """The fixed configs of one family's grid: chains of depth 1-6 and trees of 2-24 nodes (within what the head drafts)."""
    model, kind = shipped["model"], shipped["type"]
    if kind == "medusa":
        depth = json.loads((Path(model) / "config.json").read_text())["num_heads"]
        chains = {f"chain{d}": {"type": kind, "model": model, "tree": [[0] * i for i in range(1, d + 1)]} for d in range(1, depth + 1)}
        return chains | {f"tree{n}": {"type": kind, "model": model, "max_nodes": n} for n in TREES}
    if kind == "mtp":
        depth = json.loads((Path(model) / "config.json").read_text())["num_nextn_predict_layers"]
        chains = {f"chain{d}": {"type": kind, "model": model, "k": d} for d in range(1, depth + 1)}
        return chains | {f"tree{n}": {"type": kind, "model": model, "tree_width": 2, "max_nodes": n} for n in TREES}
    chains = {f"chain{d}": {"type": kind, "model": model, "k": d} for d in CHAINS}
    return chains | {f"tree{n}": {"type": kind, "model": model, "k": 6, "tree_width": 2, "max_nodes": max(n, 6)} for n in TREES}


class RandomDrafts(ProposerBase):
    """Five random tokens every step: a proposer made useless."""

    def __init__(self, target=None, seed: int = 0):
        self.rng = random.Random(seed)
        self.vocab_size = target.config.vocab_size if target is not None else 2048

    def draft_depth(self) -> int:
        return 5

    def begin(self, prompt, features):
        pass

    def observe(self, result, features):
        pass

    def propose(self, context: ProposeContext) -> Draft:
        depth = min(5, context.max_depth)
        return Draft.chain([self.rng.randrange(self.vocab_size) for _ in range(depth)], scores=[0.5] * depth)


class NoDrafts(RandomDrafts):
    """Never a draft (an empty one every step): plain decoding's work through a proposer's decoder, so its row is the noise floor."""

    def propose(self, context: ProposeContext) -> Draft:
        return Draft.empty()


def setup(args) -> tuple[Path, dict, dict]:
    """(target directory, domain files, shipped proposer configs), padded to ``--depth`` when given."""
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    written = build_domains(heldout_documents(DEMO_TARGET), out / "domains", args.prompts, 4 * 128, 6 * (1024 - args.new_tokens))
    domains = {name: written[name] for name in args.domains.split(",")}
    if "long" in domains:
        domains["long"] = DomainFile(domains["long"], prompt_tokens=1024 - args.new_tokens)
    if "mixed" in domains:
        domains["mixed"] = DomainFile(domains["mixed"], num_prompts=2 * args.prompts)
    shipped = {**DEMO_PROPOSERS, **trained_drafts(DEMO_TARGET)}
    if args.methods:
        wanted = args.methods.split(",")
        shipped = {name: config for name, config in shipped.items() if name in wanted or name in {HEAD_OF.get(w) for w in wanted}}
    if not args.depth:
        return DEMO_TARGET, domains, shipped
    return padded_target(DEMO_TARGET, args.depth, out), domains, padded_heads(shipped, args.depth, out)


def run_eval(args, target: Path, domains: dict, proposers: dict, fixed: list[str], tag: str) -> dict:
    config = EvalConfig(
        target=str(target),
        domains=domains,
        proposers=proposers,
        fixed_rows=fixed,
        peers=False,
        num_prompts=args.prompts,
        max_new_tokens=args.new_tokens,
        temperature=args.temperature,
        output_dir=str(Path(args.output) / tag),
        threads=1,
        plain_repeats=args.plain_repeats,
    )
    return {(row["domain"], row["method"]): row for row in evaluate(config, progress=False)["rows"]}


def part_demo(args, target, domains, shipped) -> list[dict]:
    rows = []
    for run in range(args.runs):
        for _key, row in run_eval(args, target, domains, shipped, [], f"demo_run{run}").items():
            rows.append({"run": run, **row})
    return rows


def part_grid(args, target, domains, shipped) -> list[dict]:
    rows = []
    for run in range(args.runs):
        for name in GRID_FAMILIES:
            if name not in shipped:
                continue
            grid = grid_configs(name, shipped[HEAD_OF.get(name, name)])
            proposers = {"adaptive": shipped[name], "shipped": shipped[name], **grid}
            result = run_eval(args, target, domains, proposers, [m for m in proposers if m != "adaptive"], f"grid_{name}_run{run}")
            rows += [{"run": run, "family": name, **row} for row in result.values()]
    return rows


def part_random(args, target, domains, shipped) -> list[dict]:
    REGISTRY["random_drafts"], REGISTRY["no_drafts"] = RandomDrafts, NoDrafts  # a benchmark's own proposers, by their type names
    proposers = {"random": {"type": "random_drafts"}, "no_draft": {"type": "no_drafts"}}
    rows = []
    for run in range(args.runs):
        rows += [{"run": run, **row} for row in run_eval(args, target, domains, proposers, [], f"random_run{run}").values()]
    return rows


def report_demo(rows: list[dict]) -> None:
    print("| domain | method | speedup per run | runs >= 0.97x | identical | nodes/step | plain steps | controller / plain step |")
    print("|---|---|---|---:|---|---:|---:|---:|")
    keys = list(dict.fromkeys((r["domain"], r["method"]) for r in rows if r["method"] != "plain"))
    plain_step = {(r["domain"], r["run"]): r["tokens_per_s"] for r in rows if r["method"] == "plain"}
    for domain, method in keys:
        mine = [r for r in rows if (r["domain"], r["method"]) == (domain, method)]
        speeds = [r["speedup"] for r in mine]
        share = statistics.median(
            (r["controller_time"] / max(r["steps"], 1)) * plain_step[(domain, r["run"])] for r in mine if r["controller_time"] is not None
        )  # seconds per step over a plain step's seconds (1 / plain tok/s)
        identical = ", ".join(r["identical"] or "-" for r in mine)
        print(
            f"| {domain} | {method} | {' / '.join(f'{s:.2f}' for s in speeds)} | {sum(s >= 0.97 for s in speeds)}/{len(speeds)} "
            f"| {identical} | {statistics.median(r['nodes_per_step'] or 0 for r in mine):.1f} "
            f"| {statistics.median(r['plain_share'] or 0 for r in mine):.0%} | {share:.1%} |"
        )


def report_grid(rows: list[dict]) -> None:
    """Per family and domain and run: the controller over the best fixed config, and over the shipped fixed config.

    The best of 13 noisy speeds, picked in the run it is compared in, is biased upwards (the
    winner's curse: about the noise floor). So the table also compares with the config that
    is best on the other runs (the median of its speedups there), measured in this run:
    a config chosen without this run's noise.
    """
    print(
        "| family | domain | controller / best fixed (best) per run | controller / best fixed on the other runs (config) per run "
        "| controller / shipped fixed per run | nodes/step | plain steps |"
    )
    print("|---|---|---|---|---|---:|---:|")
    counts = {"same run": [], "other runs": [], "shipped": []}
    for family in dict.fromkeys(r["family"] for r in rows):
        for domain in dict.fromkeys(r["domain"] for r in rows if r["family"] == family):
            tables = {}
            for run in sorted({r["run"] for r in rows}):
                table = {r["method"]: r for r in rows if (r["family"], r["domain"], r["run"]) == (family, domain, run)}
                if table:
                    tables[run] = table
            fixed = {run: {m: r["speedup"] for m, r in table.items() if m not in ("plain", "adaptive")} for run, table in tables.items()}
            cells_best, cells_held, cells_shipped, nodes, plain = [], [], [], [], []
            for run, table in tables.items():
                mine = table["adaptive"]["speedup"]
                best = max(fixed[run], key=fixed[run].get)
                others = [o for o in tables if o != run]
                held = max(fixed[run], key=lambda m: statistics.median(fixed[o][m] for o in others)) if others else best
                for label, config, cells in (("same run", best, cells_best), ("other runs", held, cells_held)):
                    counts[label].append(mine / fixed[run][config])
                    cells.append(f"{counts[label][-1]:.2f} ({config})")
                counts["shipped"].append(mine / fixed[run]["shipped"])
                cells_shipped.append(f"{counts['shipped'][-1]:.2f}")
                nodes.append(table["adaptive"]["nodes_per_step"] or 0)
                plain.append(table["adaptive"]["plain_share"] or 0)
            print(
                f"| {family} | {domain} | {' / '.join(cells_best)} | {' / '.join(cells_held)} | {' / '.join(cells_shipped)} "
                f"| {statistics.median(nodes):.1f} | {statistics.median(plain):.0%} |"
            )
    print()
    for label in ("same run", "other runs"):
        ratios = counts[label]
        if ratios:
            met = sum(r >= 0.95 for r in ratios)
            print(f"controller / best fixed ({label}): {met} of {len(ratios)} cells >= 0.95, median {statistics.median(ratios):.2f}")
    if counts["shipped"]:
        print(f"controller / shipped fixed: mean {statistics.mean(counts['shipped']):.2f} over {len(counts['shipped'])} cells")


def report_depths(labelled: dict[str, list[dict]]) -> None:
    """What the controller drafted per method on two or more demo runs (say 8 and 32 layers): every domain and run pooled.

    Per file: the mean draft nodes verified per step, and the share of steps that drafted at
    least 1, 2, 3, 4, 6 and 8 deep (``drafted_by_depth`` over the steps; at least 1 deep is
    every step that was not a plain one).
    """
    depths = (1, 2, 3, 4, 6, 8)
    print("| method | target | nodes/step | " + " | ".join(f">= {d} deep" for d in depths) + " |")
    print("|---|---|---:|" + "---:|" * len(depths))
    methods = dict.fromkeys(r["method"] for rows in labelled.values() for r in rows if r["method"] != "plain")
    for method in methods:
        for label, rows in labelled.items():
            mine = [r for r in rows if r["method"] == method]
            steps = sum(r["steps"] for r in mine)
            if not steps:
                continue
            nodes = sum(r["drafted_tokens"] for r in mine) / steps
            drafted = [sum(r["drafted_by_depth"][d - 1] if len(r["drafted_by_depth"]) >= d else 0 for r in mine) for d in depths]
            print(f"| {method} | {label} | {nodes:.2f} | " + " | ".join(f"{n / steps:.0%}" for n in drafted) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("demo", "grid", "random"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--domains", default=None, help="comma-separated demo domains (demo: all; grid: code,prose,long)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--plain-repeats", type=int, default=3, help="plain decoding's runs per prompt (its speed: their median)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--depth", type=int, default=0, help="pad the demo target to this many layers (0: as shipped)")
    parser.add_argument("--methods", default=None, help="comma-separated demo rows or grid families (default: all)")
    parser.add_argument("--output", default="outputs/bench/controller")
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", default=None, help="print the tables of an earlier --json file, and nothing else")
    parser.add_argument(
        "--depths", nargs="+", metavar="LABEL=FILE", default=None, help="compare what the controller drafted in demo runs' --json files"
    )
    args = parser.parse_args()
    if args.depths:
        items = {item: item.partition("=") for item in args.depths}
        bad = [item for item, (_, eq, file) in items.items() if not eq or not Path(file).is_file()]
        if bad:
            parser.error(f"--depths takes LABEL=FILE items naming demo runs' --json files, got {bad}")
        report_depths({label: json.loads(Path(file).read_text()) for label, _, file in items.values()})
        return
    if args.report:
        rows = json.loads(Path(args.report).read_text())
    elif args.part is None:
        parser.error("one of --part, --report or --depths is required")
    else:
        args.domains = args.domains or ("code,prose,long" if args.part == "grid" else "code,prose,copy,long,repeat,mixed")
        target, domains, shipped = setup(args)
        rows = {"demo": part_demo, "grid": part_grid, "random": part_random}[args.part](args, target, domains, shipped)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    (report_grid if rows and "family" in rows[0] else report_demo)(rows)


if __name__ == "__main__":
    main()
