"""A training recipe: every key it may set, read and checked, and what a run directory must agree with.

A recipe is a YAML file whose header shows the command that runs it; ``key=value`` /
``section.key=value`` overrides apply on top. It names its family by ``type``
(``training.objective.OBJECTIVES``); the family's own keys sit under ``draft:`` and go to
its ``Objective``. Everything else is shared by every family (``LoopConfig``, data, capture).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from draftsmith.proposers.core.config import build, load
from draftsmith.proposers.core.errors import ConfigError

from .capture import CaptureConfig
from .common import checkpoints, config_hash, flatten, with_defaults
from .data import DataConfig
from .objective import Objective, objective_class

Dtype = Literal["float32", "bfloat16", "float16"]
CONFIG_FILE = "training_config.yaml"


@dataclass
class LoopConfig:
    """What every training loop shares: optimisation, logging, checkpoints, runtime."""

    batch_size: int = 8  # sequences per micro-batch and process
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_steps: int = 1000
    max_minutes: float = 0.0  # wall-clock budget (0 = none); the schedule decays by it too
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0 = evaluate only at the start and the end
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_with: Literal["none", "wandb", "tensorboard", "mlflow", "aim", "comet_ml", "clearml", "dvclive"] = "none"
    project: str = "draftsmith"  # tracker project name; wandb runs offline when WANDB_API_KEY is unset
    threads: int = 0  # torch CPU threads (0 = torch default)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"  # auto = bf16 on a GPU that supports it, else no
    save_dtype: Dtype = "float32"

    def __post_init__(self):
        for name in ("batch_size", "gradient_accumulation_steps", "max_steps", "keep_checkpoints", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class TrainConfig(LoopConfig):
    """Every key a training recipe may set; an unknown key is an error that lists the valid ones."""

    type: str = "draft_lm"  # the family (training.objective.OBJECTIVES)
    target: str = "recipes/models/demo_target"  # the frozen target: a save_pretrained directory with its tokenizer
    target_dtype: Dtype = "float32"
    target_device_map: str | None = None  # e.g. "auto": shard a large target over the devices (from_pretrained's device_map)
    output_dir: str = "outputs/draft"  # the trained draft, its config and curves
    run_dir: str = ""  # checkpoints and caches ("" = .cache/draftsmith/runs/<output_dir name>)
    draft: dict[str, Any] = field(default_factory=dict)  # the family's own keys (its Objective's arguments)
    data: DataConfig = field(default_factory=DataConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    eval_batches: int = 8
    overwrite: bool = False  # replace an output_dir that holds another recipe's output (never needed for a run's own)


# Keys that do not change what is trained: left out of the hash that guards resuming.
RUNTIME_KEYS = set(
    "output_dir run_dir overwrite log_every eval_every eval_batches checkpoint_every keep_checkpoints log_with project threads "
    "max_minutes save_dtype mixed_precision draft.lora.merge data.eval_files data.self_distill.cache_dir "
    "data.self_distill.batch_size capture.dir capture.max_gb capture.batch_size capture.rows_per_shard".split()
)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a YAML recipe, apply ``key=value`` / ``section.key=value`` overrides, check every value."""
    cfg = load(TrainConfig, path, overrides, what="recipe")
    make_objective(cfg)  # the draft section is checked now, not after the data is built
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: give at least one local .txt / .json / .jsonl file")
    return cfg


def make_objective(cfg: TrainConfig) -> Objective:
    """The recipe's family objective, built from its ``draft:`` keys."""
    return build(objective_class(cfg.type), cfg.draft, where=f"recipe type {cfg.type!r}", prefix="draft.")


def resolved_recipe(cfg: TrainConfig) -> str:
    """The resolved config as a recipe of its own (every key, under a header with the command that reruns it)."""
    where = Path(cfg.output_dir) / CONFIG_FILE
    header = f"# The resolved recipe of this {cfg.type} run. It runs again as is:\n#\n"
    header += f"#   python -m draftsmith.training.train --config {where}\n"
    values = dataclasses.asdict(cfg)
    first = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in {g.name for g in dataclasses.fields(LoopConfig)}]
    return header + yaml.safe_dump({**{k: values.pop(k) for k in first}, **values}, sort_keys=False)


def run_dir_of(cfg: TrainConfig) -> Path:
    return Path(cfg.run_dir or f".cache/draftsmith/runs/{Path(cfg.output_dir).name}")


def check_resumable(cfg: TrainConfig, run_dir: Path) -> None:
    """Raise ValueError when the run directory's checkpoints were written by a different recipe."""
    found = checkpoints(run_dir)
    if not found or not (found[-1] / CONFIG_FILE).is_file():
        return
    saved, mine = (
        with_defaults(yaml.safe_load((found[-1] / CONFIG_FILE).read_text()), dataclasses.asdict(TrainConfig())),
        dataclasses.asdict(cfg),
    )
    if config_hash(saved, exclude=RUNTIME_KEYS) != config_hash(mine, exclude=RUNTIME_KEYS):
        ours, theirs = flatten(mine), flatten(saved)
        differ = sorted(k for k in set(ours) | set(theirs) if k not in RUNTIME_KEYS and ours.get(k) != theirs.get(k))
        raise ConfigError(
            f"run_dir {run_dir} holds checkpoints of a different recipe (differing keys: {differ}); "
            f"resume with the same recipe, or give another run_dir / delete {run_dir}"
        )
