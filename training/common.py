"""What every trainer shares: strict YAML recipes, atomic checkpoints with resume, the schedule, the loss curve.

A recipe is a dataclass (nested dataclasses are sections); ``load_recipe`` reads YAML,
applies ``key=value`` overrides (``section.key=value`` for nested keys) and rejects
unknown keys with the list of valid ones. A run directory holds
``checkpoints/step_<n>/`` written by ``accelerator.save_state`` into a temporary
directory and renamed when complete, so an interrupt never leaves half a checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import types
import typing
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator

# --- recipes -------------------------------------------------------------


def config_from_dict(cls: type, values: dict, choices: dict[str, tuple] | None = None, prefix: str = ""):
    """An instance of the dataclass ``cls`` from plain values; unknown keys and wrong types fail.

    Args:
        cls: a dataclass; fields whose type is a dataclass are sections (nested mappings).
        values: ``{key: value}``, as read from YAML.
        choices: dotted key -> allowed values (e.g. ``{"mixed_precision": ("no", "bf16")}``).
        prefix: dotted path of this section, for messages.
    """
    choices = choices or {}
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"unknown config key(s) {[prefix + k for k in unknown]}; valid keys: {sorted(prefix + n for n in names)}")
    checked = {}
    for key, value in values.items():
        name = prefix + key
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ValueError(f"config key {name}: expected a mapping of {hints[key].__name__} keys, got {value!r}")
            checked[key] = config_from_dict(hints[key], value, choices, prefix=name + ".")
            continue
        value = _check_type(value, hints[key], name)
        if name in choices and value not in choices[name]:
            raise ValueError(f"config key {name}: {value!r} is not one of {list(choices[name])}")
        checked[key] = value
    return cls(**checked)


def _check_type(value, hint, name: str):
    """``value`` converted to ``hint`` where YAML is loose (ints for floats, "1e-3"), else ValueError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        items = [value] if isinstance(value, str) else value  # a single path is a list of one
        if not isinstance(items, list):
            raise ValueError(f"config key {name}: expected a list, got {value!r}")
        return [_check_type(item, args[0], name) for item in items]
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        except ValueError:
            pass
    kind = origin or hint
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"config key {name}: expected {getattr(hint, '__name__', hint)}, got {value!r}")
    return value


def apply_overrides(values: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """``values`` with ``key=value`` / ``section.key=value`` strings applied (values parsed as YAML)."""
    values = dict(values)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not key=value")
        *sections, last = key.strip().split(".")
        node = values
        for section in sections:
            child = node.get(section)
            node[section] = child = dict(child) if isinstance(child, dict) else {}
            node = child
        node[last] = yaml.safe_load(text)
    return values


def load_recipe(cls: type, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), choices: dict | None = None):
    """Read a YAML recipe into the dataclass ``cls`` and apply ``key=value`` overrides; unknown keys fail.

    Args:
        cls: the recipe dataclass.
        path: YAML file of its keys (None = the defaults).
        overrides: ``["key=value", "section.key=value", ...]`` applied after the file.
        choices: dotted key -> allowed values.
    """
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"recipe {path} does not exist")
    values = (yaml.safe_load(Path(path).read_text()) if path else None) or {}
    if not isinstance(values, dict):
        raise ValueError(f"recipe {path} must hold a mapping of keys, got {type(values).__name__}")
    return config_from_dict(cls, apply_overrides(values, overrides), choices)


def flatten(values: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def config_hash(values: dict, keys: tuple[str, ...] | None = None, exclude: set[str] = frozenset()) -> str:
    """Short hash of a config's (flattened) values: of ``keys`` when given, else of every key not in ``exclude``."""
    flat = flatten(values)
    keys = keys or tuple(k for k in flat if k not in exclude)
    return hashlib.sha1(json.dumps({k: flat[k] for k in keys}, sort_keys=True).encode()).hexdigest()[:10]


# --- optimisation ----------------------------------------------------------


def make_adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with weight decay on matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)


def cosine_lr(step: int, progress: float, peak: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup over steps, then cosine decay from ``peak`` to ``peak * min_lr_ratio`` over ``progress`` in [0, 1]."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return peak * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


# --- checkpoints -----------------------------------------------------------


class TrainState:
    """Optimiser steps, trained tokens, elapsed time and the loss curve; saved with each checkpoint."""

    def __init__(self):
        self.step, self.tokens, self.elapsed_s, self.curve = 0, 0, 0.0, []

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed_s, "curve": self.curve}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.elapsed_s, self.curve = state["step"], state["elapsed_s"], list(state["curve"])
        self.tokens = state.get("tokens", 0)  # absent from checkpoints written before it existed

    def progress(self, max_steps: int, max_minutes: float = 0.0) -> float:
        """Fraction of the run done: by steps, or by wall clock when ``max_minutes`` runs out first."""
        by_time = self.elapsed_s / (60.0 * max_minutes) if max_minutes > 0 else 0.0
        return max(self.step / max_steps, by_time)


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (temporary directories are not listed)."""
    return sorted(Path(run_dir, "checkpoints").glob("step_*"))


def save_checkpoint(accelerator: Accelerator, run_dir: Path, state: TrainState, keep: int, files: dict[str, str] | None = None) -> Path:
    """``save_state`` into ``checkpoints/step_<n>`` atomically; keep the newest ``keep``; write the curve.

    Every process writes into a temporary directory; the main process adds ``files``
    (name -> text) and renames it into place, so a checkpoint directory is complete or absent.
    """
    root = Path(run_dir, "checkpoints")
    final = root / f"step_{state.step:07d}"
    if not final.exists():  # an interrupt right after a scheduled save has nothing new to save
        partial = root / f".{final.name}.tmp"
        if accelerator.is_main_process and partial.exists():
            shutil.rmtree(partial)  # left by a save that was itself interrupted
        accelerator.wait_for_everyone()
        accelerator.save_state(str(partial))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            for name, text in (files or {}).items():
                (partial / name).write_text(text)
            os.replace(partial, final)
    if accelerator.is_main_process:
        for old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
        _write_atomic(Path(run_dir, "loss_curve.json"), json.dumps(state.curve))
    accelerator.wait_for_everyone()
    return final


def resume(accelerator: Accelerator, run_dir: Path, state: TrainState) -> Path | None:
    """``load_state`` from the newest complete checkpoint of the run; return it (None when starting fresh)."""
    found = checkpoints(run_dir)
    if not found:
        return None
    accelerator.load_state(str(found[-1]))
    accelerator.print(f"resumed from {found[-1]} (step {state.step})")
    return found[-1]


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(text)
    os.replace(partial, path)


def sigterm_as_interrupt() -> None:
    """Make SIGTERM (``kill``, a scheduler's preemption) raise KeyboardInterrupt like Ctrl-C, so loops checkpoint first."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


# --- the curve ---------------------------------------------------------------


def plot_curve(
    curve: list[dict], path: Path, title: str, series: dict[str, str] | None = None, ylabel: str = "loss (nats / token)"
) -> None:
    """Plot curve points against tokens seen, as a PNG.

    Args:
        curve: points ``{"tokens": n, key: value or {name: value}, ...}``.
        path: the PNG to write.
        title: the plot title.
        series: point key -> legend label; a dict value gives one line per name
            (default: ``train_loss`` as "train" and ``heldout_loss`` as "held-out").
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = series or {"train_loss": "train", "heldout_loss": "held-out"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in series.items():
        points = [p for p in curve if key in p]
        if not points:
            continue
        style = "o-" if len(points) <= 50 else "-"
        if isinstance(points[0][key], dict):
            for name in points[0][key]:
                ax.plot([p["tokens"] for p in points], [p[key][name] for p in points], style, ms=3, lw=1, label=f"{label} {name}")
        else:
            ax.plot([p["tokens"] for p in points], [p[key] for p in points], style, ms=3, lw=1, label=label)
    ax.set(xlabel="training tokens", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- several processes ---------------------------------------------------------


def all_agree(flag: bool, accelerator: Accelerator) -> bool:
    """``flag`` if any process raised it: every process must leave the loop at the same step.

    (``accelerator.reduce`` returns its input unchanged in a single process.)
    """
    return bool(accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), "max").item())


def multi_process_cpu() -> bool:
    """Whether this is one of several processes on a machine with no accelerator.

    accelerate picks its gloo (MULTI_CPU) backend only when asked for the CPU; without
    ``cpu=True`` every process of a ``torchrun`` / ``accelerate launch --multi_gpu`` run on
    a CPU machine would train alone on the whole data.
    """
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and torch.accelerator.current_accelerator() is None


def first_process() -> bool:
    """Whether this is the first (or only) process of a launch: the one that reports."""
    return int(os.environ.get("RANK", "0")) == 0
