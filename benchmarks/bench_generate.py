"""`draftsmith generate` against `draftsmith eval`'s plain decoding, same prompt, on an idle and on a loaded machine.

    python -m benchmarks.bench_generate [--runs 5] [--max-new-tokens 64] [--json FILE]

Each run starts both commands as a user would (a fresh process each, the shipped demo
target, plain decoding, their default threads) on one prompt: the first 128 tokens of a
held-out code document of the demo target. ``generate`` reports one cold request's tok/s;
``eval`` its plain row's tok/s after its untimed warm-up. Runs alternate the two commands;
the loaded runs keep every core busy with spinning processes meanwhile. Reports the median
tok/s of each, and generate's over eval's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import yaml
from transformers import AutoTokenizer

from draftsmith.training.demo.run import heldout_documents
from draftsmith.verify.evaluation.demo import DEMO_TARGET

CLI = [str(Path(sys.executable).parent / "draftsmith")]  # the console script a user runs


@contextmanager
def loaded(busy: bool):
    """Every core kept busy by a spinning process while the block runs (``busy``), else nothing."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)] if busy else []
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def generate_tok_s(prompt: str, max_new_tokens: int) -> float:
    out = subprocess.run(
        [*CLI, "generate", "--target", str(DEMO_TARGET), "--prompt", prompt, "--max-new-tokens", str(max_new_tokens), "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)["stats"]["tokens_per_second"]


def eval_config(prompt: str, max_new_tokens: int, work: Path) -> Path:
    """An eval config of one domain holding ``prompt`` as it is, plain decoding only; its path."""
    domain = work / "one.jsonl"
    domain.write_text(json.dumps({"prompt": prompt}) + "\n")
    config = {
        "target": str(DEMO_TARGET),
        "domains": {"one": str(domain)},
        "proposers": {},
        "peers": False,
        "num_prompts": 1,
        "prompt_tokens": 512,  # the prompt as it is
        "max_new_tokens": max_new_tokens,
        "output_dir": str(work / "eval"),
    }
    (work / "eval.yaml").write_text(yaml.safe_dump(config))
    return work / "eval.yaml"


def eval_tok_s(config: Path) -> float:
    subprocess.run([*CLI, "eval", "--config", str(config), "--no-progress"], check=True, capture_output=True, text=True)
    summary = json.loads((config.parent / "eval" / "summary.json").read_text())
    return next(row["tokens_per_s"] for row in summary["rows"] if row["method"] == "plain")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    document = heldout_documents(DEMO_TARGET)["code"][0]
    prompt = tokenizer.decode(tokenizer(document.text).input_ids[:128])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = eval_config(prompt, args.max_new_tokens, Path(tmp))
        commands = {"generate": lambda: generate_tok_s(prompt, args.max_new_tokens), "eval": lambda: eval_tok_s(config)}
        for label, busy in (("idle", False), ("loaded", True)):
            speeds = {name: [] for name in commands}
            with loaded(busy):
                for run in range(args.runs):
                    for name in list(commands)[:: 1 if run % 2 == 0 else -1]:  # alternate which runs first
                        speeds[name].append(commands[name]())
            gen, ev = speeds["generate"], speeds["eval"]
            results[label] = {
                "generate_tok_s": gen,
                "eval_tok_s": ev,
                "ratio": statistics.median(gen) / statistics.median(ev),
            }
            print(
                f"{label:6s}  generate {statistics.median(gen):7.1f} tok/s  eval plain {statistics.median(ev):7.1f} tok/s  "
                f"generate / eval {results[label]['ratio']:.2f}  (runs: generate {[round(g) for g in gen]}, eval {[round(e) for e in ev]})"
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
