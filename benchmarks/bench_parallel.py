"""Drafting every depth in one forward (DFlash, P-EAGLE) against EAGLE-3's sequential drafting, side by side, over several runs.

    python -m benchmarks.bench_parallel [--runs 3] [--domains code,prose] [--json FILE] [--report FILE]

Each run is one evaluation (prompt by prompt, every method in turn, against plain decoding)
of the demo's shipped rows (``eagle3``, ``dflash``, ``peagle``, ``suffix``: the speculation
controller deciding) and a grid of fixed configs of the three heads: EAGLE-3 chains of depth
3-6 and its shipped 16-node tree, DFlash chains of depth 3-7 and trees of 8 / 12 / 16
nodes, P-EAGLE chains of depth 3-5 and trees of 8 / 12 nodes. Per domain and run: the best
sequential (EAGLE-3) row and the best parallel row (DFlash or P-EAGLE) by median speedup
over plain decoding, their ratio, and for the rows that ran, tau, the acceptance per depth
(given the depth was reached) and the drafting milliseconds per step; and whether every
output was identical to plain decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.bench_controller import run_eval, setup

SEQUENTIAL = "eagle3"
PARALLEL = ("dflash", "peagle")


def grid(shipped: dict) -> tuple[dict[str, dict], list[str]]:
    """The proposers of one run (shipped rows and the fixed grid) and the names of the fixed ones."""
    proposers = {name: shipped[name] for name in (SEQUENTIAL, *PARALLEL, "suffix") if name in shipped}
    fixed = {}
    heads = {name: shipped[name]["model"] for name in (SEQUENTIAL, *PARALLEL) if name in shipped}
    for k in range(3, 7):
        fixed[f"eagle3_chain{k}"] = {"type": "eagle", "model": heads[SEQUENTIAL], "k": k}
    fixed["eagle3_tree16"] = {"type": "eagle", "model": heads[SEQUENTIAL], "k": 6, "tree_width": 2, "max_nodes": 16}
    if "dflash" in heads:
        for k in range(3, 8):
            fixed[f"dflash_chain{k}"] = {"type": "dflash", "model": heads["dflash"], "k": k}
        for n in (8, 12, 16):
            fixed[f"dflash_tree{n}"] = {"type": "dflash", "model": heads["dflash"], "tree_width": 2, "max_nodes": n}
    if "peagle" in heads:
        for k in range(3, 6):
            fixed[f"peagle_chain{k}"] = {"type": "eagle", "model": heads["peagle"], "k": k}
        for n in (8, 12):
            fixed[f"peagle_tree{n}"] = {"type": "eagle", "model": heads["peagle"], "k": 5, "tree_width": 2, "max_nodes": n}
    return proposers | fixed, list(fixed)


def family(method: str) -> str:
    return method.split("_")[0]


def report(rows: list[dict]) -> None:
    print("| domain | run | best sequential (speedup) | best parallel (speedup) | parallel / sequential | suffix | identical |")
    print("|---|---:|---|---|---:|---:|---|")
    for domain in dict.fromkeys(r["domain"] for r in rows):
        for run in sorted({r["run"] for r in rows}):
            table = {r["method"]: r for r in rows if (r["domain"], r["run"]) == (domain, run)}
            sequential = {m: r["speedup"] for m, r in table.items() if family(m) == SEQUENTIAL}
            parallel = {m: r["speedup"] for m, r in table.items() if family(m) in PARALLEL}
            if not sequential or not parallel:
                continue
            best_s, best_p = max(sequential, key=sequential.get), max(parallel, key=parallel.get)
            identical = all(r["identical"] is None or r["identical"].split("/")[0] == r["identical"].split("/")[1] for r in table.values())
            suffix = f"{table['suffix']['speedup']:.2f}x" if "suffix" in table else "-"
            print(
                f"| {domain} | {run} | {best_s} ({sequential[best_s]:.2f}x) | {best_p} ({parallel[best_p]:.2f}x) "
                f"| {parallel[best_p] / sequential[best_s]:.2f} | {suffix} | {'yes' if identical else 'NO'} |"
            )
    print()
    print("| domain | method | speedup per run | tau | acceptance by depth (given reached) | draft ms / step | nodes / step |")
    print("|---|---|---|---:|---|---:|---:|")
    for domain in dict.fromkeys(r["domain"] for r in rows):
        for method in dict.fromkeys(r["method"] for r in rows if r["domain"] == domain and r["method"] != "plain"):
            mine = [r for r in rows if (r["domain"], r["method"]) == (domain, method)]
            accept = mine[0]["acceptance_by_depth"]["given_reached"] if mine[0]["acceptance_by_depth"] else []
            speeds = " / ".join(f"{r['speedup']:.2f}" for r in mine)
            print(
                f"| {domain} | {method} | {speeds} "
                f"| {statistics.median(r['tau'] for r in mine):.2f} "
                f"| {' '.join('-' if a is None else f'{a:.2f}' for a in accept[:8])} "
                f"| {statistics.median(r['draft_ms_per_step'] or 0 for r in mine):.2f} "
                f"| {statistics.median(r['nodes_per_step'] or 0 for r in mine):.1f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--domains", default="code,prose")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--output", default="outputs/bench/parallel")
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", default=None, help="print the tables of an earlier --json file, and nothing else")
    args = parser.parse_args()
    if args.report:
        rows = json.loads(Path(args.report).read_text())
    else:
        args.temperature, args.depth, args.methods = 0.0, 0, None
        target, domains, shipped = setup(args)
        rows = []
        for run in range(args.runs):
            proposers, fixed = grid(shipped)
            result = run_eval(args, target, domains, proposers, fixed, f"run{run}")
            rows += [{"run": run, **row} for row in result.values()]
            if args.json:  # written after every run: an interrupted benchmark keeps what it measured
                Path(args.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    report(rows)


if __name__ == "__main__":
    main()
