"""The layering, by AST over every module of the project: who may import whom, no cycles, imports at the top.

Layers, bottom to top: the shared runtime (``draftsmith.proposers.core``, which imports
nothing else of the project); the proposer families and their registry
(``draftsmith.proposers.*``: a family imports the runtime, the registry and its own files,
never another family); ``verify`` (the runtime and the proposers' public API, never a
family module); ``training`` (anything below). No import cycle, counting imports inside
functions too; and no import of a project module inside a function, outside the
command-line entry points, which import lazily so that ``--help`` answers at once.
Each rule has a negative control that must be reported. Installed, the folders exist
only as ``draftsmith.*``: a wheel holds one top-level package.
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("proposers", "verify", "training")
ENTRY_POINTS = {"draftsmith.training.cli"}  # function-level imports allowed (the console script)
PROPOSER_API = {"draftsmith.proposers", "draftsmith.proposers.registry"}  # what verify may import of the families' layer


def project_modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the project (``draftsmith.<folder>...``; a package by its ``__init__``)."""
    modules = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(("draftsmith", *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = project_modules()


def imports(source: str, module: str, known=MODULES) -> list[tuple[int, str, bool]]:
    """(line, imported project module, inside a function) for every import in ``source``.

    ``from package import name`` resolves to ``package.name`` when that is a module.
    Bare folder names (``import training``) are reported as ``training...`` (never ``draftsmith.``).
    """
    is_package = module in known and known[module].name == "__init__.py"
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[: len(package) - child.level + 1] + ([child.module] if child.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
            else:
                visit(child, inside)
                continue
            for name in dict.fromkeys(names):
                if name.split(".")[0] in ("draftsmith", *FOLDERS):
                    found.append((child.lineno, name, in_function))

    visit(ast.parse(source), False)
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[:3] == ["draftsmith", "proposers", "core"]:
        return "core"
    return parts[1]


def family(module: str) -> str:
    """A proposer family's name: the file name before its first ``_part`` (``eagle_head`` -> ``eagle``, ``draft_model`` whole)."""
    name = module.split(".")[2]
    return "draft_model" if name == "draft_model" else name.split("_")[0]


def violations(source: str, module: str, known=MODULES) -> list[str]:
    """Each import of ``source`` that breaks the layering or is made inside a function, as ``module:line imports name (why)``."""
    bad = []
    mine = layer(module)
    for line, name, in_function in imports(source, module, known):
        where = f"{module}:{line} imports {name}"
        if not name.startswith("draftsmith."):
            bad.append(f"{where} (use draftsmith.{name}: installed, the folders exist only as draftsmith.*)")
            continue
        theirs = layer(name)
        if in_function and module not in ENTRY_POINTS:
            bad.append(f"{where} inside a function (import at the top; only {sorted(ENTRY_POINTS)} import lazily)")
        if mine == "core" and theirs != "core":
            bad.append(f"{where} (the runtime imports nothing else of the project)")
        elif mine == "proposers" and theirs not in ("core", "proposers"):
            bad.append(f"{where} (proposers import the runtime and the families' layer only)")
        elif mine == "proposers" and theirs == "proposers" and name not in PROPOSER_API and module not in PROPOSER_API:
            if family(name) != family(module):
                bad.append(f"{where} (a family imports its own files only, and other families through the registry)")
        elif mine == "verify" and theirs == "training":
            bad.append(f"{where} (verify may import proposers only)")
        elif mine == "verify" and theirs == "proposers" and name not in PROPOSER_API:
            bad.append(f"{where} (verify imports the runtime and {sorted(PROPOSER_API)}, never a family)")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> modules it imports): every strongly connected part with more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(node):  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                part.append(member)
                if member == node:
                    break
            if len(part) > 1 or node in graph.get(node, ()):
                found.append(sorted(part))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def import_graph(sources: dict[str, str], known=MODULES) -> dict[str, set[str]]:
    return {module: {name for _, name, _ in imports(text, module, known) if name in known} for module, text in sources.items()}


def test_every_module_keeps_to_its_layer_and_imports_at_the_top():
    assert len(MODULES) > 40 and "draftsmith.proposers.core.types" in MODULES
    found = [v for module, path in MODULES.items() for v in violations(path.read_text(), module)]
    assert not found, "\n".join(found)


def test_the_project_has_no_import_cycle():
    graph = import_graph({module: path.read_text() for module, path in MODULES.items()})
    assert sum(map(len, graph.values())) > 100  # the graph really was read
    assert not cycles(graph)


@pytest.mark.parametrize(
    "module, source, why",
    [
        ("draftsmith.proposers.core.tree", "from ..eagle import EagleProposer\n", "runtime imports nothing"),
        ("draftsmith.proposers.core.cache", "from draftsmith.verify.target import Target\n", "runtime imports nothing"),
        ("draftsmith.proposers.eagle", "from draftsmith.verify.target import Target\n", "families' layer only"),
        ("draftsmith.proposers.eagle", "from .medusa_head import MedusaHeads\n", "its own files only"),
        ("draftsmith.proposers.composite", "from .ngram import NgramProposer\n", "its own files only"),
        ("draftsmith.verify.decoder", "import draftsmith.training.capture\n", "verify may import proposers only"),
        ("draftsmith.verify.target", "from draftsmith.proposers.eagle import EagleProposer\n", "never a family"),
        ("draftsmith.verify.evaluation.evaluate", "from ...training.demo import run\n", "verify may import proposers only"),
        ("draftsmith.training.medusa", "from training.common import flatten\n", "use draftsmith.training.common"),
        ("draftsmith.training.medusa", "def f():\n    from .train import run\n", "inside a function"),
        ("draftsmith.verify.evaluation.evaluate", "def f():\n    from .report import plot_domains\n", "inside a function"),
    ],
)
def test_the_check_catches_a_wrong_import(module, source, why):
    """Negative controls: each of these imports must be reported, for its reason."""
    found = violations(source, module)
    assert found and why in found[0], found


def test_entry_points_may_import_lazily_and_relative_imports_resolve():
    assert not violations("def run():\n    from draftsmith.training.train import run\n", "draftsmith.training.cli")
    assert imports("from ..proposers.core.types import Draft\n", "draftsmith.verify.target") == [
        (1, "draftsmith.proposers.core.types", False)
    ]
    assert imports("from . import mtp_head\n", "draftsmith.proposers.mtp") == [(1, "draftsmith.proposers.mtp_head", False)]
    assert not violations("from .eagle_head import load_draft\nfrom .core.tree import grow_dynamic_tree\n", "draftsmith.proposers.eagle")
    assert not violations("from .registry import load_proposer\n", "draftsmith.proposers.composite")


def test_the_cycle_check_finds_a_circle():
    """Negative control: the circle the offline capture once made (capture -> train -> objective -> capture)."""
    sources = {
        "draftsmith.training.capture": "def key():\n    from .train import make_objective\n",
        "draftsmith.training.train": "from .objective import Objective\n",
        "draftsmith.training.objective": "from .capture import Captured\n",
        "draftsmith.training.data": "from .capture import Captured\n",
    }
    found = cycles(import_graph(sources))
    assert found == [["draftsmith.training.capture", "draftsmith.training.objective", "draftsmith.training.train"]]
    del sources["draftsmith.training.objective"]
    assert not cycles(import_graph(sources))


def test_a_wheel_holds_one_top_level_package(tmp_path):
    """``pip install .`` adds ``draftsmith`` and nothing else of ours to site-packages, with every subpackage."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *FOLDERS):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("draftsmith-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"draftsmith", wheel.name.split("-py")[0] + ".dist-info"}
    assert "draftsmith/__init__.py" not in names  # a namespace package: draftsmith.proposers / .verify / .training
    shipped = {n.removesuffix(".py").replace("/", ".") for n in names if n.endswith(".py")}
    assert {m if path.name != "__init__.py" else m + ".__init__" for m, path in MODULES.items()} <= shipped


def test_no_file_of_the_project_runs_past_450_lines():
    """Files that read in one sitting: code, tests, benchmarks, recipes and docs (data files, such as tokenizers, aside)."""
    data = ("tokenizer.json", "calibration.json", "loss_curve.json")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    texts = [REPO / name for name in tracked if name.endswith((".py", ".md", ".yaml", ".toml")) and not name.endswith(data)]
    assert len(texts) > 60
    long = {str(path.relative_to(REPO)): n for path in texts if path.is_file() and (n := len(path.read_text().splitlines())) > 450}
    assert not long, long


BENCHMARKS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmarks_are_modules_that_import_the_project_at_the_top(path):
    """``python -m benchmarks.<name>``: helpers as ``benchmarks.harness`` / ``.device_mode``, the project (``draftsmith.*``) at the top."""
    module = importlib.import_module(f"benchmarks.{path.stem}")
    assert path.stem in ("harness", "device_mode") or callable(getattr(module, "main", None))
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lazy = [
                n for n in ast.walk(node) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(("draftsmith", "benchmarks"))
            ]
            assert not lazy, f"{path.name}:{lazy[0].lineno} imports the project inside {node.name}"
        if isinstance(node, ast.ImportFrom) and node.module == "harness":
            pytest.fail(f"{path.name}:{node.lineno} imports harness by the script path: use benchmarks.harness")
