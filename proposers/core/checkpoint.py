"""Checkpoints of trained heads: one reader of ``config.json`` + weights, one tensor check, one "fits this target" check.

A head directory holds ``config.json`` (the shape, in the family's own section and in the
fields engines read) and ``model.safetensors``. Every family reads it through
``read_checkpoint``, so a missing directory, a broken config and a truncated weights file
give the same clear errors whatever the family; ``check_tensors`` then holds the weights
to the module's own state, and ``check_fits_target`` the shape to the target's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from .errors import InputError
from .files import read_json_object
from .models import output_vocab_size

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
READ_ERRORS = (OSError, RuntimeError, SafetensorError, ValueError)  # what safetensors and torch.load raise for a bad file


@dataclass(frozen=True)
class Checkpoint:
    """A head directory, read: its config and its tensors.

    Args:
        path: the directory.
        config: ``config.json`` as a dict.
        weights: the weights file that was read.
        tensors: name -> tensor, as stored.
    """

    path: Path
    config: dict[str, Any]
    weights: Path
    tensors: dict[str, torch.Tensor]

    def section(self, key: str, schema, what: str):
        """``schema(**config[key])``: the family's own copy of its shape; a missing or bad section is one InputError line."""
        return config_section(self.path, self.config, key, schema, what)


def config_section(path: Path, config: Mapping[str, Any], key: str, schema, what: str):
    """``schema(**config[key])`` of the head directory ``path``; a missing or bad section is one InputError line."""
    try:
        return schema(**config[key])
    except (KeyError, TypeError, ValueError) as error:
        raise InputError(f"{what} config {Path(path) / CONFIG} cannot be used: {error}") from error


def read_shape(path: str | Path, key: str, schema, what: str):
    """A head's shape from ``path/config.json`` alone (``config[key]`` as ``schema``), without reading its weights."""
    return config_section(Path(path), read_config_file(path, what), key, schema, what)


def read_config_file(path: str | Path, what: str) -> dict[str, Any]:
    """``path/config.json`` of a head directory as a dict; a missing directory is a FileNotFoundError, a bad file one InputError."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{what} directory {path} does not exist (no hub downloads: give a local directory)")
    try:
        return read_json_object(path / CONFIG, f"{what} config")
    except FileNotFoundError:
        raise InputError(f"{what} directory {path} has no {CONFIG}") from None


def read_checkpoint(path: str | Path, what: str, weights: tuple[str, ...] = (WEIGHTS,)) -> Checkpoint:
    """Read a head directory: its config and the first of ``weights`` present (``.pt`` files load with ``weights_only``).

    Args:
        what: the head, for messages (``"Medusa heads"``, ``"EAGLE draft"``).
    """
    path = Path(path)
    config = read_config_file(path, what)
    for name in weights:
        file = path / name
        if not file.is_file():
            continue
        try:
            tensors = torch.load(file, map_location="cpu", weights_only=True) if file.suffix == ".pt" else load_file(str(file))
        except READ_ERRORS as error:
            raise InputError(f"{what} weights {file} cannot be read (a truncated or corrupt file?): {error}") from error
        return Checkpoint(path, config, file, tensors)
    raise InputError(f"{what} directory {path} has no weights file (one of {list(weights)})")


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


def check_fits_target(
    what: str, target: nn.Module, hidden_size: int | None = None, num_layers: int | None = None, vocab_size: int | None = None
) -> None:
    """Raise InputError unless a head of these dimensions reads ``target``'s features and scores its vocabulary.

    Each dimension given is compared with the target's (its config's ``hidden_size`` and
    ``num_hidden_layers``, and its output vocabulary); None skips it.
    """
    config = target.config
    for dimension, mine, theirs in (
        ("hidden size", hidden_size, getattr(config, "hidden_size", None)),
        ("number of layers", num_layers, getattr(config, "num_hidden_layers", None)),
        ("vocabulary", vocab_size, output_vocab_size(target)),
    ):
        if mine is not None and theirs is not None and mine != theirs:
            raise InputError(f"{what} trained for a target of {dimension} {mine}, this target's is {theirs}: they belong to another target")
