"""How far the controller's plan-time estimates are from what its steps delivered, per planned depth and shape.

    python -m benchmarks.bench_controller_estimates [--methods eagle2,eagle3] [--domains code,prose] [--prompts 12]
        [--baseline REV] [--min-steps 15] [--json FILE]

A plan picks the depth and shape with the best expected tokens per second; where its expected
tokens run above what such steps deliver, it drafts deeper than pays, and the error grows with
how often that depth is picked (a choice made where the estimate is high is measured where it
was high). Per method and domain, this decodes the demo's prompts (as ``bench_controller_cost``
builds them: 128 tokens, 64 new) with a controller of this tree and, given ``--baseline``, one
of that revision beside it, alternating prompt by prompt, and records at each drafted step that
is not a probe or an exploring step the plan's expected tokens (one plus its shape's shares up
to its depth) and seconds (its price at the machine's speed then), and the tokens the step
committed and the seconds it took. Per controller, method and (depth, shape) planned at least
``--min-steps`` times: the steps, the mean expected and delivered tokens and their ratio, the
mean expected and measured milliseconds. No timing is compared between controllers: the ratios
are each controller's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.bench_controller_cost import baseline_module, demo_prompts
from draftsmith.proposers import load_proposer
from draftsmith.training.demo.run import heldout_documents
from draftsmith.verify import SpeculativeDecoder, load_target
from draftsmith.verify import controller as current
from draftsmith.verify.evaluation.demo import DEMO_PROPOSERS, DEMO_TARGET, build_domains, trained_drafts


def recording(module) -> type:
    """``module``'s ``Controller``, recording (depth, shape, expected tokens, expected seconds, tokens, seconds) per planned step."""

    class Recording(module.Controller):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.log, self._expected = [], None

        def plan(self, context, room):
            plan = super().plan(context, room)
            self._expected = None
            if plan.depth and plan.trims and self._estimates is not None:  # a planned step, not a probe or an exploring one
                shares, costs = self._estimates[plan.shape]
                if costs[plan.depth] is not None:
                    self._expected = (1.0 + sum(shares[1 : plan.depth + 1]), costs[plan.depth] * self.speed.factor)
            return plan

        def observe(self, plan, draft, result, context, draft_seconds, step_seconds, greedy):
            if self._expected is not None:
                self.log.append((plan.depth, plan.shape, *self._expected, len(result.accepted_nodes) + 1, step_seconds))
                self._expected = None
            return super().observe(plan, draft, result, context, draft_seconds, step_seconds, greedy)

    return Recording


def table(log: list[tuple], min_steps: int) -> list[dict]:
    """Per (depth, shape) planned at least ``min_steps`` times: steps, expected and delivered tokens, expected and measured ms."""
    groups = defaultdict(list)
    for depth, shape, expected, priced, tokens, seconds in log:
        groups[depth, shape].append((expected, priced, tokens, seconds))
    rows = []
    for (depth, shape), steps in sorted(groups.items()):
        if len(steps) >= min_steps:
            expected, priced, tokens, seconds = (statistics.mean(column) for column in zip(*steps, strict=True))
            rows.append({"depth": depth, "shape": shape, "steps": len(steps), "expected_tokens": expected, "tokens": tokens,
                         "expected_ms": 1000 * priced, "ms": 1000 * seconds})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="eagle2,eagle3")
    parser.add_argument("--domains", default="code,prose")
    parser.add_argument("--prompts", type=int, default=12, help="per domain")
    parser.add_argument("--baseline", default=None, help="a revision whose controller decodes beside this tree's")
    parser.add_argument("--min-steps", type=int, default=15, help="the fewest steps a (depth, shape) row needs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.prompts < 1 or args.min_steps < 1:
        parser.error(f"--prompts and --min-steps must be >= 1, got {args.prompts} and {args.min_steps}")
    torch.set_num_threads(1)
    target, tokenizer = load_target(DEMO_TARGET)
    configs = {**DEMO_PROPOSERS, **trained_drafts(DEMO_TARGET)}
    unknown = [name for name in args.methods.split(",") if name not in configs]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(configs)}")
    results = []
    with tempfile.TemporaryDirectory() as folder:
        written = build_domains(heldout_documents(DEMO_TARGET), Path(folder) / "domains", args.prompts, 4 * 128, 6 * 960)
        modules = {"this tree": current} | ({args.baseline: baseline_module(args.baseline, Path(folder))} if args.baseline else {})
        print("| controller | method | domain | depth | shape | steps | expected tokens | delivered | ratio | expected ms | ms |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for method in args.methods.split(","):
            for domain in args.domains.split(","):
                prompts = demo_prompts(tokenizer, written[domain], args.prompts)
                decoders = {}
                for label, module in modules.items():
                    proposer = load_proposer(configs[method], target=target, tokenizer=tokenizer)
                    controller = recording(module)(proposer.draft_depth(), proposer.draft_width())
                    decoders[label] = SpeculativeDecoder(target, proposer, controller=controller)
                for index, prompt in enumerate(prompts):
                    order = list(decoders) if index % 2 == 0 else list(decoders)[::-1]
                    for label in order:
                        decoders[label].generate(prompt, max_new_tokens=64)
                for label, decoder in decoders.items():
                    for row in table(decoder.controller.log, args.min_steps):
                        results.append({"controller": label, "method": method, "domain": domain, **row})
                        print(f"| {label} | {method} | {domain} | {row['depth']} | {row['shape']} | {row['steps']} "
                              f"| {row['expected_tokens']:.2f} | {row['tokens']:.2f} | {row['expected_tokens'] / row['tokens']:.2f} "
                              f"| {row['expected_ms']:.2f} | {row['ms']:.2f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
