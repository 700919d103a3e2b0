"""Host syncs per decode step, for plain decoding and every shipped proposer config, counted on the CPU.

The decode loop runs inside ``benchmarks.device_mode.StandInDevice``: the target and every
module the proposer loads sit on a stand-in device, and every read of a device tensor's value
by the host (``.item()``, ``.tolist()``, ``int()``, ``float()``, ``bool()``, ``torch.equal``,
``.cpu()``, a data-dependent shape) is counted where a GPU would make the host wait. Each
count is split by where it happened: the proposer's ``propose`` (draft), its ``observe`` and
``begin``, and the rest of the loop (scoring, verification, commit). A request's one-off
counts (its prefill, first token and ``begin``) are measured apart, by a request of one
token, and left out of the per-step figures. Uploads (host data copied to the device) are
counted per step too. The configs draft their fixed shape every step (``adaptive=False``),
so a count is the proposer's whole draft. The code runs the forms it runs on a GPU
(``proposers.core.devices.FREE_READS`` emptied: on a CPU, where reads are free, some steps
read values one by one instead). Any tensor a step puts on the wrong device is listed (a
violation) and fails the run.

    python -m benchmarks.bench_syncs [--target recipes/models/demo_target] [--new-tokens 48] [--json FILE] [--sites NAME]

``--sites NAME`` also prints where the syncs of that row come from (file:line).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import draftsmith.proposers.core.devices as devices
from benchmarks.device_mode import StandInDevice
from draftsmith.proposers import load_proposer
from draftsmith.verify import SpeculativeDecoder, load_target

PROMPTS = (
    "def main(argv):\n    parser = argparse.ArgumentParser()\n    ",
    "The history of the city begins with a small market town on the river, and ",
)
CONFIGS = Path("recipes/proposers")
LABELS = ("draft", "observe", "loop")


def label_calls(proposer, mode: StandInDevice) -> None:
    """Count what ``proposer``'s methods do under their own labels (the decoder calls them as attributes)."""
    for method, label in (("propose", "draft"), ("observe", "observe"), ("begin", "begin")):
        bound = getattr(proposer, method)

        def labelled(*args, _bound=bound, _label=label, **kwargs):
            before, mode.label = mode.label, _label
            try:
                return _bound(*args, **kwargs)
            finally:
                mode.label = before

        setattr(proposer, method, labelled)


def count_row(target, config: Path | None, new_tokens: int, temperature: float, mode: StandInDevice, tokenizer) -> dict:
    """Per-step syncs and uploads by label, over the prompts, for one proposer config (None: plain) at one temperature."""
    proposer = load_proposer(config, target=target) if config is not None else None
    if proposer is not None:
        label_calls(proposer, mode)
    decoder = SpeculativeDecoder(target, proposer, adaptive=False)
    totals = {"steps": 0, "syncs": dict.fromkeys(LABELS, 0), "uploads": dict.fromkeys(LABELS, 0), "tau": []}
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids.to(target.device)
        runs = {}
        for tokens in (1, new_tokens):
            mode.syncs.clear(), mode.uploads.clear()
            mode.label = "loop"
            result = decoder.generate(ids, max_new_tokens=tokens, temperature=temperature, seed=0)
            runs[tokens] = (dict(mode.syncs), dict(mode.uploads), result.stats)
        (once_syncs, once_uploads, _), (syncs, uploads, stats) = runs[1], runs[new_tokens]
        totals["steps"] += stats.steps
        totals["tau"].append(stats.tau)
        for label in LABELS:
            totals["syncs"][label] += syncs.get(label, 0) - once_syncs.get(label, 0)
            totals["uploads"][label] += uploads.get(label, 0) - once_uploads.get(label, 0)
    steps = max(totals["steps"], 1)
    row = {label: totals["syncs"][label] / steps for label in LABELS}
    row["total"] = sum(totals["syncs"].values()) / steps
    row["uploads"] = sum(totals["uploads"].values()) / steps
    row["steps"] = totals["steps"]
    row["tau"] = sum(totals["tau"]) / len(totals["tau"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="recipes/models/demo_target")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--configs", nargs="*", help="proposer configs (default: plain and every recipes/proposers/*.yaml)")
    parser.add_argument("--sites", help="print the sync sites of this row (a config's stem, or plain)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    devices.FREE_READS = set()  # the forms a GPU runs (one read for many values), not the CPU's (a read per value, free there)
    target, tokenizer = load_target(args.target)
    configs = [None, *sorted(CONFIGS.glob("*.yaml"))] if not args.configs else [None if c == "plain" else Path(c) for c in args.configs]
    rows, failed = [], False
    print(f"{'proposer':20s} {'T':>4s} {'draft':>6s} {'observe':>7s} {'loop':>5s} {'total':>6s} {'uploads':>7s} {'steps':>5s} {'tau':>5s}")
    mode = StandInDevice(target)  # one for the run: what it derives from the target once (fused weights) stays on the device
    for config in configs:
        name = config.stem if config is not None else "plain"
        for temperature in args.temperatures:
            mode.violations, mode.record_stacks = [], name == args.sites
            mode.sync_sites.clear()
            with mode:
                row = count_row(target, config, args.new_tokens, temperature, mode, tokenizer)
            row.update(proposer=name, temperature=temperature, violations=mode.violations[:5])
            rows.append(row)
            print(
                f"{name:20s} {temperature:4.1f} {row['draft']:6.2f} {row['observe']:7.2f} {row['loop']:5.2f} {row['total']:6.2f} "
                f"{row['uploads']:7.2f} {row['steps']:5d} {row['tau']:5.2f}"
            )
            for violation in dict.fromkeys(mode.violations):
                print(f"    VIOLATION {violation}")
                failed = True
            if name == args.sites:
                for site, count in mode.sync_sites.most_common():
                    print(f"    {count:5d}  {site}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if failed:
        raise SystemExit("a tensor was created off the model's device (VIOLATION lines above)")


if __name__ == "__main__":
    main()
