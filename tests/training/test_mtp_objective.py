"""The MTP objective through the training loop: the demo recipe on a tiny target, end to end."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from draftsmith.proposers import load_proposer
from draftsmith.training.recipe import load_config
from draftsmith.training.train import run
from draftsmith.verify import SpeculativeDecoder, load_target

from tiny_recipe import REPO, recipe_overrides


def test_mtp_recipe_trains_modules_that_draft_losslessly(target_dir, text_file, tmp_path):
    before = load_file(str(target_dir / "model.safetensors"))
    keep = [o for o in recipe_overrides(target_dir, text_file, tmp_path) if not o.startswith("draft.")]
    overrides = [*keep, f"data.eval_files=[{text_file}]", "eval_batches=2", "draft.num_modules=2", "max_steps=20"]
    out = run(load_config(REPO / "recipes" / "training" / "mtp_demo.yaml", overrides))
    after = load_file(str(target_dir / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # the frozen target was never written
    metrics = json.loads((out / "heldout_metrics.json").read_text())
    assert metrics["end"]["loss"] < metrics["start"]["loss"]
    assert {"acc0", "acc1", "kl0", "kl1"} <= set(metrics["end"])  # agreement per module
    target, tokenizer = load_target(target_dir)
    proposer = load_proposer({"type": "mtp", "model": str(out)}, target=target)
    ids = tokenizer("def f3(x):\n    return", return_tensors="pt").input_ids
    plain = SpeculativeDecoder(target).generate(ids, max_new_tokens=24)
    assert SpeculativeDecoder(target, proposer, adaptive=False).generate(ids, max_new_tokens=24).new_tokens == plain.new_tokens
