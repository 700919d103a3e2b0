"""The trainer's commands beside a training run: the offline capture of a recipe's features, and Medusa's calibration.

``draftsmith capture`` and ``draftsmith calibrate`` call these; they use the capture, data
and loop libraries, which never import them.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.medusa_head import CALIBRATION, check_heads_fit, load_heads, write_calibration

from .capture import Capturer, capture_dataset, offline_key, stored_layers
from .data import build_dataset, check_files, collate, eval_config
from .loop import heldout_metrics, make_accelerator
from .medusa import MIN_RANKS, MedusaObjective, path_counts, rank_accuracy
from .recipe import TrainConfig, make_objective, run_dir_of
from .train import load_frozen_target


def capture_offline(cfg: TrainConfig) -> dict:
    """Write a training recipe's train (and eval) rows with the target's features as safetensors shards; resumable."""
    objective, run_dir = make_objective(cfg), run_dir_of(cfg)
    check_files(cfg.data.train_files + cfg.data.eval_files, cfg.data)
    target, tokenizer = load_frozen_target(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    splits = {"train": build_dataset(cfg, cfg.data.train_files, tokenizer, target, run_dir, cfg.data.max_documents)}
    if cfg.data.eval_files:
        splits["eval"] = build_dataset(eval_config(cfg), cfg.data.eval_files, tokenizer, target, run_dir)
    objective.check(target, tokenizer)
    layers = stored_layers(target, objective.hidden_layers, objective.needs_logits)
    key = offline_key(cfg, target, objective)
    return capture_dataset(target, splits, Path(cfg.capture.dir or run_dir / "capture"), layers, key, cfg.capture)


def calibrate(cfg: TrainConfig) -> Path:
    """Measure the Medusa heads in the recipe's ``output_dir`` on its eval files and (re)write their ``calibration.json``.

    For heads trained before path counts existed, or elsewhere (a FasterDecoding
    checkpoint loaded by ``load_heads``): the same held-out evaluation as at the end of
    training, without training.
    """
    objective = make_objective(cfg)
    if not isinstance(objective, MedusaObjective):
        raise InputError(f"calibrate measures Medusa heads: the recipe's type is {cfg.type!r}, not 'medusa'")
    if not cfg.data.eval_files:
        raise InputError("calibration measures the heads on held-out text: give data.eval_files")
    out = Path(cfg.output_dir)
    accelerator = make_accelerator(cfg, run_dir_of(cfg))
    target, tokenizer = load_frozen_target(cfg, accelerator.device)
    heads = load_heads(out)
    check_heads_fit(heads, target)
    heads = heads.to(accelerator.device).eval()
    rows = build_dataset(eval_config(cfg), cfg.data.eval_files, tokenizer, target, run_dir_of(cfg))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    loader = DataLoader(rows, batch_size=cfg.batch_size, collate_fn=partial(collate, pad_id=pad_id))
    capturer = Capturer(target, objective.hidden_layers, objective.needs_logits, offline=False)
    objective.ranks = max(objective.ranks, MIN_RANKS)
    heldout = heldout_metrics(
        heads, loader, lambda model, batch: objective.loss(model, batch, capturer(batch)), cfg.eval_batches, accelerator
    )
    counts = path_counts(objective.path_histogram, heads.num_heads, objective.ranks)
    accuracy = rank_accuracy(heldout, heads.num_heads, objective.ranks)
    write_calibration(out, accuracy, int(heldout["tokens"]), objective.max_nodes, counts)
    return out / CALIBRATION
