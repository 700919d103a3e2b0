"""Build a proposer from a config: a dict or a YAML file naming a family by ``type``.

Unknown types and unknown keys are errors that list what is valid.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import yaml

from .base import Proposer

#: type name -> "module:Class". Classes may define ``from_config(target=..., **kwargs)``
#: when they need the target model (vocabulary checks, hidden sizes).
REGISTRY: dict[str, str] = {
    "ngram": "draftsmith.proposers.ngram:NgramProposer",
    "draft_model": "draftsmith.proposers.draft_model:DraftModelProposer",
}


def load_proposer(config: dict[str, Any] | str | Path, target=None) -> Proposer:
    """Build the proposer a config describes.

    Args:
        config: ``{"type": name, **constructor kwargs}`` or the path of a YAML file
            holding that mapping.
        target: the target model, for families that check or use it.
    """
    config = read_config(config)
    kind = config.get("type")
    if kind not in REGISTRY:
        raise ValueError(f"unknown proposer type {kind!r}; available: {sorted(REGISTRY)}")
    module, name = REGISTRY[kind].split(":")
    cls = getattr(importlib.import_module(module), name)
    kwargs = {k: v for k, v in config.items() if k != "type"}
    factory = getattr(cls, "from_config", cls)
    valid = [p for p in inspect.signature(factory).parameters if p not in ("self", "target")]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} for proposer type {kind!r}; valid keys: {valid}")
    if factory is cls:
        return cls(**kwargs)
    return factory(target=target, **kwargs)


def read_config(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    """Return the config mapping, reading it from YAML when given a path."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"proposer config {path} does not exist")
        config = yaml.safe_load(path.read_text())
        if not isinstance(config, dict):
            raise ValueError(f"proposer config {path} must hold a mapping with a 'type' key, got {type(config).__name__}")
    if not isinstance(config, dict):
        raise TypeError(f"proposer config must be a dict or a YAML path, got {type(config).__name__}")
    return dict(config)
