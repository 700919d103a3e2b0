"""The ``draftsmith`` console script: generate, eval (from ``verify``) and demo."""

from __future__ import annotations

import sys

from verify.cli import add_verify_commands, print_summary, run_command


def main(argv: list[str] | None = None) -> int:
    parser, commands = add_verify_commands()
    demo = commands.add_parser("demo", help="build or reuse the offline demo target and evaluate every proposer on it")
    demo.add_argument("--quick", action="store_true", help="train the minutes-long quick target instead of using the shipped one")
    demo.add_argument("--output-dir", default="outputs/demo")
    demo.add_argument("--num-prompts", type=int, default=8, help="prompts per domain")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.set_defaults(run=run_demo)
    return run_command(parser, argv)


def run_demo(args) -> int:
    from training.demo import run_demo as demo

    summary = demo(quick=args.quick, output_dir=args.output_dir, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
