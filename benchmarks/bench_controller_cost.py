"""The speculation controller's own work per step, replayed: this tree's code against an earlier revision's, on the same calls.

    python -m benchmarks.bench_controller_cost --baseline REV [--methods suffix,eagle3] [--domains code,prose,copy] [--prompts 4]

Decodes a few demo prompts (by default code, prose and copy; 64 new tokens) with each method's shipped
config and records every call the decoder makes to its controller (``start``, ``plan``,
``trim``, ``observe``, with their arguments: the drafts, the verification results, the
timings). Then replays those calls on fresh controllers of this tree and of ``--baseline``
(``verify/controller.py`` and the modules beside it as that revision has them), alternating,
and prints the median microseconds per step of each, their ratio, and whether both planned
and trimmed alike. The replay times the controller alone (no model, no proposer), so the
machine's noise in a decoding run is out of it; the decisions a replay makes are its own,
while the drafts and outcomes it observes are the recording's. Whether both decide alike is
read from one more replay of each with the controller's clock stopped (``frozen_decisions``):
a plain step's price leaves out the estimates' recomputation as the controller times it, so
timed replays of the same code may plan apart now and then.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import astuple, fields
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

from draftsmith.proposers import load_proposer
from draftsmith.training.demo.run import heldout_documents
from draftsmith.verify import SpeculativeDecoder, load_target
from draftsmith.verify import controller as current
from draftsmith.verify.evaluation.demo import DEMO_PROPOSERS, DEMO_TARGET, build_domains, trained_drafts

CALLS = ("start", "plan", "trim", "observe")


def baseline_module(revision: str, folder: Path) -> ModuleType:
    """``verify/controller.py`` at ``revision`` (and the modules beside it that it imports), importable beside this tree's."""
    package = folder / "baseline_verify"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("controller.py", "estimates.py", "probes.py", "calibration.py", "learning.py"):  # the last three: split out later
        shown = subprocess.run(["git", "show", f"{revision}:verify/{name}"], capture_output=True, text=True)
        if shown.returncode == 0:
            (package / name).write_text(shown.stdout)
        elif name in ("controller.py", "estimates.py"):
            raise SystemExit(f"--baseline {revision}: no verify/{name} there ({shown.stderr.strip()})")
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("baseline_verify.controller", package / "controller.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def demo_prompts(tokenizer, path: str | Path, count: int) -> list[torch.Tensor]:
    """The first ``count`` prompts of a demo domain file (``build_domains``), tokenized, their last 128 tokens each."""
    lines = Path(path).read_text().splitlines()[:count]
    return [tokenizer(json.loads(line)["prompt"], return_tensors="pt").input_ids[:, -128:] for line in lines]


def record(target, tokenizer, config: dict, prompts: list[torch.Tensor]) -> tuple[tuple[int, int], list[tuple[str, tuple]]]:
    """(the controller's constructor arguments, every call the decoder made to it) over ``prompts``."""
    calls: list[tuple[str, tuple]] = []

    class Recording(current.Controller):
        pass

    for name in CALLS:

        def wrapper(self, *args, _name=name):
            calls.append((_name, args))
            return getattr(current.Controller, _name)(self, *args)

        setattr(Recording, name, wrapper)
    proposer = load_proposer(config, target=target, tokenizer=tokenizer)
    shape = (proposer.draft_depth(), proposer.draft_width())
    decoder = SpeculativeDecoder(target, proposer, controller=Recording(*shape))
    for prompt in prompts:
        decoder.generate(prompt, max_new_tokens=64)
    return shape, calls


def as_module_plans(module: ModuleType, calls: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """``calls`` with each observed ``Plan`` made of ``module``'s class (its ``PLAIN`` for a plain one): before the clock starts.

    A controller tells a plain step its own plan held (``Controller.HELD``) by identity, so a
    recorded plan of this tree's module reads as a planned plain step to another revision's
    controller; ``replay`` hands a plain step the replaying controller's own plain plan.
    """
    plain = getattr(module.Controller, "PLAIN", None) or module.Plan(0)
    translated = []
    for name, args in calls:
        if name == "observe":
            plan = args[0]
            known = {f.name: getattr(plan, f.name) for f in fields(module.Plan) if hasattr(plan, f.name)}  # an older Plan has fewer fields
            plan = plain if plan.depth == 0 else module.Plan(**known)
            args = (plan, *args[1:])
        translated.append((name, args))
    return translated


def replay(module: ModuleType, shape: tuple[int, int], calls: list[tuple[str, tuple]]) -> tuple[float, list]:
    """(seconds for the whole replay, what each plan and trim returned); the outcomes are converted for comparison after the clock stops.

    ``calls`` as ``as_module_plans`` made them for ``module``. A plain step is observed with the
    plain plan this controller returned for it (its held one, where it held the step), a drafted
    step with the recorded plan: the draft and its outcome are the recording's.
    """
    controller = module.Controller(*shape)
    outcomes = []
    planned = None
    tick = time.perf_counter()
    for name, args in calls:
        if name == "observe" and args[0].depth == 0 and planned is not None and planned.depth == 0:
            args = (planned, *args[1:])
        out = getattr(controller, name)(*args)
        if name == "plan":
            planned = out
        if name == "plan" or name == "trim":
            outcomes.append(out)
    spent = time.perf_counter() - tick
    # each revision has its own Plan class: compare the fields; a trim by the nodes it kept
    return spent, [astuple(out) if not isinstance(out, tuple) else out[1] for out in outcomes]


def frozen_decisions(module: ModuleType, shape: tuple[int, int], calls: list[tuple[str, tuple]]) -> list:
    """What each plan and trim of a replay returned with the controller's clock stopped (untimed).

    A plain step's price leaves out the estimates' recomputation as the controller times it,
    so a replay's plans move with its own timing; with the clock stopped, the same code plans
    the same on the same calls, and two revisions that decide alike compare equal.
    """
    clock = module.time
    module.time = SimpleNamespace(perf_counter=lambda: 0.0)
    try:
        return replay(module, shape, calls)[1]
    finally:
        module.time = clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the git revision to compare with (a commit, a tag, HEAD~3)")
    parser.add_argument("--methods", default="ngram_tree,suffix,suffix+draft,demo_draft,medusa,eagle2,eagle3,mtp")
    parser.add_argument("--domains", default="code,prose,copy", help="demo domains to record on (mixed and repeat draft the largest trees)")
    parser.add_argument("--prompts", type=int, default=4, help="per domain")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_target(DEMO_TARGET)
    with tempfile.TemporaryDirectory() as folder:
        written = build_domains(heldout_documents(DEMO_TARGET), Path(folder) / "domains", args.prompts, 4 * 128, 6 * 960)
        prompts = [prompt for domain in args.domains.split(",") for prompt in demo_prompts(tokenizer, written[domain], args.prompts)]
        old = baseline_module(args.baseline, Path(folder))
        configs = {**DEMO_PROPOSERS, **trained_drafts(DEMO_TARGET)}
        rows = []
        print(f"| method | steps | {args.baseline} us/step | this tree us/step | ratio | same plans and trims |")
        print("|---|---:|---:|---:|---:|---|")
        for method in args.methods.split(","):
            shape, calls = record(target, tokenizer, configs[method], prompts)
            steps = sum(name == "observe" for name, _ in calls)
            seconds: dict[str, list[float]] = {"baseline": [], "current": []}
            translated = {"baseline": as_module_plans(old, calls), "current": as_module_plans(current, calls)}
            for repeat in range(args.repeats):
                order = [("baseline", old), ("current", current)]
                for label, module in order if repeat % 2 else order[::-1]:
                    seconds[label].append(replay(module, shape, translated[label])[0] / steps)
            before, after = (1e6 * statistics.median(seconds[k]) for k in ("baseline", "current"))
            same = frozen_decisions(old, shape, translated["baseline"]) == frozen_decisions(current, shape, translated["current"])
            rows.append({"method": method, "steps": steps, "baseline_us": before, "current_us": after, "same_decisions": same})
            print(f"| {method} | {steps} | {before:.1f} | {after:.1f} | {after / before:.2f} | {'yes' if same else 'no'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
