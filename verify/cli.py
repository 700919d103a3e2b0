"""The ``draftsmith`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    """``generate`` and ``eval``; the ``draftsmith`` script (training.cli) adds ``demo``."""
    parser, _ = add_verify_commands()
    return run_command(parser, argv)


def add_verify_commands():
    """The parser with the generate and eval subcommands; returns (parser, subparsers)."""
    parser = argparse.ArgumentParser(prog="draftsmith", description="Speculative decoding for Hugging Face causal LMs.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text with a proposer and print it with decoding stats")
    gen.add_argument("--target", required=True, help="directory of a causal LM saved with save_pretrained (with its tokenizer)")
    gen.add_argument("--proposer", help="proposer config YAML (omit for plain decoding)")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.set_defaults(run=run_generate)

    ev = commands.add_parser("eval", help="per-domain tau / speedup of proposers vs plain decoding (JSON, table, plots)")
    ev.add_argument("--config", required=True, help="eval config YAML (see recipes/eval_*.yaml)")
    ev.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    ev.add_argument("--no-progress", action="store_true")
    ev.set_defaults(run=run_eval)
    return parser, commands


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse and run; a bad value or missing file is one line on stderr and exit code 2."""
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"draftsmith {args.command}: error: {err}", file=sys.stderr)
        return 2


def load_target(path: str | Path):
    """Load a local causal LM and its tokenizer in fp32 eval mode; clear errors for a bad directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target directory {path} has no config.json (expected a save_pretrained model directory)")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"target directory {path} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def run_generate(args) -> int:
    from proposers import load_proposer
    from verify import SpeculativeDecoder

    model, tokenizer = load_target(args.target)
    proposer = load_proposer(args.proposer, target=model) if args.proposer else None
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    result = SpeculativeDecoder(model, proposer).generate(
        input_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=tokenizer.eos_token_id,
    )
    text = tokenizer.decode(result.new_tokens, skip_special_tokens=True)
    stats = result.stats
    if args.json:
        print(json.dumps({"text": text, "new_tokens": result.new_tokens, "stats": stats.to_dict()}))
        return 0
    print(text)
    print(
        f"\n[{stats.new_tokens} tokens, {stats.target_forwards} target forwards, tau {stats.tau:.2f}, "
        f"{stats.tokens_per_second:.1f} tok/s, ttft {stats.ttft * 1000:.1f} ms, tpot {stats.tpot * 1000:.1f} ms]"
    )
    return 0


def run_eval(args) -> int:
    from verify.evaluate import EvalConfig, evaluate

    summary = evaluate(EvalConfig.from_yaml(args.config, args.overrides), progress=not args.no_progress)
    print_summary(summary)
    return 0


def print_summary(summary: dict) -> None:
    """Print the Markdown table and where the files went."""
    from verify.report import markdown_table

    print(markdown_table(summary["rows"]))
    for name, path in summary["paths"].items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
