"""Checkpoints of trained heads: read and checked whole, and written in a serving engine's layout.

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
from safetensors.torch import load_file

from .base import InputError
from .config import write_text_atomic

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
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
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(staging)
        check_written(staging, expected, fields)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()
    staging.rename(out_dir)
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


def check_tensors(file: Path, found: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise InputError naming ``file`` unless ``found`` holds exactly the tensors of ``expected``, each with its shape."""
    missing = [name for name in expected if name not in found]
    if missing:
        raise InputError(f"{what} weights {file} miss {missing[:4]}")
    unexpected = sorted(name for name in found if name not in expected)
    if unexpected:
        raise InputError(f"{what} weights {file} hold tensors this {what} has not: {unexpected[:4]}")
    for name, tensor in expected.items():
        if found[name].shape != tensor.shape:
            raise InputError(f"{what} weights {file}: {name} has shape {tuple(found[name].shape)}, expected {tuple(tensor.shape)}")
