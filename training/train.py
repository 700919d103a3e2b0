"""Train a draft or heads on a frozen target: one loop for every family.

    accelerate launch -m draftsmith.training.train --config recipes/distill_draft_full.yaml [key=value ...]
    python -m draftsmith.training.train --config recipes/distill_draft_lora.yaml [section.key=value ...]

A recipe names its family by ``type`` (``training.objective.OBJECTIVES``); the family's own
keys sit under ``draft:`` and go to its ``Objective``, which builds the draft, computes its
loss from what ``training.capture`` captured and exports it. Everything else is shared:

- the target is frozen (``requires_grad_(False)``, eval mode), kept out of
  ``accelerator.prepare``, and may be loaded in bf16/fp16 or sharded with ``device_map``;
- data comes from local files through ``datasets`` (``training.data``); the target's
  features are captured online, or read from an offline capture (``capture.mode``);
- ``fit`` reads top to bottom: data, step, log, evaluate, checkpoint. Checkpoints are
  atomic; a run started again resumes from the newest one, and SIGTERM / Ctrl-C
  checkpoint first. The demo target's pretraining (``training.demo.pretrain``) runs the
  same ``fit``;
- the export is atomic too: written beside ``output_dir``, then swapped in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradientAccumulationPlugin, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from draftsmith.proposers.config import ConfigError, build, check_writable, load
from draftsmith.proposers.models import context_limit
from draftsmith.verify.target import load_target

from .capture import CaptureConfig, CapturedRows, Capturer, offline_key, read_manifest
from .common import (
    TrainState,
    all_agree,
    checkpoints,
    config_hash,
    cosine_lr,
    export_atomically,
    flatten,
    make_adamw,
    multi_process_cpu,
    plot_curve,
    recipe_command,
    resume,
    save_checkpoint,
    torch_threads,
)
from .data import DataConfig, build_dataset, check_files, collate, eval_config, make_loader
from .objective import Objective, objective_class

DTYPES = ("float32", "bfloat16", "float16")
Dtype = Literal["float32", "bfloat16", "float16"]
CONFIG_FILE = "training_config.yaml"


# --- config ----------------------------------------------------------------------


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
    target: str = "recipes/demo_target"  # the frozen target: a save_pretrained directory with its tokenizer
    target_dtype: Dtype = "float32"
    target_device_map: str | None = None  # e.g. "auto": shard a large target over the devices (from_pretrained's device_map)
    output_dir: str = "outputs/draft"  # the trained draft, its config and curves
    run_dir: str = ""  # checkpoints and caches ("" = .cache/draftsmith/runs/<output_dir name>)
    draft: dict[str, Any] = field(default_factory=dict)  # the family's own keys (its Objective's arguments)
    data: DataConfig = field(default_factory=DataConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    eval_batches: int = 8


# Keys that do not change what is trained: left out of the hash that guards resuming.
RUNTIME_KEYS = set(
    "output_dir run_dir log_every eval_every eval_batches checkpoint_every keep_checkpoints log_with project threads "
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
    saved, mine = yaml.safe_load((found[-1] / CONFIG_FILE).read_text()), dataclasses.asdict(cfg)
    if config_hash(saved, exclude=RUNTIME_KEYS) != config_hash(mine, exclude=RUNTIME_KEYS):
        ours, theirs = flatten(mine), flatten(saved)
        differ = sorted(k for k in set(ours) | set(theirs) if k not in RUNTIME_KEYS and ours.get(k) != theirs.get(k))
        raise ConfigError(
            f"run_dir {run_dir} holds checkpoints of a different recipe (differing keys: {differ}); "
            f"resume with the same recipe, or give another run_dir / delete {run_dir}"
        )


def load_frozen_target(cfg: TrainConfig, device: torch.device):
    """The target in eval mode with no trainable parameter (on ``device`` unless sharded by ``target_device_map``); and its tokenizer."""
    target, tokenizer = load_target(cfg.target, cfg.target_dtype, cfg.target_device_map)
    if cfg.target_device_map is None:
        target = target.to(device)
    return target.eval().requires_grad_(False), tokenizer


# --- the loop --------------------------------------------------------------------

LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def make_accelerator(cfg: LoopConfig, run_dir: Path) -> Accelerator:
    precision = cfg.mixed_precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    log_with = None if cfg.log_with == "none" else cfg.log_with
    if log_with == "wandb" and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")  # never ask for a login; `wandb sync` uploads later
    return Accelerator(
        cpu=multi_process_cpu(),
        mixed_precision=precision,
        # Steps are counted across epoch ends, so a resumed run sees the same micro-batches per step.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.gradient_accumulation_steps, sync_with_dataloader=False),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed),
        log_with=log_with,
        project_dir=str(run_dir),
    )


def log_point(state: TrainState, window: list[list[float]], names: list[str], lr: float, accelerator: Accelerator) -> dict:
    """Append the means of the steps since the last point (over all processes) to the curve."""
    means = accelerator.reduce(torch.tensor(window, dtype=torch.float64).mean(dim=0).to(accelerator.device), "mean").cpu()
    point = {"step": state.step, "tokens": state.tokens, "elapsed_s": round(state.elapsed_s, 1), "lr": lr}
    point.update(zip(["train_loss", *names], means.tolist(), strict=True))
    state.curve.append(point)
    return point


@torch.no_grad()
def heldout_metrics(model, loader, loss_fn: LossFn, max_batches: int, accelerator: Accelerator) -> dict:
    """The loss and metrics on the first ``max_batches`` held-out batches, weighted by tokens, over all processes."""
    was_training = model.training
    model.eval()
    names, sums = None, None
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        loss, metrics = loss_fn(model, batch)
        names = names or ["loss", *metrics]
        tokens = float(batch["loss_mask"].sum())
        values = [float(loss), *(float(m) for m in metrics.values())]
        part = torch.tensor([v * tokens for v in values] + [tokens], dtype=torch.float64)
        sums = part if sums is None else sums + part
    model.train(was_training)
    sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu().tolist()
    count = max(sums[-1], 1.0)
    return {**{name: round(total / count, 4) for name, total in zip(names, sums, strict=False)}, "tokens": int(sums[-1])}


def fit(
    model,
    optimizer,
    loader,
    loss_fn: LossFn,
    cfg: LoopConfig,
    accelerator: Accelerator,
    run_dir: Path,
    evaluate: Callable[[torch.nn.Module], dict] | None = None,
    files: dict[str, str] | None = None,
    desc: str = "train",
    interrupt_after_steps: int = 0,
) -> TrainState:
    """Train until ``max_steps`` (or ``max_minutes``); resume from ``run_dir``; return the state with the loss curve.

    Args:
        model, optimizer, loader: already through ``accelerator.prepare``.
        loss_fn: ``(model, batch) -> (loss, metrics)``; ``batch["loss_mask"]`` counts the tokens.
        evaluate: ``model -> {"heldout": ..., "heldout_loss": ...}``, run at the start, every
            ``eval_every`` steps and at the end.
        files: name -> text written into every checkpoint.
        interrupt_after_steps: raise KeyboardInterrupt after this step, as a Ctrl-C would (tests).
    """
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    resume(accelerator, run_dir, state)

    def checkpoint():
        save_checkpoint(accelerator, run_dir, state, cfg.keep_checkpoints, files=files)

    def record_eval():
        point = {"step": state.step, "tokens": state.tokens, "elapsed_s": round(state.elapsed_s, 1), **evaluate(model)}
        state.curve.append(point)
        logged = flatten({k: v for k, v in point.items() if k.startswith("heldout")}, sep="/")
        accelerator.log({k: v for k, v in logged.items() if isinstance(v, float)}, step=state.step)
        accelerator.print(json.dumps(point), flush=True)

    def progress() -> float:
        return state.progress(cfg.max_steps, cfg.max_minutes)

    show = accelerator.is_local_main_process
    bar = tqdm(total=cfg.max_steps, initial=state.step, desc=desc, disable=not show, mininterval=1 if sys.stderr.isatty() else 30)
    if evaluate is not None and state.step == 0:
        record_eval()
    accum = cfg.gradient_accumulation_steps
    started, window, names = time.time() - state.elapsed_s, [], []
    micro = state.step * accum  # micro-batches consumed; checkpoints fall on step boundaries
    model.train()
    try:
        while progress() < 1.0:
            # data: epochs of a seeded shuffle; a resumed run skips what it already trained on
            epoch, offset = divmod(micro, len(loader))
            loader.set_epoch(epoch)
            for batch in accelerator.skip_first_batches(loader, offset) if offset else loader:
                micro += 1
                # step
                with accelerator.accumulate(model):
                    loss, metrics = loss_fn(model, batch)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        lr = cosine_lr(state.step, progress(), cfg.learning_rate, cfg.warmup_steps, cfg.min_lr_ratio)
                        for group in optimizer.param_groups:
                            group["lr"] = lr
                        accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                names = list(metrics)
                window.append([loss.item(), *(m.item() for m in metrics.values())])
                state.tokens += int(batch["loss_mask"].sum()) * accelerator.num_processes
                if not accelerator.sync_gradients:
                    continue
                state.step, state.elapsed_s = state.step + 1, time.time() - started
                bar.update(1)
                done = all_agree(progress() >= 1.0, accelerator)  # a time budget can run out on one process first
                # log
                if state.step % cfg.log_every == 0 or done:
                    point = log_point(state, window, names, lr, accelerator)
                    accelerator.log({f"train/{k}": point[k] for k in ["train_loss", *names]} | {"lr": lr}, step=state.step)
                    bar.set_postfix({k: f"{point[k]:.3f}" for k in ["train_loss", *names][:4]})  # the curve keeps every metric
                    window = []
                # evaluate
                if evaluate is not None and ((cfg.eval_every and state.step % cfg.eval_every == 0) or done):
                    record_eval()
                # checkpoint
                if state.step % cfg.checkpoint_every == 0 or done:
                    checkpoint()
                if state.step == interrupt_after_steps:
                    raise KeyboardInterrupt  # a simulated Ctrl-C, handled like a real one
                if done:
                    break
    except KeyboardInterrupt:
        # Mid-way through an accumulation cycle the weights are still those of the last
        # step; save them with accelerate's micro-step counter at that step's boundary.
        accelerator.step = state.step * accum
        if state.step > 0:
            checkpoint()
            accelerator.print(f"\ninterrupted: checkpoint of step {state.step} in {run_dir}; run again to resume")
        raise
    finally:
        bar.close()
    return state


# --- heads and drafts on a frozen target -------------------------------------------


def train(cfg: TrainConfig, interrupt_after_steps: int = 0) -> Path:
    """Train the recipe's draft, export it and return ``output_dir``; resumes from ``run_dir`` when it holds checkpoints."""
    objective = make_objective(cfg)
    run_dir = run_dir_of(cfg)
    check_files(cfg.data.train_files + cfg.data.eval_files)  # before anything slow
    check_writable(run_dir, "run_dir")
    check_writable(Path(cfg.output_dir).resolve().parent, "the directory of output_dir")
    check_resumable(cfg, run_dir)
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
        read_manifest(capture_dir, offline_key(cfg, target))
        eval_dir = capture_dir / "eval"
        return CapturedRows(capture_dir / "train"), (CapturedRows(eval_dir) if cfg.data.eval_files and eval_dir.is_dir() else None)
    with accelerator.main_process_first():  # the main process tokenizes / generates and caches; the others reuse
        train_rows = build_dataset(cfg, cfg.data.train_files, tokenizer, target, run_dir, cfg.data.max_documents)
        eval_rows = build_dataset(eval_config(cfg), cfg.data.eval_files, tokenizer, target, run_dir) if cfg.data.eval_files else None
    return train_rows, eval_rows


def export(cfg: TrainConfig, objective: Objective, draft, tokenizer, curve: list[dict], config_text: str) -> Path:
    """Write ``output_dir`` atomically: the objective's files, the resolved recipe, the loss curve and held-out metrics."""

    evals = [p["heldout"] for p in curve if "heldout" in p]

    def write(out: Path) -> None:
        objective.export(draft, out, tokenizer, getattr(torch, cfg.save_dtype), evals[-1] if evals else None)
        (out / CONFIG_FILE).write_text(config_text)
        (out / "loss_curve.json").write_text(json.dumps(curve))
        plot_curve(curve, out / "loss_curve.png", title=f"{cfg.type} training", ylabel="loss (per token)")
        if evals:
            (out / "heldout_metrics.json").write_text(json.dumps({"start": evals[0], "end": evals[-1]}, indent=1) + "\n")

    return export_atomically(Path(cfg.output_dir), write)


def run(cfg: TrainConfig, interrupt_after_steps: int = 0) -> Path:
    """``train`` with the recipe's thread count, restoring the caller's afterwards."""
    with torch_threads(cfg.threads):
        return train(cfg, interrupt_after_steps)


def main(argv: list[str] | None = None) -> None:
    recipe_command(argv, __doc__.splitlines()[0], load_config, run, lambda out: f"draft written to {out}")


if __name__ == "__main__":
    main()
