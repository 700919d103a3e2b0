"""The EAGLE objective through the training loop: EAGLE-3's recipe end to end, offline capture, bad recipe keys."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.errors import InputError
from draftsmith.training.commands import capture_offline
from draftsmith.training.data import build_dataset
from draftsmith.training.eagle import ancestor_attention, most_frequent, token_frequencies
from draftsmith.training.recipe import load_config
from draftsmith.training.train import load_frozen_target, run
from draftsmith.verify import SpeculativeDecoder, load_target

from tiny_recipe import REPO, recipe_overrides


def eagle_overrides(target_dir, text_file, root, *extra):
    keep = [o for o in recipe_overrides(target_dir, text_file, root) if not o.startswith("draft.")]
    return [*keep, f"data.eval_files=[{text_file}]", "eval_batches=2", *extra]


def eagle3_config(target_dir, text_file, root, *extra):
    overrides = eagle_overrides(target_dir, text_file, root, "draft.aux_layers=[1,2,3]", "draft.draft_vocab_size=120", "draft.ttt_steps=3")
    return load_config(REPO / "recipes" / "training" / "eagle3_demo.yaml", [*overrides, *extra])


def test_eagle3_recipe_trains_a_head_that_drafts_losslessly(deep_target_dir, text_file, tmp_path):
    before = load_file(str(deep_target_dir / "model.safetensors"))
    cfg = eagle3_config(deep_target_dir, text_file, tmp_path, "max_steps=25")
    out = run(cfg)
    after = load_file(str(deep_target_dir / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # the frozen target was never written
    metrics = json.loads((out / "heldout_metrics.json").read_text())
    assert metrics["end"]["loss"] < metrics["start"]["loss"]
    assert {"acc0", "acc1", "acc2", "kl0", "kl1", "kl2"} <= set(metrics["end"])  # acceptance per unrolled step
    target, tokenizer = load_target(deep_target_dir)
    # the draft vocabulary: the 120 most frequent tokens of the training rows
    rows = build_dataset(cfg, cfg.data.train_files, tokenizer, target, tmp_path / "run")
    wanted = most_frequent(token_frequencies(rows, 300), 120)
    written = load_file(str(out / "model.safetensors"))
    assert torch.equal(torch.arange(120) + written["d2t"], wanted) and int(written["t2d"].sum()) == 120
    proposer = load_proposer({"type": "eagle", "model": str(out), "tree_width": 2, "max_nodes": 8, "k": 4}, target=target)
    ids = tokenizer("def f3(x):\n    return", return_tensors="pt").input_ids
    plain = SpeculativeDecoder(target).generate(ids, max_new_tokens=24)
    assert SpeculativeDecoder(target, proposer, adaptive=False).generate(ids, max_new_tokens=24).new_tokens == plain.new_tokens


def test_eagle1_trains_alike_from_online_and_offline_capture(target_dir, text_file, tmp_path):
    def config(root, *extra):
        overrides = eagle_overrides(target_dir, text_file, root, "data.eval_files=[]", "max_steps=6", f"capture.dir={root / 'capture'}")
        return load_config(REPO / "recipes" / "training" / "eagle1_demo.yaml", [*overrides, *extra])

    online = run(config(tmp_path / "online"))
    offline_cfg = config(tmp_path / "offline", "capture.mode=offline")
    capture_offline(offline_cfg)
    offline = run(offline_cfg)
    losses = [
        [p["train_loss"] for p in json.loads((out / "loss_curve.json").read_text()) if "train_loss" in p] for out in (online, offline)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 6
    assert losses[0][-1] < losses[0][0]


def test_offline_capture_stores_eagle3s_default_aux_layers(deep_target_dir, text_file, tmp_path):
    """Without aux_layers in the recipe the ids come from the target ([1, 2, 3] for 4 layers) and the capture stores them."""
    overrides = eagle_overrides(deep_target_dir, text_file, tmp_path, "data.eval_files=[]", f"capture.dir={tmp_path / 'capture'}")
    cfg = load_config(
        REPO / "recipes" / "training" / "eagle3_demo.yaml", [*overrides, "draft.aux_layers=null", "draft.draft_vocab_size=null"]
    )
    manifest = capture_offline(cfg)
    assert manifest["layers"] == [1, 2, 3, 4]  # the aux layers and the final state (for the logits)
    target, _ = load_frozen_target(cfg, torch.device("cpu"))
    assert target.config.num_hidden_layers == 4


@pytest.mark.parametrize(
    "override, message",
    [
        ("draft.version=2", "draft.version must be 1 or 3, got 2"),
        ("draft.ttt_steps=0", "draft.ttt_steps must be >= 1"),
        ("draft.decay=.nan", "draft.decay must be a finite number >= 0"),
        ("draft.draft_vocab_size=0", "draft.draft_vocab_size must be >= 1"),
        ("draft.aux_layers=[0,1,5]", r"aux_layers \[0, 1, 5\] must be ascending ids of layer outputs in \[1, 3\]"),
    ],
)
def test_bad_recipe_keys_are_refused(override, message, deep_target_dir, text_file, tmp_path):
    with pytest.raises(InputError, match=message):
        run(eagle3_config(deep_target_dir, text_file, tmp_path, override))
    with pytest.raises(InputError, match="EAGLE-3 keys"):
        load_config(
            REPO / "recipes" / "training" / "eagle1_demo.yaml",
            eagle_overrides(deep_target_dir, text_file, tmp_path, "draft.draft_vocab_size=10"),
        )


def test_eagle3_heads_start_from_the_targets_lm_head_rows_and_final_norm(make_llama):
    """A fresh EAGLE-3 draft scores in the target's output space: its LM head is the target's rows of the draft vocabulary."""
    from draftsmith.training.eagle import EagleObjective

    target = make_llama(layers=6, seed=7)
    with torch.no_grad():
        target.model.norm.weight.uniform_(0.5, 1.5)
    rows = [{"input_ids": list(range(40, 100)) * 3 + list(range(0, 128))}]
    draft = EagleObjective(version=3, aux_layers=[2, 3, 5], draft_vocab_size=64).build(target, None, rows)
    ids = draft.draft_to_target()
    assert set(range(40, 100)) <= set(ids.tolist())  # the most frequent ids are the draft vocabulary
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[ids])
    assert torch.equal(draft.norm.weight, target.model.norm.weight)


def dense_ancestor_attention(q, keys, own_visible=True):
    """The reference: one masked softmax over [context rows <= i, row i of each later step], built densely."""
    rows = q.shape[-2]
    scale = q.shape[-1] ** -0.5
    context = (q @ keys[0][0].transpose(-1, -2)) * scale
    context = context.masked_fill(~torch.ones(rows, rows, dtype=torch.bool).tril(), float("-inf"))
    own = torch.stack([(q * k).sum(-1) * scale for k, _ in keys[1:]], dim=-1)
    if not own_visible:  # negative control: the ancestors' entries dropped from the softmax
        own = torch.full_like(own, float("-inf"))
    weights = torch.softmax(torch.cat([context, own], dim=-1), dim=-1)
    out = weights[..., :rows] @ keys[0][1]
    for s, (_, v) in enumerate(keys[1:]):
        out = out + weights[..., rows + s : rows + s + 1] * v
    return out


@pytest.mark.parametrize("steps", [1, 3])
def test_ancestor_attention_values_and_gradients_equal_the_dense_softmax(steps):
    generator = torch.Generator().manual_seed(steps)

    def leaf(*shape):
        return (3 * torch.randn(*shape, generator=generator, dtype=torch.float64)).requires_grad_()

    q = leaf(2, 3, 9, 4)
    keys = [(leaf(2, 3, 9, 4), leaf(2, 3, 9, 4)) for _ in range(steps + 1)]
    inputs = [q] + [t for pair in keys for t in pair]
    seed = torch.randn(2, 3, 9, 4, generator=generator, dtype=torch.float64)
    got = ancestor_attention(q, keys)
    grads = torch.autograd.grad((got * seed).sum(), inputs)
    for own_visible, should_match in ((True, True), (False, False)):
        want = dense_ancestor_attention(q, keys, own_visible)
        want_grads = torch.autograd.grad((want * seed).sum(), inputs, allow_unused=True)  # the control leaves k unused
        want_grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, want_grads, strict=True)]
        pairs = [(got, want), *zip(grads, want_grads, strict=True)]
        match = all(torch.allclose(a, b, atol=1e-10) for a, b in pairs)
        assert match == should_match, f"own entries visible: {own_visible}"


def test_a_second_stage_starts_from_the_first_stages_head(deep_target_dir, text_file, tmp_path):
    first = run(eagle3_config(deep_target_dir, text_file, tmp_path / "first", "max_steps=8"))
    second = run(eagle3_config(deep_target_dir, text_file, tmp_path / "second", "max_steps=2", f"draft.init_from={first}"))
    end, start = (json.loads((d / "heldout_metrics.json").read_text()) for d in (first, second))
    assert start["start"]["loss"] == pytest.approx(end["end"]["loss"], rel=1e-5)  # the same head on the same held-out rows
    written = load_file(str(second / "model.safetensors"))
    assert torch.equal(written["d2t"], load_file(str(first / "model.safetensors"))["d2t"])  # the first stage's vocabulary
    fresh = run(eagle3_config(deep_target_dir, text_file, tmp_path / "fresh", "max_steps=2"))
    fresh = json.loads((fresh / "heldout_metrics.json").read_text())
    assert fresh["start"]["loss"] > end["end"]["loss"]  # negative control: a fresh head starts elsewhere


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("draft.draft_vocab_size=100", "has draft_vocab_size 120, this recipe asks for 100"),
        ("draft.intermediate_size=24", "has intermediate_size [0-9]+, this recipe asks for 24"),
    ],
)
def test_a_start_of_another_shape_is_refused(override, message, deep_target_dir, text_file, tmp_path):
    first = run(eagle3_config(deep_target_dir, text_file, tmp_path / "first", "max_steps=1"))
    with pytest.raises(InputError, match=message):
        run(eagle3_config(deep_target_dir, text_file, tmp_path / "second", f"draft.init_from={first}", override))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run(eagle3_config(deep_target_dir, text_file, tmp_path / "third", f"draft.init_from={tmp_path / 'nothing'}"))
