"""Run a training recipe: train a draft or heads on a frozen target, one run for every family.

    accelerate launch -m draftsmith.training.train --config recipes/training/distill_draft_full.yaml [key=value ...]
    python -m draftsmith.training.train --config recipes/training/distill_draft_lora.yaml [section.key=value ...]

The recipe (``training.recipe``) names its family by ``type``; the family's ``Objective``
builds the draft, computes its loss from what ``training.capture`` captured and exports it.
Everything else is shared:

- the target is frozen (``requires_grad_(False)``, eval mode), kept out of
  ``accelerator.prepare``, and may be loaded in bf16/fp16 or sharded with ``device_map``;
- data comes from local files through ``datasets`` (``training.data``); the target's
  features are captured online, or read from an offline capture (``capture.mode``);
- ``training.loop.fit`` reads top to bottom: data, step, log, evaluate, checkpoint.
  Checkpoints are atomic; a run started again resumes from the newest one, and SIGTERM /
  Ctrl-C checkpoint first. The demo target's pretraining (``training.demo.pretrain``) runs
  the same ``fit``;
- the export is atomic too: written beside ``output_dir``, then swapped in.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from draftsmith.proposers.core.errors import ConfigError
from draftsmith.proposers.core.files import atomic_directory, check_writable
from draftsmith.proposers.core.models import context_limit, torch_threads
from draftsmith.verify.target import load_target

from .capture import CapturedRows, Capturer, offline_key, read_manifest
from .common import (
    check_output_dir,
    flatten,
    make_adamw,
    plot_curve,
    recipe_command,
)
from .data import build_dataset, check_files, collate, eval_config, make_loader
from .loop import fit, heldout_metrics, make_accelerator
from .objective import Objective
from .recipe import CONFIG_FILE, RUNTIME_KEYS, TrainConfig, check_resumable, load_config, make_objective, resolved_recipe, run_dir_of


def load_frozen_target(cfg: TrainConfig, device: torch.device):
    """The target in eval mode with no trainable parameter (on ``device`` unless sharded by ``target_device_map``); and its tokenizer."""
    target, tokenizer = load_target(cfg.target, cfg.target_dtype, cfg.target_device_map)
    if cfg.target_device_map is None:
        target = target.to(device)
    return target.eval().requires_grad_(False), tokenizer


def train(cfg: TrainConfig, interrupt_after_steps: int = 0) -> Path:
    """Train the recipe's draft, export it and return ``output_dir``; resumes from ``run_dir`` when it holds checkpoints."""
    objective = make_objective(cfg)
    run_dir = run_dir_of(cfg)
    check_files(cfg.data.train_files + cfg.data.eval_files, cfg.data)  # before anything slow
    check_writable(run_dir, "run_dir")
    check_writable(Path(cfg.output_dir).resolve().parent, "the directory of output_dir")
    check_resumable(cfg, run_dir)
    check_output_dir(cfg.output_dir, dataclasses.asdict(cfg), RUNTIME_KEYS, cfg.overwrite, dataclasses.asdict(TrainConfig()))
    accelerator = make_accelerator(cfg, run_dir)
    config_text = resolved_recipe(cfg)
    target, tokenizer = load_frozen_target(cfg, accelerator.device)
    positions = context_limit(target)
    if positions is not None and cfg.data.block_size > positions:
        raise ConfigError(f"data.block_size={cfg.data.block_size} exceeds the target's {positions} positions")
    objective.check(target, tokenizer)
    # data
    train_rows, eval_rows = training_rows(cfg, target, tokenizer, run_dir, accelerator)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    set_seed(cfg.seed)  # the same fresh draft whatever the data path did
    draft = objective.build(target, tokenizer, train_rows)
    optimizer = make_adamw(draft, cfg.learning_rate, cfg.weight_decay)
    model, optimizer, loader = accelerator.prepare(draft, optimizer, make_loader(train_rows, cfg.batch_size, pad_id))
    capturer = Capturer(target, objective.hidden_layers, objective.needs_logits, offline=cfg.capture.mode == "offline")

    def loss_fn(model, batch):
        return objective.loss(model, batch, capturer(batch))

    evaluate = None
    if eval_rows is not None:
        eval_loader = accelerator.prepare(DataLoader(eval_rows, batch_size=cfg.batch_size, collate_fn=partial(collate, pad_id=pad_id)))

        def evaluate(model):
            heldout = heldout_metrics(model, eval_loader, loss_fn, cfg.eval_batches, accelerator)
            return {"heldout": heldout, "heldout_loss": heldout["loss"]}

    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(config_text)
    if accelerator.log_with:
        config = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flatten(dataclasses.asdict(cfg)).items()}
        accelerator.init_trackers(
            cfg.project, config=config, init_kwargs={"wandb": {"dir": str(run_dir), "name": Path(cfg.output_dir).name}}
        )
    state = fit(
        model, optimizer, loader, loss_fn, cfg, accelerator, run_dir, evaluate, {CONFIG_FILE: config_text}, cfg.type, interrupt_after_steps
    )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        export(cfg, objective, accelerator.unwrap_model(model), tokenizer, state.curve, config_text)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return Path(cfg.output_dir)


def training_rows(cfg: TrainConfig, target, tokenizer, run_dir: Path, accelerator: Accelerator):
    """(train rows, eval rows or None): built from the data files (online), or the offline capture's shards."""
    if cfg.capture.mode == "offline":
        capture_dir = Path(cfg.capture.dir or run_dir / "capture")
        read_manifest(capture_dir, offline_key(cfg, target, make_objective(cfg)))
        eval_dir = capture_dir / "eval"
        return CapturedRows(capture_dir / "train"), (CapturedRows(eval_dir) if cfg.data.eval_files and eval_dir.is_dir() else None)
    with accelerator.main_process_first():  # the main process tokenizes / generates and caches; the others reuse
        train_rows = build_dataset(cfg, cfg.data.train_files, tokenizer, target, run_dir, cfg.data.max_documents)
        eval_rows = build_dataset(eval_config(cfg), cfg.data.eval_files, tokenizer, target, run_dir) if cfg.data.eval_files else None
    return train_rows, eval_rows


def export(cfg: TrainConfig, objective: Objective, draft, tokenizer, curve: list[dict], config_text: str) -> Path:
    """Write ``output_dir`` atomically: the objective's files, the resolved recipe, the loss curve and held-out metrics."""

    evals = [p["heldout"] for p in curve if "heldout" in p]
    with atomic_directory(cfg.output_dir) as out:
        objective.export(draft, out, tokenizer, getattr(torch, cfg.save_dtype), evals[-1] if evals else None)
        (out / CONFIG_FILE).write_text(config_text)
        (out / "loss_curve.json").write_text(json.dumps(curve))
        plot_curve(curve, out / "loss_curve.png", title=f"{cfg.type} training", ylabel="loss (per token)")
        if evals:
            (out / "heldout_metrics.json").write_text(json.dumps({"start": evals[0], "end": evals[-1]}, indent=1) + "\n")
    return Path(cfg.output_dir)


def run(cfg: TrainConfig, interrupt_after_steps: int = 0) -> Path:
    """``train`` with the recipe's thread count, restoring the caller's afterwards."""
    with torch_threads(cfg.threads):
        return train(cfg, interrupt_after_steps)


def main(argv: list[str] | None = None) -> None:
    recipe_command(argv, __doc__.splitlines()[0], load_config, run, lambda out: f"draft written to {out}")


if __name__ == "__main__":
    main()
