"""This tree's speculation controller against another revision's (or other settings), interleaved on the demo's prompts.

    python -m benchmarks.bench_controller_ab --baseline REV [--methods eagle1,eagle2,eagle3] [--domains code,prose]
        [--prompts 16] [--repeats 2] [--baseline-kwargs explore_every=16] [--kwargs ...] [--depth 32] [--json FILE]

A change of policy worth 1-2% is lost between two runs of ``bench_controller`` (a request's
time moves 12-19% from run to run on this VM), so both controllers decode the same prompts in
one process: per method and domain, a decoder with this tree's ``Controller`` and one with
``--baseline``'s (``verify/`` as that revision has it: ``bench_controller_cost.baseline_module``;
``--baseline HEAD`` with ``--baseline-kwargs`` compares settings of one revision), each
request timed between two plain decodings of the same prompt (its speedup: their mean over
its time), the two controllers' order alternating prompt by prompt. Each controller lives
across its domain's requests, as in an evaluation. Per cell: each controller's median
speedup and the median of the per-request ratios (this tree over the baseline); at the foot
their median and mean over the cells, and how many cells reach 1.0. One thread, the shipped
demo target (``--depth``: padded as ``bench_controller`` pads it), 64 new tokens, the domains and
prompts ``bench_controller`` builds (its ``setup``) and the evaluation loads (128 tokens; 960 on ``long``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.bench_controller import setup
from benchmarks.bench_controller_cost import baseline_module
from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.config import apply_overrides, build
from draftsmith.proposers.core.errors import ConfigError
from draftsmith.verify import SpeculativeDecoder, load_target
from draftsmith.verify import controller as current
from draftsmith.verify.evaluation.demo import DEMO_PROPOSERS, DEMO_TARGET, trained_drafts
from draftsmith.verify.evaluation.evaluate import load_prompts

NEW_TOKENS = 64


def settings(text: str) -> dict[str, float | int]:
    """``name=value,...`` as keyword arguments of ``Controller`` (numbers only): ``explore_every=16,decay=0.9``.

    Parsed as the CLI's ``key=value`` overrides are (``proposers.core.config.apply_overrides``).
    """
    try:
        values = apply_overrides({}, [item for item in text.split(",") if item])
    except ConfigError as error:
        raise SystemExit(f"--kwargs / --baseline-kwargs: {error}") from None
    bad = [f"{name}={value}" for name, value in values.items() if isinstance(value, bool) or not isinstance(value, (int, float))]
    if bad:
        raise SystemExit(f"--kwargs / --baseline-kwargs: {bad} not name=number")
    return values


def checked(cls, kwargs: dict, flag: str) -> tuple[type, dict]:
    """``(cls, kwargs)`` where ``kwargs`` are settings of ``cls`` (a revision's ``Controller``) of the types it takes, else an
    error naming them: checked as a config's keys are (``proposers.core.config.build``), by building one."""
    try:
        build(cls, kwargs, flag, inject={"max_depth": None, "max_width": 1})
    except ConfigError as error:
        raise SystemExit(str(error)) from None
    return cls, kwargs


def cell(target, tokenizer, config: dict, prompts: list[torch.Tensor], controllers: dict, repeats: int) -> dict[str, list[float]]:
    """Per controller (name -> (class, kwargs)), every request's speedup over the plain decodings around it."""
    plain = SpeculativeDecoder(target, threads=1)
    decoders = {}
    for name, (cls, kwargs) in controllers.items():
        proposer = load_proposer(config, target=target, tokenizer=tokenizer)
        made = cls(proposer.draft_depth(), proposer.draft_width(), **kwargs)
        decoders[name] = SpeculativeDecoder(target, proposer, controller=made, threads=1)
    for decoder in (plain, *decoders.values()):
        decoder.warm_up(prompts[0].shape[1])
        decoder.reset()
    speedups: dict[str, list[float]] = {name: [] for name in decoders}
    order = list(decoders.items())
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            for name, decoder in order if (index + repeat) % 2 else order[::-1]:
                seconds = []
                for run in (plain, decoder, plain):
                    tick = time.perf_counter()
                    run.generate(prompt, max_new_tokens=NEW_TOKENS)
                    seconds.append(time.perf_counter() - tick)
                speedups[name].append((seconds[0] + seconds[2]) / 2 / seconds[1])
    return speedups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the git revision whose controller to compare with (HEAD with --baseline-kwargs)")
    parser.add_argument("--methods", default="eagle1,eagle2,eagle3")
    parser.add_argument("--domains", default="code,prose")
    parser.add_argument("--prompts", type=int, default=16, help="per domain")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kwargs", default="", help="this tree's Controller keyword arguments, name=number,...")
    parser.add_argument("--baseline-kwargs", default="", help="the baseline's, the same way")
    parser.add_argument("--depth", type=int, default=0, help="pad the demo target to this many layers (0: as shipped)")
    parser.add_argument("--output", default="outputs/bench/controller_ab", help="its domain files (and padded target)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.new_tokens = NEW_TOKENS
    torch.set_num_threads(1)
    try:
        path, domains, configs = setup(args)  # ``bench_controller``'s domain files and shipped configs
    except KeyError as missing:
        raise SystemExit(f"--domains: {missing} is not a demo domain (code, prose, copy, long, repeat, mixed, chat)") from None
    unknown = [m for m in args.methods.split(",") if m not in configs]
    if unknown:
        known = sorted({**DEMO_PROPOSERS, **trained_drafts(DEMO_TARGET)})
        raise SystemExit(f"--methods: {unknown} not among the demo's methods {known}")
    target, tokenizer = load_target(path)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        old = baseline_module(args.baseline, Path(folder))
        controllers = {
            "this": checked(current.Controller, settings(args.kwargs), "--kwargs"),
            "baseline": checked(old.Controller, settings(args.baseline_kwargs), "--baseline-kwargs"),
        }
        print(f"| method | domain | this tree | {args.baseline} {args.baseline_kwargs} | this / baseline |")
        print("|---|---|---:|---:|---:|")
        prompts_of = {}  # each domain's prompts, as an evaluation loads them, once for every method
        for domain, file in domains.items():
            wanted = SimpleNamespace(domains={domain: file}, num_prompts=args.prompts, prompt_tokens=128, max_new_tokens=NEW_TOKENS)
            prompts_of[domain] = [prompt.input_ids for prompt in load_prompts(wanted, target, tokenizer)]
        for method in args.methods.split(","):
            for domain, prompts in prompts_of.items():
                speedups = cell(target, tokenizer, configs[method], prompts, controllers, args.repeats)
                ratio = statistics.median(a / b for a, b in zip(speedups["this"], speedups["baseline"], strict=True))
                this, base = (statistics.median(speedups[k]) for k in ("this", "baseline"))
                rows.append({"method": method, "domain": domain, "this": this, "baseline": base, "ratio": ratio, "speedups": speedups})
                print(f"| {method} | {domain} | {this:.3f} | {base:.3f} | {ratio:.3f} |", flush=True)
    ratios = [row["ratio"] for row in rows]
    print(f"\nthis / baseline over {len(rows)} cells: median {statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}, "
          f"{sum(r >= 1.0 for r in ratios)} at 1.0 or more")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
