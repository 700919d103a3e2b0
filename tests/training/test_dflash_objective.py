"""The drafters of every depth in one forward through the training loop: DFlash's recipe end to end (online and
offline capture alike), the parallel EAGLE-3 recipe (one key away from the sequential one), bad recipe keys."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.errors import InputError
from draftsmith.training.commands import capture_offline
from draftsmith.training.recipe import load_config
from draftsmith.training.train import run
from draftsmith.verify import SpeculativeDecoder, load_target

from tiny_recipe import REPO, recipe_overrides


def dflash_config(target_dir, text_file, root, *extra):
    keep = [o for o in recipe_overrides(target_dir, text_file, root) if not o.startswith("draft.")]
    overrides = [*keep, "draft.block_size=4", "draft.num_layers=1", "draft.aux_layers=[1,2,3]", "draft.anchors_per_row=8", *extra]
    return load_config(REPO / "recipes" / "training" / "dflash_demo.yaml", overrides)


def train_losses(out) -> list[float]:
    return [p["train_loss"] for p in json.loads((out / "loss_curve.json").read_text()) if "train_loss" in p]


def drafts_losslessly(out, target_dir, config: dict) -> None:
    target, tokenizer = load_target(target_dir)
    proposer = load_proposer({**config, "model": str(out)}, target=target)
    ids = tokenizer("def f3(x):\n    return", return_tensors="pt").input_ids
    plain = SpeculativeDecoder(target).generate(ids, max_new_tokens=24)
    assert SpeculativeDecoder(target, proposer, adaptive=False).generate(ids, max_new_tokens=24).new_tokens == plain.new_tokens


def test_dflash_recipe_trains_alike_from_online_and_offline_capture(deep_target_dir, text_file, tmp_path):
    before = load_file(str(deep_target_dir / "model.safetensors"))

    def config(root, *extra):
        return dflash_config(deep_target_dir, text_file, root, "max_steps=8", f"data.eval_files=[{text_file}]", "eval_batches=2", *extra)

    online = run(config(tmp_path / "online"))
    offline_cfg = config(tmp_path / "offline", "capture.mode=offline", f"capture.dir={tmp_path / 'capture'}")
    manifest = capture_offline(offline_cfg)
    assert manifest["layers"] == [1, 2, 3, 4]  # the aux layers and the final state (for the logits)
    offline = run(offline_cfg)
    after = load_file(str(deep_target_dir / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # the frozen target was never written
    # anchors are drawn from torch's seeded generator, so both runs see the same blocks
    assert train_losses(online) == train_losses(offline) and train_losses(online)[-1] < train_losses(online)[0]
    metrics = json.loads((online / "heldout_metrics.json").read_text())
    assert metrics["end"]["loss"] < metrics["start"]["loss"] and {"acc0", "acc1", "acc2", "kl2"} <= set(metrics["end"])
    config_json = json.loads((online / "config.json").read_text())
    assert config_json["dflash_config"]["target_layer_ids"] == [0, 1, 2] and config_json["dflash_config"]["block_size"] == 4
    drafts_losslessly(online, deep_target_dir, {"type": "dflash", "tree_width": 2, "max_nodes": 5})


def test_the_parallel_eagle3_recipe_is_the_sequential_one_with_one_key(deep_target_dir, text_file, tmp_path):
    keep = [o for o in recipe_overrides(deep_target_dir, text_file, tmp_path) if not o.startswith("draft.")]
    overrides = [*keep, "draft.aux_layers=[1,2,3]", "draft.draft_vocab_size=120", "draft.ttt_steps=3", "max_steps=6"]
    sequential = load_config(REPO / "recipes" / "training" / "eagle3_demo.yaml", overrides)
    parallel = load_config(REPO / "recipes" / "training" / "eagle3_parallel_demo.yaml", overrides)
    differing = {k for k in vars(sequential) if getattr(sequential, k) != getattr(parallel, k)}
    assert differing == {"draft"} and {k for k in parallel.draft if parallel.draft[k] != sequential.draft.get(k)} == {"parallel"}
    out = run(parallel)
    written = load_file(str(out / "model.safetensors"))
    config_json = json.loads((out / "config.json").read_text())
    assert written["mask_hidden"].shape == (3 * 32,) and config_json["draftsmith_eagle"]["parallel_depth"] == 3
    assert train_losses(out)[-1] < train_losses(out)[0]
    drafts_losslessly(out, deep_target_dir, {"type": "eagle", "k": 3, "tree_width": 2, "max_nodes": 5})


@pytest.mark.parametrize(
    "override, message",
    [
        ("draft.block_size=1", "draft.block_size must be >= 2"),
        ("draft.anchors_per_row=0", "draft.anchors_per_row must be >= 1"),
        ("draft.loss=kl", r"key 'draft.loss': 'kl' is not one of \['forward_kl', 'cross_entropy'\]"),
        ("draft.aux_layers=[1,2,4]", r"aux_layers \[1, 2, 4\] must be ascending ids of layer outputs in \[1, 3\]"),
        ("draft.num_heads=3", "is not a multiple of num_kv_heads"),
        ("draft.block_sise=4", "block_sise"),
    ],
)
def test_bad_recipe_keys_are_refused(override, message, deep_target_dir, text_file, tmp_path):
    with pytest.raises(InputError, match=message):
        run(dflash_config(deep_target_dir, text_file, tmp_path, override))
