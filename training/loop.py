"""The training loop every family shares: ``fit`` reads top to bottom like nanoGPT's ``train.py``.

Data, step, log, evaluate, checkpoint. Checkpoints are atomic (``training.common``); a run
started again resumes from the newest one, and SIGTERM / Ctrl-C checkpoint first. The
accelerator decides processes, devices and mixed precision (``make_accelerator``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradientAccumulationPlugin
from tqdm.auto import tqdm

from .common import (
    TrainState,
    all_agree,
    cosine_lr,
    flatten,
    multi_process_cpu,
    resume,
    save_checkpoint,
)
from .recipe import LoopConfig

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
