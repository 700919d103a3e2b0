"""The Medusa objective: which token each head learns, the recipe end to end, bad recipe keys."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.static_tree import grow_tree_by_frequency
from draftsmith.proposers.medusa_head import MedusaHeads, parse_path_counts
from draftsmith.training.capture import Captured
from draftsmith.training.medusa import MedusaObjective, rank_accuracy
from draftsmith.training.recipe import load_config
from draftsmith.training.train import run
from draftsmith.verify import SpeculativeDecoder, load_target

from tiny_recipe import REPO, recipe_overrides

CYCLE = [7, 3, 11, 5, 2, 13, 9, 0, 6, 12, 1, 4]  # a permutation of 14 tokens' first 12: every token has one successor


@pytest.mark.parametrize("loss", ["forward_kl", "cross_entropy"])
def test_head_k_learns_the_token_k_plus_one_places_ahead(loss):
    """On a cyclic sequence, head k fed token a's state must answer the token k + 1 places after a.

    The hidden state of a position is the one-hot of its token and the target's logits
    put all mass on the next token, so the answer is known exactly; a head trained on
    the wrong offset learns another permutation and fails.
    """
    vocab, heads_count = 14, 3
    sequence = torch.tensor([CYCLE * 6])  # [1, 72]
    hidden = torch.nn.functional.one_hot(sequence, vocab).float() * 4.0  # [1, seq, vocab] as the "hidden size"
    target_logits = torch.full((1, sequence.shape[1], vocab), -20.0)
    target_logits[0, :-1].scatter_(-1, sequence[0, 1:, None], 20.0)  # row t: the token at t + 1
    batch = {"input_ids": sequence, "loss_mask": torch.ones_like(sequence, dtype=torch.bool)}
    torch.manual_seed(0)
    heads = MedusaHeads(vocab, vocab, heads_count)
    torch.nn.init.normal_(torch.stack([h.weight for h in heads.lm_heads]), std=0.1)
    objective = MedusaObjective(num_heads=heads_count, loss=loss)
    optimizer = torch.optim.Adam(heads.parameters(), lr=0.05)
    for _ in range(150):
        value, _ = objective.loss(heads, batch, Captured(target_logits, {-1: hidden}))
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    heads.eval()
    _, metrics = objective.loss(heads, batch, Captured(target_logits, {-1: hidden}))
    with torch.no_grad():
        guesses = heads(torch.eye(vocab) * 4.0).argmax(-1)  # [heads, vocab]: each head's guess after each token
    for k in range(1, heads_count + 1):
        for i, token in enumerate(CYCLE):
            assert int(guesses[k - 1, token]) == CYCLE[(i + k + 1) % len(CYCLE)], (k, token)
        assert float(metrics[f"h{k}_top1"]) > 0.95  # the last k positions have no answer and are masked out
    assert {f"h{k}_top{r}" for k in (1, 2, 3) for r in range(1, 9)} <= set(metrics)


def test_rank_accuracy_is_the_difference_of_top_r_accuracies():
    heldout = {"h1_top1": 0.5, "h1_top2": 0.6, "h1_top3": 0.6, "h2_top1": 0.25, "h2_top2": 0.3, "h2_top3": 0.45}
    assert rank_accuracy(heldout, 2, 3) == [[0.5, 0.1, 0.0], [0.25, 0.05, 0.15]]


def medusa_overrides(target_dir, text_file, root, *extra):
    keep = [o for o in recipe_overrides(target_dir, text_file, root) if not o.startswith("draft.")]
    return [*keep, f"data.eval_files=[{text_file}]", "draft.num_heads=3", "draft.max_nodes=6", "eval_batches=2", *extra]


def test_recipe_trains_heads_that_draft_losslessly(target_dir, text_file, tmp_path):
    """The shipped recipe on the tiny target: only the heads change, the export loads and drafts with its calibrated tree."""
    cfg = load_config(REPO / "recipes" / "training" / "medusa_demo.yaml", medusa_overrides(target_dir, text_file, tmp_path, "max_steps=30"))
    before = load_file(str(target_dir / "model.safetensors"))
    out = run(cfg)
    after = load_file(str(target_dir / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # the frozen target was never written
    target, tokenizer = load_target(target_dir)
    fresh = MedusaHeads.for_target(target, 3)
    trained = load_file(str(out / "model.safetensors"))
    assert all(not torch.equal(trained[k], v) for k, v in fresh.state_dict().items() if k.startswith("blocks.") and k.endswith("weight"))
    metrics = json.loads((out / "heldout_metrics.json").read_text())
    assert metrics["end"]["loss"] < metrics["start"]["loss"]
    for k in (1, 2, 3):  # top-r accuracy grows with r
        tops = [metrics["end"][f"h{k}_top{r}"] for r in range(1, 9)]
        assert tops == sorted(tops) and tops[-1] > 0
    calibration = json.loads((out / "calibration.json").read_text())
    assert len(calibration["rank_accuracy"]) == 3 and len(calibration["tree"]) <= 6
    # the path counts of the last evaluation agree with its top-1 accuracy: (0,) is head 1's first guess being right
    first = calibration["path_counts"]["0"] / calibration["tokens"]
    assert first == pytest.approx(metrics["end"]["h1_top1"], abs=0.05)
    assert [tuple(p) for p in calibration["tree"]] == grow_tree_by_frequency(parse_path_counts(calibration["path_counts"]), 6)
    proposer = load_proposer({"type": "medusa", "model": str(out)}, target=target)
    assert [list(p) for p in proposer.tree.paths] == sorted(calibration["tree"], key=lambda p: (len(p), p))
    ids = tokenizer("def f3(x):\n    return", return_tensors="pt").input_ids
    plain = SpeculativeDecoder(target).generate(ids, max_new_tokens=24)
    medusa = SpeculativeDecoder(target, proposer, adaptive=False).generate(ids, max_new_tokens=24)
    assert medusa.new_tokens == plain.new_tokens


@pytest.mark.parametrize(
    "override, message",
    [
        ("draft.num_heads=0", "draft.num_heads must be >= 1, got 0"),
        ("draft.decay=0", r"draft.decay must be in \(0, 1\], got 0"),
        ("draft.ranks=3", "draft.ranks must be >= 5"),
        ("draft.max_nodes=0", "draft.max_nodes must be >= 1"),
        ("draft.loss=mse", "draft.loss"),
        ("draft.temperature=.nan", "draft.temperature must be a finite number > 0"),
        ("draft.heads=2", "heads"),
    ],
)
def test_bad_recipe_keys_are_refused(override, message, target_dir, text_file, tmp_path):
    with pytest.raises(InputError, match=message):
        load_config(REPO / "recipes" / "training" / "medusa_demo.yaml", medusa_overrides(target_dir, text_file, tmp_path, override))


def test_pretrained_heads_for_another_target_are_refused(target_dir, text_file, tmp_path):
    MedusaHeads(48, 300, 3).save(tmp_path / "other")
    cfg = load_config(
        REPO / "recipes" / "training" / "medusa_demo.yaml",
        medusa_overrides(target_dir, text_file, tmp_path, f"draft.pretrained={tmp_path / 'other'}"),
    )
    with pytest.raises(InputError, match="hidden size 48, this target's is 32"):
        run(cfg)


def test_calibrate_command_rewrites_the_calibration(target_dir, text_file, tmp_path):
    """``draftsmith calibrate``: heads from elsewhere (no calibration.json) get one from the held-out files."""
    from draftsmith.training.commands import calibrate

    target, _ = load_target(target_dir)
    out = tmp_path / "out"
    MedusaHeads.for_target(target, 3).save(out)
    cfg = load_config(REPO / "recipes" / "training" / "medusa_demo.yaml", medusa_overrides(target_dir, text_file, tmp_path))
    written = calibrate(cfg)
    calibration = json.loads(written.read_text())
    assert calibration["tokens"] > 0 and calibration["path_counts"] and calibration["tree"]
    assert load_proposer({"type": "medusa", "model": str(out)}, target=target).tree.num_nodes == len(calibration["tree"])
    with pytest.raises(InputError, match="give data.eval_files"):
        calibrate(
            load_config(
                REPO / "recipes" / "training" / "medusa_demo.yaml", medusa_overrides(target_dir, text_file, tmp_path, "data.eval_files=[]")
            )
        )
