"""What every trainer shares: config hashes, atomic checkpoints with resume, the schedule, the loss curve.

Recipes are read by the project's one config loader (``draftsmith.proposers.core.config``). A run directory holds
``checkpoints/step_<n>/`` written by ``accelerator.save_state`` into a temporary
directory and renamed when complete, so an interrupt never leaves half a checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator

from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.files import publish_directory, staging_dir, write_text_atomic

# --- configs ---------------------------------------------------------------


def flatten(values: dict, prefix: str = "", sep: str = ".") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}{sep}", sep))
        else:
            flat[prefix + key] = value
    return flat


def file_signature(path: str | Path) -> list:
    """What identifies a model directory's weights without reading them: resolved path, size and mtime of its first safetensors file."""
    weights = next(iter(sorted(Path(path).glob("*.safetensors"))), Path(path) / "config.json")
    stat = weights.stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


def with_defaults(saved: dict, defaults: dict) -> dict:
    """``saved`` (a recipe as an earlier version wrote it, flattened) with every key it lacks at its value in ``defaults``:
    a key added since means what its default does, so an older run or output still counts as this recipe's."""
    return {**flatten(defaults), **flatten(saved)}


def config_hash(values: dict, keys: tuple[str, ...] | None = None, exclude: set[str] = frozenset()) -> str:
    """Short hash of a config's (flattened) values: of ``keys`` when given, else of every key not in ``exclude``."""
    flat = flatten(values)
    keys = keys or tuple(k for k in flat if k not in exclude)
    return hashlib.sha1(json.dumps({k: flat[k] for k in keys}, sort_keys=True).encode()).hexdigest()[:10]


# --- optimisation ----------------------------------------------------------


def check_same_shape(init_from: str, saved, wanted) -> None:
    """Raise InputError unless the head saved in ``init_from`` (its shape ``saved``) has the recipe's shape ``wanted``
    (dataclasses of one kind); the message names the first key that differs."""
    for key, mine in dataclasses.asdict(wanted).items():
        if getattr(saved, key) != mine:
            raise InputError(f"draft.init_from {init_from} has {key} {getattr(saved, key)!r}, this recipe asks for {mine!r}")


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
        partial = staging_dir(final)  # every process writes its part here
        if accelerator.is_main_process and partial.exists():
            shutil.rmtree(partial)  # left by a save that was itself interrupted
        accelerator.wait_for_everyone()
        accelerator.save_state(str(partial))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            for name, text in (files or {}).items():
                (partial / name).write_text(text)
            publish_directory(partial, final)
    if accelerator.is_main_process:
        for old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
        write_text_atomic(Path(run_dir, "loss_curve.json"), json.dumps(state.curve))
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


def small_llama(
    tokenizer, vocab_size: int, hidden_size: int, intermediate_size: int, layers: int, heads: int, kv_heads: int, positions: int
):
    """A freshly initialised Llama with tied embeddings and the tokenizer's special tokens (the demo target, a fresh draft)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def recipe_command(argv: list[str] | None, description: str, load_config, run, report) -> None:
    """The command line of a trainer: ``--config recipe.yaml key=value section.key=value ...``.

    SIGTERM checkpoints like Ctrl-C; the first process prints ``report(run(config))``.
    A bad recipe, override or file is one line on stderr and exit code 2, like the
    ``draftsmith`` commands; any other exception is a bug and keeps its traceback.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=None, help="YAML recipe (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of recipe keys (section.key=value for nested keys)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        sigterm_as_interrupt()  # kill = Ctrl-C: checkpoint, then exit
        out = run(cfg)
    except (InputError, FileNotFoundError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if first_process():
        print(report(out))


def check_output_dir(out: str | Path, recipe: dict, runtime_keys: set[str], overwrite: bool, defaults: dict | None = None) -> None:
    """Refuse to replace a non-empty ``out`` unless it holds this recipe's own earlier output, or ``overwrite`` is set.

    A run replaces its output directory whole; a short trial run must never silently
    replace what another recipe wrote there (a shipped model). Its own earlier output is
    recognised by the recipe in its ``training_config.yaml``, runtime keys aside, and keys
    added since it was written at their ``defaults``.
    """
    out = Path(out)
    if overwrite or not out.is_dir() or not any(out.iterdir()):
        return
    saved_file = out / "training_config.yaml"
    saved = yaml.safe_load(saved_file.read_text()) if saved_file.is_file() else None
    if isinstance(saved, dict) and defaults is not None:
        saved = with_defaults(saved, defaults)
    if isinstance(saved, dict) and config_hash(saved, exclude=runtime_keys) == config_hash(recipe, exclude=runtime_keys):
        return
    mine, theirs = flatten(recipe), flatten(saved) if isinstance(saved, dict) else {}
    differ = sorted(k for k in set(mine) | set(theirs) if k not in runtime_keys and mine.get(k) != theirs.get(k))
    what = f"another recipe's output (differing keys: {differ[:6]})" if isinstance(saved, dict) else "files that no training run wrote"
    raise InputError(f"output_dir {out} holds {what}: give a new output_dir, or overwrite=true to replace it")


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
