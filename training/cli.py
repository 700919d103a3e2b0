"""The ``draftsmith`` console script: generate, eval, demo, export, engine-check, engine-bench, train, capture and calibrate.

It sits at the top of the stack because it reaches every layer; each command's work lives
in its layer (``verify``, ``verify.evaluation``, ``training``), imported only when the
command runs. ``train`` runs a recipe in this process; several processes start under
``accelerate launch -m draftsmith.training.train`` (the same run), so that ``accelerate`` /
``torchrun`` start them.
"""

from __future__ import annotations

import argparse
import json
import sys


class Parser(argparse.ArgumentParser):
    """argparse, with a bad command line reported in one line (exit code 2) like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the arguments)\n")


def config_command(commands, name: str, help: str, config_help: str, run) -> None:
    """A command that runs one config YAML with key=value overrides, with a progress bar unless --no-progress."""
    command = commands.add_parser(name, help=help)
    command.add_argument("--config", required=True, help=config_help)
    command.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    command.add_argument("--no-progress", action="store_true")
    command.set_defaults(run=run)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="draftsmith", description="Speculative decoding for Hugging Face causal LMs.")
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
    gen.add_argument("--compile", action="store_true", help="compile the target's forward (torch.compile; pays on long outputs only)")
    gen.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 for a model under 50M parameters)")
    gen.add_argument("--no-warm-up", action="store_true", help="skip the untimed warm-up (plain, then drafting; its time is reported)")
    gen.add_argument("--fixed", action="store_true", help="draft with the proposer's fixed config every step (no speculation controller)")
    gen.set_defaults(run=run_generate)

    config_command(commands, "eval", "per-domain tau / speedup of proposers vs plain decoding (JSON, table, plots)",
                   "eval config YAML (see recipes/eval/*.yaml)", run_eval)  # fmt: skip

    exp = commands.add_parser("export", help="write a trained proposer in a serving engine's layout and print how to serve it")
    exp.add_argument("--proposer", required=True, help="proposer config YAML ({type: medusa, model: DIR} ...)")
    exp.add_argument("--output", required=True, help="a new or empty directory for the engine's files")
    exp.add_argument("--format", default="vllm", help="the engine's layout: vllm (default) or sglang (where the family has one)")
    exp.add_argument("--target", help="the target directory: checks the proposer against it and names it in the serve line")
    exp.set_defaults(run=run_export)

    config_command(commands, "engine-check",
                   "export proposers, serve them in vLLM (its own venv) and compare with its plain run and with draftsmith",
                   "engine-check config YAML (see recipes/eval/engine_check_demo.yaml)", run_engine_check)  # fmt: skip
    config_command(commands, "engine-bench",
                   "serve proposers in vLLM under rising concurrency (vllm bench serve); speedup curve and k schedule",
                   "engine-bench config YAML (see recipes/eval/engine_bench_demo.yaml)", run_engine_bench)  # fmt: skip

    demo = commands.add_parser("demo", help="build or reuse the offline demo target and evaluate every proposer on it")
    demo.add_argument("--quick", action="store_true", help="train the minutes-long quick target instead of using the shipped one")
    demo.add_argument("--output-dir", default="outputs/demo")
    demo.add_argument("--num-prompts", type=int, default=8, help="prompts per domain")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--domains-only", action="store_true", help="write the domain files under OUTPUT_DIR/domains and stop")
    demo.set_defaults(run=run_demo)

    tr = commands.add_parser("train", help="train a draft or heads on a frozen target from a YAML recipe (one process)")
    tr.add_argument("--config", required=True, help="the training recipe (recipes/training/*.yaml)")
    tr.add_argument("overrides", nargs="*", help="key=value overrides of recipe keys (section.key=value for nested keys)")
    tr.set_defaults(run=run_train)

    cap = commands.add_parser(
        "capture", help="write a training recipe's target features once, as safetensors shards (capture.mode: offline)"
    )
    cap.add_argument("--config", required=True, help="the training recipe (its target, data, type and capture keys)")
    cap.add_argument("overrides", nargs="*", help="key=value overrides of recipe keys")
    cap.set_defaults(run=run_capture)

    cal = commands.add_parser("calibrate", help="measure Medusa heads on a recipe's eval files and (re)write their calibration.json")
    cal.add_argument("--config", required=True, help="the Medusa training recipe (output_dir holds the heads)")
    cal.add_argument("overrides", nargs="*", help="key=value overrides of recipe keys")
    cal.set_defaults(run=run_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse and run; bad input (an ``InputError`` or a missing file) is one line on stderr and exit code 2.

    Any other exception is a bug and keeps its traceback.
    """
    args = build_parser().parse_args(argv)  # --help and a bad command line answer here, before torch is imported
    from draftsmith.proposers.core.errors import InputError

    try:
        return args.run(args)
    except (InputError, FileNotFoundError) as err:
        print(f"draftsmith {args.command}: error: {err}", file=sys.stderr)
        return 2


def run_generate(args) -> int:
    from draftsmith.proposers import load_proposer
    from draftsmith.verify import SpeculativeDecoder, load_target
    from draftsmith.verify.decoder import check_settings

    check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)  # before loading anything
    check_prompt(args.prompt)
    model, tokenizer = load_target(args.target)
    proposer = load_proposer(args.proposer, target=model, tokenizer=tokenizer) if args.proposer else None
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    decoder = SpeculativeDecoder(model, proposer, compile_forward=args.compile, adaptive=not args.fixed, threads=args.threads)
    warm_up = 0.0 if args.no_warm_up else decoder.warm_up(input_ids.shape[1])  # a fresh process's first forwards are slow
    result = decoder.generate(
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
        print(
            json.dumps(
                {
                    "text": text,
                    "new_tokens": result.new_tokens,
                    "stats": stats.to_dict(),
                    "controller": result.controller,
                    "warm_up_s": warm_up,
                }
            )
        )
        return 0
    print(text)
    chosen = f", {stats.planned_plain_steps}/{stats.steps} steps planned plain" if result.controller is not None else ""
    print(
        f"\n[{stats.new_tokens} tokens, {stats.target_forwards} target forwards, tau {stats.tau:.2f}, "
        f"{stats.tokens_per_second:.1f} tok/s, ttft {stats.ttft * 1000:.1f} ms, tpot {stats.tpot * 1000:.1f} ms{chosen}, "
        f"after a {warm_up * 1000:.0f} ms warm-up]"
    )
    return 0


def check_prompt(prompt: str) -> None:
    """A prompt from the command line: not empty, and UTF-8 (the shell passes undecodable bytes as lone surrogates)."""
    from draftsmith.proposers.core.errors import InputError

    if not prompt.strip():
        raise InputError("--prompt is empty: give the text to continue")
    bad = next((i for i, char in enumerate(prompt) if "\udc80" <= char <= "\udcff"), None)
    if bad is not None:
        raise InputError(
            f"--prompt is not valid UTF-8 (byte 0x{ord(prompt[bad]) - 0xDC00:02x} at character {bad}): convert the text to "
            "UTF-8 first (iconv -f latin1 -t utf-8)"
        )


def run_eval(args) -> int:
    from draftsmith.verify.evaluation.evaluate import EvalConfig, evaluate

    print_summary(evaluate(EvalConfig.from_yaml(args.config, args.overrides), progress=not args.no_progress))
    return 0


def run_export(args) -> int:
    from draftsmith.proposers import load_proposer
    from draftsmith.proposers.core.config import read_config
    from draftsmith.verify import load_target

    config = read_config(args.proposer, what="proposer config")
    target = load_target(args.target)[0] if args.target else None
    proposer = load_proposer(config, target=target)
    exported = proposer.export(args.output, format=args.format)
    print(f"exported to {exported.path}; serve it with:")
    for command in exported.serve_commands(args.target or "<target>"):
        print(f"  {command}")
    return 0


def run_engine_check(args) -> int:
    """Exit code 1 when any check failed (after printing the table)."""
    from draftsmith.verify.evaluation.engine_check import EngineCheckConfig, EngineUnavailable, engine_check

    try:
        summary = engine_check(EngineCheckConfig.from_yaml(args.config, args.overrides), progress=not args.no_progress)
    except EngineUnavailable as err:
        print(f"draftsmith engine-check: the engine is unavailable: {err}", file=sys.stderr)
        return 1
    print_summary(summary)
    if not summary["passed"]:
        print("draftsmith engine-check: FAILED (see the check column)", file=sys.stderr)
        return 1
    return 0


def run_engine_bench(args) -> int:
    """Exit code 1 when the engine is unavailable or failed, 130 on Ctrl-C / SIGTERM (every server stopped either way)."""
    from draftsmith.verify.evaluation.engine_bench import EngineBenchConfig, engine_bench
    from draftsmith.verify.evaluation.engine_check import EngineUnavailable

    config = EngineBenchConfig.from_yaml(args.config, args.overrides)
    try:
        summary = engine_bench(config, progress=not args.no_progress)
    except EngineUnavailable as err:
        print(f"draftsmith engine-bench: the engine is unavailable: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("draftsmith engine-bench: interrupted; every server it started is stopped", file=sys.stderr)
        return 130
    print_summary(summary)
    return 0


def run_demo(args) -> int:
    from draftsmith.training.demo.run import run_demo as demo

    kwargs = dict(quick=args.quick, output_dir=args.output_dir, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    if args.domains_only:
        for name, domain in demo(**kwargs, domains_only=True).items():
            print(f"{name}: {getattr(domain, 'path', domain)}")
        return 0
    print_summary(demo(**kwargs))
    return 0


def run_train(args) -> int:
    """One process; several go through ``accelerate launch -m draftsmith.training.train``, the same run."""
    from draftsmith.training.common import sigterm_as_interrupt
    from draftsmith.training.recipe import load_config
    from draftsmith.training.train import run

    cfg = load_config(args.config, args.overrides)
    sigterm_as_interrupt()  # kill = Ctrl-C: checkpoint, then exit
    print(f"draft written to {run(cfg)}")
    return 0


def run_capture(args) -> int:
    from draftsmith.training.commands import capture_offline
    from draftsmith.training.recipe import load_config

    print(json.dumps(capture_offline(load_config(args.config, args.overrides)), indent=1))
    return 0


def run_calibrate(args) -> int:
    from draftsmith.training.commands import calibrate
    from draftsmith.training.recipe import load_config

    print(f"calibration written to {calibrate(load_config(args.config, args.overrides))}")
    return 0


def print_summary(summary: dict) -> None:
    """Print the Markdown table and where the files went."""
    from draftsmith.verify.evaluation.report import markdown_table

    print(summary.get("table") or markdown_table(summary["rows"]))
    for name, path in summary["paths"].items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    sys.exit(main())
