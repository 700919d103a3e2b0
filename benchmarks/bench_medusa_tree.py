"""Medusa trees: the calibrated tree against fixed Cartesian top-k trees of the same node budget.

Greedy, the same target and heads, the same prompts. For each node budget B, the trees are
  calibrated   grown from the heads' held-out top-i accuracies (``calibration.json``) to B nodes
  cart_k{w}    every path of the heads' top-w guesses, breadth first, cut to B nodes
For each tree and domain: tau (tokens per target forward over all prompts), outputs
token-identical to plain decoding, and the median speedup over plain decoding, timed
interleaved prompt by prompt.

    python -m benchmarks.bench_medusa_tree [--target recipes/models/demo_target] [--heads recipes/models/demo_medusa]
        [--domains outputs/demo/domains/code.jsonl outputs/demo/domains/prose.jsonl outputs/demo/domains/copy.jsonl]
        [--budgets 8 16 32] [--widths 2 3 4] [--prompts 8] [--prompt-tokens 128] [--new-tokens 64] [--threads 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.harness import run_interleaved
from draftsmith.proposers.core.static_tree import cartesian_paths
from draftsmith.proposers.medusa import MedusaProposer
from draftsmith.verify import SpeculativeDecoder, load_target
from draftsmith.verify.evaluation.domains import load_domain


def runner(decoder: SpeculativeDecoder, n: int):
    """fn(ids) -> a thunk that decodes ``n`` tokens and returns them (``harness.run_interleaved``'s runner)."""
    return lambda ids: lambda: decoder.generate(ids, max_new_tokens=n).new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="recipes/models/demo_target")
    parser.add_argument("--heads", default="recipes/models/demo_medusa")
    parser.add_argument("--domains", nargs="+", default=[f"outputs/demo/domains/{d}.jsonl" for d in ("code", "prose", "copy")])
    parser.add_argument("--budgets", nargs="+", type=int, default=[8, 16, 32])
    parser.add_argument("--widths", nargs="+", type=int, default=[2, 3, 4])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per domain")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tokenizer = load_target(args.target)
    positions = target.config.max_position_embeddings
    plain = SpeculativeDecoder(target)
    n = args.new_tokens
    results = []
    for budget in args.budgets:
        trees = {"calibrated": MedusaProposer(args.heads, max_nodes=budget, target=target)}
        for width in args.widths:
            paths = cartesian_paths(width, trees["calibrated"].heads.num_heads, budget)
            trees[f"cart_k{width}"] = MedusaProposer(args.heads, tree=[list(p) for p in paths], target=target)
        decoders = {name: SpeculativeDecoder(target, proposer) for name, proposer in trees.items()}
        for path in map(Path, args.domains):
            prompts = [p.input_ids for p in load_domain(path.stem, path, tokenizer, args.prompts, args.prompt_tokens, positions)]
            runners = {name: runner(decoder, n) for name, decoder in {"plain": plain, **decoders}.items()}
            speed, identical = run_interleaved(runners, prompts)
            for name, decoder in decoders.items():
                stats = [decoder.generate(ids, max_new_tokens=n).stats for ids in prompts]
                tau = sum(s.new_tokens for s in stats) / sum(s.target_forwards for s in stats)
                row = {
                    "budget": budget,
                    "tree": name,
                    "nodes": trees[name].tree.num_nodes,
                    "domain": path.stem,
                    "tau": round(tau, 3),
                    "speedup": round(speed[name] / speed["plain"], 3),
                    "identical": f"{identical[name]}/{len(prompts)}",
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    print("\n| budget | tree | nodes | " + " | ".join(f"{Path(d).stem} tau (speedup)" for d in args.domains) + " |")
    print("|---|---|---|" + "---|" * len(args.domains))
    for budget in args.budgets:
        for name in ["calibrated"] + [f"cart_k{w}" for w in args.widths]:
            rows = [r for r in results if r["budget"] == budget and r["tree"] == name]
            cells = " | ".join(f"{r['tau']:.2f} ({r['speedup']:.2f}x)" for r in rows)
            print(f"| {budget} | {name} | {rows[0]['nodes']} | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
