"""The speculation controller's policy on a simulated clock: a fresh controller against plain decoding and fixed chains.

    python -m benchmarks.bench_controller_sim [--seeds 40] [--requests 1,8] [--baseline REV] [--json FILE]

The demo benchmarks time the controller on this machine, where one request's time is off by
12-19% from one run to the next: a change of policy that moves a row by 2% is lost in them.
This one takes the machine out. Every step's seconds come from a cost model shaped like the
demo's on this CPU (a plain step costs 1; drafting a chain 0.28 for its first level and 0.2
for each next; verifying n nodes adds 0.16, 0.23, 0.25, 0.32, 0.42, 0.5 for n = 1..6; a
request's first step takes 1.1 times as long, as the demo target's first forward after its
prefill does; every step's time is multiplied by lognormal(0, 0.1) noise), and each node of
a chain is accepted with its depth's chance given its parent was (the scenario's). Per
scenario and seed, a fresh controller (``Controller(6)``) decodes R requests of 64 tokens,
and so do plain decoding and fixed chains of depth 1-6, with the same seed. The table gives,
per scenario and R, the config best over the seeds' mean and the controller's rate over that
config's, seed by seed: the median, the mean, the least, and the seeds below 0.9 (a fresh
controller that settled badly). ``--baseline REV`` runs the controller of an earlier revision
beside it (its ``verify`` modules, as ``bench_controller_cost`` loads them), on the same seeds.

Left out on purpose: drafts carry no confidence (every node scores 0.5, so the calibration
learns per depth only), drafting after plain steps catches nothing up, and the text does not
change inside a request (the ``switching`` scenario changes it between requests). What it
shows is the policy's own cost against the best fixed choice: its plain steps that measure a
plain step, its exploring, its cold start.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from benchmarks.bench_controller_cost import baseline_module
from draftsmith.proposers.core.types import Draft, VerifyResult
from draftsmith.verify import controller as current

PROMPT, TOKENS, DEPTH = 128, 64, 6
ROWS = (0.0, 0.16, 0.23, 0.25, 0.32, 0.42, 0.5)  # what verifying n nodes adds to a plain step (n = 0..6)
NOISE = 0.1  # every step's seconds times lognormal(0, NOISE)
FIRST_STEP = 1.1  # a request's first step takes this much longer (the demo target's first forward after prefill: median 1.11x)
SCENARIOS = {  # per request: each depth's chance to be accepted given its parent was
    "eagle_code": lambda request: (0.76, 0.73, 0.83, 0.68, 0.79, 0.88),  # EAGLE-1 on the demo's code (c25, a fixed chain of 6)
    "easy": lambda request: (0.9,) * DEPTH,
    "hard": lambda request: (0.6, 0.5, 0.5, 0.4, 0.4, 0.4),
    "marginal": lambda request: (0.3,) * DEPTH,  # a chain of 1 about breaks even
    "useless": lambda request: (0.0,) * DEPTH,
    "switching": lambda request: (0.9,) * DEPTH if request % 2 == 0 else (0.3,) * DEPTH,
}


def costs(depth: int, nodes: int) -> tuple[float, float]:
    """(drafting, the rest of the step) in plain steps for a chain planned ``depth`` deep that verifies ``nodes`` nodes."""
    return (0.28 + 0.2 * (depth - 1) if depth else 0.0), 1.0 + ROWS[nodes]


def decode(scenario, seed: int, requests: int, fixed: int | None = None, module=current) -> float:
    """Tokens per plain step's time over ``requests`` requests: a fresh controller of ``module``, or a fixed chain of ``fixed``
    nodes (0: plain decoding)."""
    rng = random.Random(seed)
    controller = module.Controller(DEPTH) if fixed is None else None
    seconds = tokens = 0.0
    for request in range(requests):
        chances = scenario(request)
        if controller is not None:
            controller.start()
        context, done = PROMPT, 0
        while done < TOKENS:
            room = TOKENS - done - 1  # the deepest draft the request leaves room for (the decoder's ``max_depth``)
            if controller is not None:  # as the decoder asks: no plan where no draft fits
                plan = controller.plan(context, room) if room >= 1 else module.Controller.PLAIN
                depth = plan.depth
            else:
                depth = max(min(fixed, room), 0)
            draft = Draft.chain(list(range(depth)), scores=[0.5] * depth) if depth else Draft.empty()
            if controller is not None and depth and plan.trims:
                draft, _ = controller.trim(draft, context, True)
            accepted, token = 0, -1  # the next token: the target's choice after the accepted path (-1: no draft token)
            while accepted < draft.num_nodes and rng.random() < chances[accepted]:
                accepted += 1
            if accepted == draft.num_nodes < depth and rng.random() < chances[accepted]:
                token = accepted  # the first node a trim cut (a chain's tokens are 0, 1, ...) is the target's choice
            noise = rng.lognormvariate(0.0, NOISE) * (FIRST_STEP if done == 0 else 1.0)
            drafting, rest = (noise * part for part in costs(depth, draft.num_nodes))
            if controller is not None:
                result = VerifyResult(list(range(accepted)), list(range(accepted)), token, accepted < draft.num_nodes)
                controller.observe(plan, draft, result, context, drafting, drafting + rest, True)
            seconds, tokens = seconds + drafting + rest, tokens + accepted + 1
            context, done = context + accepted + 1, done + accepted + 1
    return tokens / seconds


def compare(name: str, requests: int, seeds: int, modules: dict) -> dict:
    """One scenario at ``requests`` requests: the best fixed config, and each controller's rate over it, seed by seed."""
    scenario = SCENARIOS[name]
    fixed = {depth: [decode(scenario, seed, requests, depth) for seed in range(seeds)] for depth in range(DEPTH + 1)}
    best = max(fixed, key=lambda depth: statistics.mean(fixed[depth]))
    row = {"scenario": name, "requests": requests, "best": "plain" if best == 0 else f"chain{best}",
           "best_rate": statistics.mean(fixed[best])}  # fmt: skip
    for label, module in modules.items():
        ratios = [decode(scenario, seed, requests, None, module) / fixed[best][seed] for seed in range(seeds)]
        row[label] = {"median": statistics.median(ratios), "mean": statistics.mean(ratios), "least": min(ratios),
                      "below_0.9": sum(ratio < 0.9 for ratio in ratios)}  # fmt: skip
    return row


def table(rows: list[dict], labels: list[str]) -> str:
    head = "| scenario | requests | best fixed (rate) | " + " | ".join(f"{label}: median / mean / least, < 0.9" for label in labels) + " |"
    lines = [head, "|---|---:|---|" + "---|" * len(labels)]
    for row in rows:
        cells = [f"{r['median']:.3f} / {r['mean']:.3f} / {r['least']:.2f}, {r['below_0.9']}" for r in (row[label] for label in labels)]
        lines.append(f"| {row['scenario']} | {row['requests']} | {row['best']} ({row['best_rate']:.2f}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--requests", default="1,8", help="comma-separated requests per fresh controller")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--baseline", default=None, help="a revision whose controller runs beside this tree's")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    names = args.scenarios.split(",")
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; known: {', '.join(SCENARIOS)}")
    try:
        counts = [int(count) for count in args.requests.split(",")]
    except ValueError:
        parser.error(f"--requests takes comma-separated positive integers, got {args.requests!r}")
    if args.seeds < 1 or any(count < 1 for count in counts):
        parser.error(f"--seeds and --requests must be >= 1, got {args.seeds} and {args.requests!r}")
    with tempfile.TemporaryDirectory() as folder:
        modules = {"controller": current}
        if args.baseline:
            modules[f"at {args.baseline}"] = baseline_module(args.baseline, Path(folder))
        rows = [compare(name, count, args.seeds, modules) for name in names for count in counts]
    print(table(rows, list(modules)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
