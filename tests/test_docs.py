"""Every command the docs give is one that works: README.md and docs/*.md, read the way a user copies them.

- A Python block marked ``<!-- runnable -->`` runs as written, from the repository root.
- Every ``draftsmith <command>`` line names a command that exists and flags it takes.
- Every ``python -m`` / ``accelerate launch -m`` module exists, and every ``recipes/...``
  path in a code block exists.
Negative controls: a made-up command, flag, module and path are each reported.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.training.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"(<!-- runnable -->\n)?```(\w*)\n(.*?)```", re.S)


def blocks(path: Path) -> list[tuple[str, str, bool]]:
    """(language, text, marked runnable) of every fenced block of ``path``."""
    return [(m.group(2), m.group(3), bool(m.group(1))) for m in FENCE.finditer(path.read_text())]


def commands(text: str) -> list[list[str]]:
    """The shell commands of a block, split into words: continuation lines joined, ``&&`` chains and comments split off."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in line.split("&&"):
            try:
                out.append(shlex.split(part.replace("[", "").replace("]", "").replace("...", "")))
            except ValueError:  # an unbalanced quote in an example's placeholder
                continue
    return out


def problems(words: list[str]) -> list[str]:
    """What is wrong with one documented command: an unknown subcommand or flag, a missing module or recipe path."""
    found = []
    if words[:1] == ["draftsmith"] and len(words) > 1 and not words[1].startswith("-"):
        parser = build_parser()
        subparsers = next(a for a in parser._actions if a.dest == "command").choices
        if words[1] not in subparsers:
            return [f"draftsmith has no command {words[1]!r} (it has {sorted(subparsers)})"]
        flags = {option for action in subparsers[words[1]]._actions for option in action.option_strings}
        found += [f"draftsmith {words[1]} has no flag {w}" for w in words[2:] if w.startswith("--") and w.split("=")[0] not in flags]
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1].startswith(("draftsmith", "benchmarks")) and "<" not in words[i + 1]:
            if importlib.util.find_spec(words[i + 1]) is None:
                found.append(f"no module {words[i + 1]}")
    for word in words:
        for path in re.findall(r"recipes/[\w./-]+", word):
            path = path.rstrip(".,:")
            if "<" not in word and "*" not in path and not (REPO / path).exists():
                found.append(f"no {path}")
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_documented_command_exists(path):
    assert path.is_file()
    found = []
    for language, text, _ in blocks(path):
        if language in ("bash", "sh", "console", ""):
            for words in commands(text):
                found += problems(words)
    assert not found, found


def test_the_docs_are_in_place_and_the_readme_is_a_front_door():
    assert {p.name for p in DOCS} >= {
        "README.md", "quickstart.md", "python-api.md", "cli.md", "proposers.md", "training.md",
        "evaluation.md", "serving.md", "design.md", "changelog.md",
    }  # fmt: skip
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for manual in DOCS[1:]:
        assert f"docs/{manual.name}" in readme, f"README links no docs/{manual.name}"
    assert "pytest --slow" in readme and "draftsmith demo" in readme


def test_ci_and_the_quickstart_run_the_readme_test_command_verbatim():
    test_command = next(text for language, text, _ in blocks(REPO / "README.md") if language == "bash" and "pytest" in text).strip()
    assert test_command in (REPO / ".ci" / "run").read_text()
    assert test_command in (REPO / "docs" / "quickstart.md").read_text()


RUNNABLE = [(path, text) for path in DOCS for language, text, marked in blocks(path) if marked and language == "python"]


@pytest.mark.parametrize("path, code", RUNNABLE, ids=[f"{p.name}:{i}" for i, (p, _) in enumerate(RUNNABLE)])
def test_runnable_blocks_run_as_written(path, code):
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{path.name}:\n{code}\n{done.stderr[-3000:]}"


def test_runnable_blocks_include_the_readme_api_example():
    assert any(path.name == "README.md" and "SpeculativeDecoder" in code for path, code in RUNNABLE)


@pytest.mark.parametrize(
    "line, why",
    [
        ("draftsmith evaluate --config recipes/eval/demo.yaml", "no command 'evaluate'"),
        ("draftsmith generate --target recipes/models/demo_target --temprature 0.7", "no flag --temprature"),
        ("python -m draftsmith.training.calibrate --config recipes/training/medusa_demo.yaml", "no module"),
        ("draftsmith eval --config recipes/eval_demo.yaml", "no recipes/eval_demo.yaml"),
    ],
)
def test_the_check_reports_a_wrong_command(line, why):
    """Negative controls: a renamed command, a misspelt flag, a moved module and a moved recipe are each reported."""
    found = [p for words in commands(line) for p in problems(words)]
    assert any(why in p for p in found), found
