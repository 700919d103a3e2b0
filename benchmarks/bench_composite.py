"""Composites against their members on the demo's ``mixed`` domain, over repeated runs.

``mixed`` interleaves code, prose and repeat requests (sub-domains ``mixed/code``,
``mixed/prose``, ``mixed/repeat``). Each run is one ``draftsmith eval`` of plain decoding,
the members and the composites on those prompts (fresh proposers, so the suffix store
starts empty every run), interleaved prompt by prompt. Per sub-domain and method: tau, and
the speedup's median over runs with its range; per composite, its margin over its best
member (the member with the highest median speedup) in each run. The spread of the
members' own speedups over runs is the noise the margins are read against.

    python -m benchmarks.bench_composite [--runs 3] [--prompts 8] [--output outputs/composite] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from draftsmith.training.demo.run import heldout_documents
from draftsmith.verify.evaluation.demo import DEMO_PROPOSERS, build_domains, trained_drafts
from draftsmith.verify.evaluation.evaluate import DomainFile, EvalConfig, evaluate

MEMBERS = {"suffix+draft": ("suffix", "demo_draft"), "suffix+ngram": ("suffix", "ngram")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="recipes/models/demo_target")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--output", default="outputs/composite")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    target = Path(args.target)
    paths = build_domains(heldout_documents(target), Path(args.output) / "domains", args.prompts, 4 * 128)
    shipped = trained_drafts(target)
    proposers = {name: DEMO_PROPOSERS[name] for name in ("ngram", "suffix", "suffix+ngram")}
    proposers |= {name: shipped[name] for name in ("demo_draft", "suffix+draft")}
    runs = []
    for run in range(args.runs):
        config = EvalConfig(
            target=args.target,
            domains={"mixed": DomainFile(paths["mixed"], num_prompts=2 * args.prompts)},
            proposers=proposers,
            peers=False,
            num_prompts=args.prompts,
            output_dir=f"{args.output}/run{run}",
            threads=1,
        )
        runs.append({(r["domain"], r["method"]): r for r in evaluate(config)["rows"]})
    report = {}
    for domain in sorted({d for d, _ in runs[0]}):
        print(f"\n{domain}")
        speed = {m: [run[(domain, m)]["speedup"] for run in runs] for d, m in runs[0] if d == domain}
        for method, values in speed.items():
            tau = runs[0][(domain, method)]["tau"]
            print(
                f"  {method:14s} tau {tau:.2f}  speedup median {statistics.median(values):.2f}  range {min(values):.2f}-{max(values):.2f}"
            )
        for composite, members in MEMBERS.items():
            best = max(members, key=lambda m: statistics.median(speed[m]))
            margins = [c - b for c, b in zip(speed[composite], speed[best], strict=True)]
            print(f"  {composite} - {best}: {' '.join(f'{m:+.2f}' for m in margins)} (median {statistics.median(margins):+.2f})")
            report[f"{domain} {composite}"] = {"best_member": best, "margins": margins, "speedups": speed}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
