"""The demo several times over: its table with every row's speedup in each run, and how far the runs spread.

    python -m benchmarks.bench_demo [--runs 3] [--output outputs/bench/demo] [--json FILE] [--report FILE]

Each run is ``draftsmith demo`` as a user runs it (the shipped target, every row, the
controller deciding), into ``OUTPUT/run{i}``. The table gives per domain and method the
median tau over the runs, the median speedup of each run and their spread (max - min), the
share of plain steps and whether every output was identical to plain decoding in every run;
the last line, the spread's median and maximum over the rows that draft.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from draftsmith.training.demo.run import run_demo


def report(runs: list[list[dict]]) -> None:
    keys = list(dict.fromkeys((r["domain"], r["method"]) for rows in runs for r in rows))
    table = [{(r["domain"], r["method"]): r for r in rows} for rows in runs]
    print("| domain | method | tau | speedup per run | spread | plain steps | identical |")
    print("|---|---|---:|---|---:|---:|---|")
    spreads = []
    for key in keys:
        mine = [t[key] for t in table if key in t]
        speeds = [r["speedup"] for r in mine]
        spread = max(speeds) - min(speeds)
        if key[1] != "plain":
            spreads.append(spread)
        identical = "yes" if all(r["identical"] is None or len(set(r["identical"].split("/"))) == 1 for r in mine) else "NO"
        plain = statistics.median(r["plain_share"] or 0 for r in mine) if mine[0]["plain_share"] is not None else None
        print(
            f"| {key[0]} | {key[1]} | {statistics.median(r['tau'] for r in mine):.2f} | {' / '.join(f'{s:.2f}x' for s in speeds)} "
            f"| {spread:.2f} | {'-' if plain is None else f'{plain:.0%}'} | {identical} |"
        )
    print(f"\nspread of a row's speedup over the runs: median {statistics.median(spreads):.2f}, max {max(spreads):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", default="outputs/bench/demo")
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", default=None, help="print the table of an earlier --json file, and nothing else")
    args = parser.parse_args()
    if args.report:
        runs = json.loads(Path(args.report).read_text())
    else:
        runs = []
        for run in range(args.runs):
            runs.append(run_demo(output_dir=str(Path(args.output) / f"run{run}"))["rows"])
            if args.json:  # after every run: an interrupted benchmark keeps what it measured
                Path(args.json).write_text(json.dumps(runs, indent=1, default=str) + "\n")
    report(runs)


if __name__ == "__main__":
    main()
