"""The training seam: capture (online and offline) and a toy head objective trained by the family-agnostic loop.

The toy objective is what a head family is, in miniature: one linear layer reading a
captured hidden layer of the frozen target, trained toward the target's next-token
distribution. It is registered in the test only: nothing in ``training`` knows it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

import draftsmith.training.capture as capture_module
from draftsmith.proposers.core.errors import ConfigError
from draftsmith.training.capture import CapturedRows, Capturer, capture
from draftsmith.training.commands import capture_offline
from draftsmith.training.data import build_dataset, make_loader
from draftsmith.training.losses import forward_kl, top1_agreement
from draftsmith.training.objective import OBJECTIVES
from draftsmith.training.recipe import load_config, make_objective
from draftsmith.training.train import load_frozen_target, run

from tiny_recipe import REPO, recipe_overrides


class ToyProbe:
    """A linear probe on one captured target layer, predicting the target's next-token distribution."""

    needs_logits = True

    def __init__(self, layer: int = 1):
        self.hidden_layers = (layer,)

    def check(self, target, tokenizer) -> None:
        pass

    def build(self, target, tokenizer, rows=None) -> nn.Module:
        return nn.Linear(target.config.hidden_size, target.config.vocab_size, bias=False)

    def loss(self, probe, batch, captured):
        (hidden,) = captured.hidden.values()  # [batch, seq, hidden]
        logits = probe(hidden)  # [batch, seq, vocab]
        loss = forward_kl(logits, captured.logits, batch["loss_mask"])
        return loss, {"top1": top1_agreement(logits.detach(), captured.logits, batch["loss_mask"])}

    def export(self, probe, out_dir: Path, tokenizer, dtype, heldout=None) -> None:
        save_file({"weight": probe.weight.detach().to(dtype).contiguous()}, str(out_dir / "model.safetensors"))
        (out_dir / "config.json").write_text(json.dumps({"in_features": probe.in_features, "out_features": probe.out_features}))


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(OBJECTIVES, "toy_probe", ToyProbe)


def toy_config(target_dir, text_file, root: Path, *extra: str):
    overrides = [o for o in recipe_overrides(target_dir, text_file, root) if not o.startswith("draft.")]
    extra = ("type=toy_probe", "draft={layer: 1}", "learning_rate=0.3", f"capture.dir={root / 'capture'}", *extra)
    return load_config(REPO / "recipes" / "training" / "distill_draft_full.yaml", [*overrides, *extra])


def test_hidden_layer_convention_is_output_hidden_states(target_dir):
    """0 = embeddings, N = -1 = the final normed state the LM head reads (the convention documented in training.capture)."""
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    got = capture(target, ids, layers=(0, 2, -1))
    assert torch.equal(got.hidden[0], target.get_input_embeddings()(ids))
    assert torch.equal(got.hidden[2], got.hidden[-1])  # 2 layers: index 2 is the last
    assert torch.equal(target.lm_head(got.hidden[-1]), got.logits)


def test_online_and_offline_batches_are_identical(toy, target_dir, text_file, tmp_path):
    cfg = toy_config(target_dir, text_file, tmp_path)
    manifest = capture_offline(cfg)
    assert manifest["complete"] and manifest["layers"] == [1, 2]  # the probe's layer, and the final state for the logits
    target, tokenizer = load_frozen_target(cfg, torch.device("cpu"))
    objective = make_objective(cfg)
    rows = build_dataset(cfg, cfg.data.train_files, tokenizer, target, tmp_path / "run")
    stored = CapturedRows(tmp_path / "capture" / "train")
    assert len(stored) == len(rows)
    online = Capturer(target, objective.hidden_layers, True, offline=False)
    offline = Capturer(target, objective.hidden_layers, True, offline=True)
    batches = 0
    for seed in (0, 1):  # the same shuffle for both, as accelerate's seeded sampler gives them
        torch.manual_seed(seed)
        online_batches = list(make_loader(rows, 4, tokenizer.pad_token_id))
        torch.manual_seed(seed)
        offline_batches = list(make_loader(stored, 4, tokenizer.pad_token_id))
        for a, b in zip(online_batches, offline_batches, strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
            got_a, got_b = online(a), offline(b)
            assert torch.equal(got_a.logits, got_b.logits)
            assert got_a.hidden.keys() == got_b.hidden.keys() == {1}
            assert torch.equal(got_a.hidden[1], got_b.hidden[1])
            batches += 1
    assert batches == 2 * (len(rows) // 4)


def test_a_toy_head_trains_through_the_loop_online_and_offline_alike(toy, target_dir, text_file, tmp_path):
    online = run(toy_config(target_dir, text_file, tmp_path / "online", "max_steps=12", "log_every=1"))
    curve = [p["train_loss"] for p in json.loads((online / "loss_curve.json").read_text()) if "train_loss" in p]
    assert len(curve) == 12 and sum(curve[-3:]) < 0.8 * sum(curve[:3])  # the probe learns
    weight = load_file(online / "model.safetensors")["weight"]
    torch.manual_seed(0)
    assert not torch.equal(weight, nn.Linear(32, weight.shape[0], bias=False).weight)
    # offline: capture once, then train from the shards; the same seed gives the same losses
    cfg = toy_config(target_dir, text_file, tmp_path / "offline", "max_steps=12", "log_every=1", "capture.mode=offline")
    with pytest.raises(FileNotFoundError, match="holds no offline capture"):
        run(cfg)
    capture_offline(cfg)
    offline = run(cfg)
    offline_curve = [p["train_loss"] for p in json.loads((offline / "loss_curve.json").read_text()) if "train_loss" in p]
    assert offline_curve == curve
    assert torch.equal(load_file(offline / "model.safetensors")["weight"], weight)


def test_offline_capture_prints_its_size_refuses_above_the_limit_and_resumes(toy, target_dir, text_file, tmp_path, capsys, monkeypatch):
    cfg = toy_config(target_dir, text_file, tmp_path, "capture.max_gb=0.000001", "capture.rows_per_shard=20")
    with pytest.raises(ConfigError, match=r"over capture.max_gb=1e-06"):
        capture_offline(cfg)
    # tokens x layers x hidden x bytes: 81 blocks of 32 tokens, layers [1, 2], hidden 32, fp32
    assert "2,592 tokens x 2 layers [1, 2] x 32 hidden x 4 bytes = 663,552 bytes" in capsys.readouterr().out
    cfg = toy_config(target_dir, text_file, tmp_path, "capture.rows_per_shard=20")
    write = capture_module.write_shards

    def one_shard_then_die(target, rows, out_dir, *args, **kwargs):
        write(target, rows.select(range(20)), out_dir, *args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(capture_module, "write_shards", one_shard_then_die)
        capture_offline(cfg)
    first = tmp_path / "capture" / "train" / "shard_00000.safetensors"
    stamp = first.stat().st_mtime_ns
    with pytest.raises(ConfigError, match="incomplete"):
        run(toy_config(target_dir, text_file, tmp_path, "capture.rows_per_shard=20", "capture.mode=offline"))
    manifest = capture_offline(cfg)
    assert manifest["complete"] and manifest["splits"]["train"] == {"rows": 81, "shards": 5}
    assert first.stat().st_mtime_ns == stamp  # kept, not rewritten
    assert len(CapturedRows(tmp_path / "capture" / "train")) == 81
    # a recipe whose data differs does not read these features
    other = toy_config(target_dir, text_file, tmp_path, "capture.mode=offline", "data.block_size=16")
    with pytest.raises(ConfigError, match="captured for another target, data or layers"):
        run(other)


def test_unknown_objective_keys_fail_before_any_work(toy, target_dir, text_file, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['draft.width'\]; valid keys: \['draft.layer'\]"):
        toy_config(target_dir, text_file, tmp_path, "draft.width=3")
