"""The layering: imports run training -> verify -> proposers only; one import name, ``draftsmith``.

A family added later must not reach against the direction (a proposer importing the
verifier, the verifier importing the trainer), nor import the repository's folders by
their bare names (``import training``): installed, they exist only as ``draftsmith.*``.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("proposers", "verify", "training")  # bottom to top
ALLOWED = {layer: set(LAYERS[: i + 1]) for i, layer in enumerate(LAYERS)}  # a layer imports itself and those below


def imported_layers(source: str, module: str) -> list[tuple[int, str]]:
    """(line, imported name) for every import of a project module in ``source``, resolved to ``draftsmith.<layer>...``.

    Args:
        module: the dotted name of the module the source belongs to (``draftsmith.verify.target``),
            for resolving relative imports.
    """
    found = []
    package = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] in ("draftsmith", *LAYERS)]
    return found


def violations(source: str, module: str) -> list[str]:
    """Each import of ``source`` that goes against the layering, as ``module:line imports name``."""
    layer = module.split(".")[1]
    bad = []
    for line, name in imported_layers(source, module):
        parts = name.split(".")
        if parts[0] != "draftsmith":
            bad.append(f"{module}:{line} imports {name} (use draftsmith.{name})")
        elif len(parts) > 1 and parts[1] not in ALLOWED[layer]:
            bad.append(f"{module}:{line} imports {name} ({layer} may import {sorted(ALLOWED[layer])} only)")
    return bad


def project_modules():
    for layer in LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            yield path, ".".join(("draftsmith", *parts))


def test_imports_run_training_verify_proposers_only():
    modules = list(project_modules())
    assert len(modules) > 20
    found = [v for path, module in modules for v in violations(path.read_text(), module)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "module, source",
    [
        ("draftsmith.proposers.eagle", "from draftsmith.verify.target import Target\n"),
        ("draftsmith.proposers.eagle", "from ..training import train\n"),
        ("draftsmith.verify.decoder", "import draftsmith.training.capture\n"),
        ("draftsmith.verify.evaluation.evaluate", "from ...training.demo import run\n"),
        ("draftsmith.training.medusa", "from training.common import flatten\n"),
    ],
)
def test_the_check_catches_a_wrong_import(module, source):
    """Negative controls: each of these imports must be reported."""
    assert violations(source, module)


def test_relative_imports_resolve_within_the_package():
    assert imported_layers("from ..proposers.base import Draft\n", "draftsmith.verify.target") == [(1, "draftsmith.proposers.base")]
    assert not violations("from .base import Draft\nfrom ..proposers import tree\n", "draftsmith.verify.evaluation.report")


def test_a_wheel_holds_one_top_level_package(tmp_path):
    """``pip install .`` adds ``draftsmith`` and nothing else of ours to site-packages."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *LAYERS):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("draftsmith-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"draftsmith", wheel.name.split("-py")[0] + ".dist-info"}
    assert "draftsmith/__init__.py" not in names  # a namespace package: draftsmith.proposers / .verify / .training
    for layer in LAYERS:
        assert f"draftsmith/{layer}/__init__.py" in names
    assert "draftsmith/training/demo/pretrain.py" in names and "draftsmith/verify/evaluation/evaluate.py" in names
