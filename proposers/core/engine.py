"""Exports: trained heads written in a serving engine's layout, read back and checked whole.

Engines load what they find and zero-fill or skip the rest without a word, so an export
is read back and compared tensor by tensor (names, shapes, dtypes, values) and field by
field before it is renamed into the output directory. A proposer that can be served
implements ``export(out_dir, format) -> EngineExport``; ``draftsmith export`` prints its
serve commands.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .checkpoint import CONFIG, WEIGHTS
from .errors import InputError
from .files import atomic_directory, write_text_atomic

SPEC_FILE = "speculative_config.json"  # written by every export: what the engine's speculative_config gets


@dataclass(frozen=True)
class EngineExport:
    """What an export wrote and how to serve it.

    Args:
        path: the export directory.
        format: ``vllm`` or ``sglang``.
        speculative_config: vLLM's ``speculative_config``, or SGLang's ``--speculative-*`` flags (name -> value).
        model: the model the engine serves instead of the target (MTP: the target written with
            its modules, ``path`` itself); None serves the target.
    """

    path: Path
    format: str
    speculative_config: dict[str, Any]
    model: Path | None = None

    def serve_commands(self, target: str) -> list[str]:
        """The command line and the Python call that serve ``target`` (or ``model``, when set) with this export."""
        target = str(self.model) if self.model is not None else target
        if self.format == "sglang":
            flags = " ".join(f"--{name} {value}" for name, value in self.speculative_config.items())
            return [f"python -m sglang.launch_server --model-path {target} {flags}"]
        spec = json.dumps(self.speculative_config)
        return [
            f"vllm serve {target} --speculative-config '{spec}'",
            f"LLM(model={target!r}, speculative_config={self.speculative_config!r})",
        ]


def check_format(format: str, allowed: tuple[str, ...], family: str) -> None:
    """InputError unless ``format`` is one of the layouts ``family`` exports to."""
    if format not in allowed:
        raise InputError(f"{family} exports to {list(allowed)}, got format {format!r}")


def write_export(
    out_dir: str | Path, write: Callable[[Path], None], expected: Mapping[str, torch.Tensor], fields: Mapping[str, Any]
) -> Path:
    """Write an export with ``write(directory)`` beside ``out_dir``, check it (``check_written``), then move it into place.

    ``out_dir`` must be new or empty; a failed write or check leaves it untouched.
    """
    out_dir = _new_or_empty(out_dir)
    with atomic_directory(out_dir) as staging:
        write(staging)
        check_written(staging, expected, fields)
    return out_dir


def config_export(out_dir: str | Path, format: str, speculative_config: Mapping[str, Any]) -> EngineExport:
    """An export that is the engine's settings alone (n-gram, suffix: nothing trained), in ``out_dir/speculative_config.json``."""
    out_dir = _new_or_empty(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_spec(EngineExport(out_dir, format, dict(speculative_config)))


def write_spec(export: EngineExport) -> EngineExport:
    """Write ``export.speculative_config`` into its directory (``speculative_config.json``) and return it."""
    write_text_atomic(export.path / SPEC_FILE, json.dumps(export.speculative_config, indent=1) + "\n")
    return export


def _new_or_empty(out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InputError(f"export directory {out_dir} is not empty: give a new or empty directory")
    return out_dir


def check_written(directory: Path, expected: Mapping[str, torch.Tensor], fields: Mapping[str, Any]) -> None:
    """Raise InputError unless ``directory`` holds exactly the ``expected`` tensors (names, shapes, dtypes, values) and ``fields``."""
    config = json.loads((directory / CONFIG).read_text())
    for key, value in fields.items():
        if config.get(key) != value:
            raise InputError(f"exported config {directory / CONFIG}: {key} is {config.get(key)!r}, expected {value!r}")
    written = load_file(str(directory / WEIGHTS))
    missing = sorted(set(expected) - set(written))
    extra = sorted(set(written) - set(expected))
    if missing or extra:
        raise InputError(f"exported weights {directory / WEIGHTS}: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, tensor in expected.items():
        got = written[name]
        if got.shape != tensor.shape or got.dtype != tensor.dtype or not torch.equal(got, tensor.detach().cpu()):
            raise InputError(f"exported weights {directory / WEIGHTS}: {name} differs from the trained tensor")


@dataclass(frozen=True)
class ExportControl:
    """A hand-made incomplete copy of an export, which an engine loads without a word (``Proposer.export_controls``).

    Args:
        label: what is missing (``"no d2t"``), named in the engine check's table.
        export: the copy, served like the export it was made from.
        accepts_near_nothing: whether the engine must then accept near nothing (checked), or
            the gain is only reported (a loss whose size depends on the model).
    """

    label: str
    export: EngineExport
    accepts_near_nothing: bool


def incomplete_copy(
    export: EngineExport, directory: Path, drop: str | None = None, edit_config: Callable[[dict], dict] | None = None
) -> EngineExport:
    """A copy of ``export`` in ``directory`` without the tensor ``drop`` and/or with ``config.json`` edited, served the same way."""
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(export.path, directory)
    if drop is not None:
        tensors = load_file(str(directory / WEIGHTS))
        tensors.pop(drop)
        save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((directory / CONFIG).read_text())
        (directory / CONFIG).write_text(json.dumps(edit_config(config), indent=1))
    return EngineExport(directory, export.format, dict(export.speculative_config, model=str(directory)))
