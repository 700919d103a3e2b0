"""DFlash block drafters: the block forward equals the training pass, greedy identity on three architectures
(chain and tree), the sampled law with a negative control, checkpoints, the engine export and bad input.

Drafters are fitted for a few seconds by the DFlash objective's own loss on the target's
greedy continuations (``fit_drafter``), so drafts are accepted often and rejected often.
"""

from __future__ import annotations

import json

import pytest
import torch
from heads import fit, greedy_sequences, tiny_neox, tiny_qwen2
from law import V, assert_control_rejects, assert_law_case
from safetensors.torch import load_file

import draftsmith.training.dflash as dflash_objective
import draftsmith.verify.rejection as rejection
from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.types import ProposeContext, TargetFeatures
from draftsmith.proposers.dflash import DFlashProposer
from draftsmith.proposers.dflash_head import MASK_EMBEDDING, default_dflash_layers, dflash_config_for_target, dflash_for_target
from draftsmith.training.capture import capture
from draftsmith.training.dflash import DFlashObjective, block_logits, choose_anchors
from draftsmith.verify import SpeculativeDecoder

PROMPTS = [[5, 9, 17, 33, 5, 9, 17], [3, 3, 3, 3], [100, 7, 64, 2, 90], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
SHAPES = {"chain": {"k": 4}, "tree": {"k": 4, "tree_width": 3, "max_nodes": 10}}


def fit_drafter(target, block_size: int = 5, steps: int = 200):
    """A drafter fitted by the DFlash objective's own loss to the target's greedy continuations."""
    objective = DFlashObjective(block_size=block_size, num_layers=1, anchors_per_row=32)
    return fit(objective, target, greedy_sequences(target), lr=3e-3, steps=steps, build_seed=0)


@pytest.fixture(scope="module")
def targets(make_llama):
    return {"llama": make_llama(layers=4), "qwen2": tiny_qwen2(layers=4), "gpt_neox": tiny_neox(layers=4)}


@pytest.fixture(scope="module")
def drafters(targets):
    return {arch: fit_drafter(target) for arch, target in targets.items()}


def random_drafter(target, seed: int = 4, **shape):
    torch.manual_seed(seed)
    draft = dflash_for_target(dflash_config_for_target(target, **shape), target)
    for parameter in draft.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return draft.eval()


def prompt_features(target, prompt: list[int], layers) -> TargetFeatures:
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    return TargetFeatures({layer: out.hidden_states[layer][0] for layer in layers})


# ---------------------------------------------------------------------------------------
# One drafting step is the block the objective trains


def drafted_and_trained(target, draft, prompt, root):
    """The proposer's block logits after ``prompt + [root]``, and the objective's at the same anchor (among others)."""
    proposer = DFlashProposer(draft, target=target)
    proposer.begin(prompt, prompt_features(target, prompt, proposer.hidden_layers))
    recorded = []
    original = draft.logits
    draft.logits = lambda hidden: recorded.append(original(hidden)) or recorded[-1]
    try:
        chain = proposer.propose(ProposeContext(prompt + [root], 16, SamplingParams())).token_list
    finally:
        draft.logits = original
    sequence = torch.tensor([prompt + [root] + chain])
    captured = capture(target, sequence, proposer.hidden_layers, True)
    features = torch.cat([captured.hidden[layer] for layer in proposer.hidden_layers], dim=-1)
    anchors = torch.tensor([2, len(prompt), len(prompt) + 2])  # other blocks in the same pass must not leak in
    with torch.no_grad():
        trained = block_logits(draft, sequence, features, anchors)[0, 1]  # [block - 1, vocab]
    return recorded[0], trained


def test_the_block_forward_equals_the_training_pass(make_llama):
    target = make_llama(layers=4, seed=3)
    draft = random_drafter(target, block_size=5, num_layers=2)
    drafted, trained = drafted_and_trained(target, draft, [5, 9, 17, 33, 5, 9, 17, 40], 12)
    assert drafted.shape == trained.shape == (4, 128)
    torch.testing.assert_close(drafted, trained, atol=1e-4, rtol=1e-4)


def test_negative_control_a_block_that_sees_its_anchors_own_feature_differs(make_llama, monkeypatch):
    """An off-by-one in the context (the anchor's own position let in) must fail the equality above."""
    target = make_llama(layers=4, seed=3)
    draft = random_drafter(target, block_size=5, num_layers=2)
    real = dflash_objective.block_mask

    def off_by_one(anchors, seq, block):
        return real(anchors + 1, seq, block)

    monkeypatch.setattr(dflash_objective, "block_mask", off_by_one)
    drafted, trained = drafted_and_trained(target, draft, [5, 9, 17, 33, 5, 9, 17, 40], 12)
    assert not torch.allclose(drafted, trained, atol=1e-3)


def test_anchors_are_spread_or_sampled_inside_the_sequence():
    assert choose_anchors(9, 4, random=False).tolist() == [1, 3, 6, 8]
    torch.manual_seed(0)
    drawn = choose_anchors(100, 30, random=True)
    assert drawn.numel() == 30 and drawn.unique().numel() == 30 and 1 <= int(drawn.min()) and int(drawn.max()) <= 99
    with pytest.raises(InputError, match="at least 2 positions"):
        choose_anchors(1, 4, random=False)


# ---------------------------------------------------------------------------------------
# Greedy identity


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_greedy_is_token_identical_to_plain(arch, shape, targets, drafters):
    target = targets[arch]
    proposer = DFlashProposer(drafters[arch], target=target, **SHAPES[shape])
    plain, dflash = SpeculativeDecoder(target), SpeculativeDecoder(target, proposer, adaptive=False)
    accepted = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        result = dflash.generate(ids, max_new_tokens=40)
        assert result.new_tokens == plain.generate(ids, max_new_tokens=40).new_tokens, prompt
        accepted += sum(result.stats.accept_lengths)
    assert accepted >= 15  # drafts were accepted (a random tiny target is hard to guess 4 deep in parallel)


def test_greedy_identity_with_the_controller_deciding(targets, drafters):
    target = targets["llama"]
    proposer = DFlashProposer(drafters["llama"], target=target, **SHAPES["tree"])
    plain, dflash = SpeculativeDecoder(target), SpeculativeDecoder(target, proposer)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        assert dflash.generate(ids, max_new_tokens=30).new_tokens == plain.generate(ids, max_new_tokens=30).new_tokens


# ---------------------------------------------------------------------------------------
# The sampled output law

N_LAW = 2000
N_CONTROL = 1000
LAW_CASES = {  # name -> (tree width, sampling): sampled chains and point-mass trees, top-k and top-p
    "chain_t0.7": (1, SamplingParams(0.7)),
    "chain_t1.0_top_p": (1, SamplingParams(1.0, top_p=0.9)),
    "tree_t1.0_top_k": (2, SamplingParams(1.0, top_k=5)),
    "tree_t0.7": (2, SamplingParams(0.7)),
}
FAST_LAW_CASES = ("chain_t0.7", "tree_t1.0_top_k")


@pytest.fixture(scope="module")
def law_setup(make_llama):
    target = make_llama(vocab_size=V, hidden_size=16, layers=4, seed=5)
    return target, fit_drafter(target, block_size=3, steps=15)  # a rough drafter: rejections (and the residual) are frequent


@pytest.mark.parametrize("decisions", ["fixed", "controller"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST_LAW_CASES else pytest.mark.slow) for c in LAW_CASES])
def test_sampled_output_follows_the_target_law(case, decisions, law_setup, law_check):
    width, sampling = LAW_CASES[case]
    target, drafter = law_setup
    assert_law_case(
        target, DFlashProposer(drafter, target=target, k=2, tree_width=width), sampling, decisions, N_LAW, law_check, f"{case}, "
    )


@pytest.mark.parametrize("decisions", ["fixed", "controller"])
@pytest.mark.parametrize("width", [1, 2], ids=["sampled_chain", "top_k_tree"])
def test_negative_control_broken_residual_fails_the_law_test(width, decisions, law_setup, law_check, monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda target_probs, draft_probs, token: target_probs)
    target, drafter = law_setup
    assert_control_rejects(target, DFlashProposer(drafter, target=target, k=2, tree_width=width), decisions, N_CONTROL, law_check)


# ---------------------------------------------------------------------------------------
# Checkpoints, export and bad input


def test_save_and_load_round_trip_every_tensor(targets, drafters, tmp_path):
    target, draft = targets["llama"], drafters["llama"]
    draft.save(tmp_path / "d")
    written = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert set(written) == set(draft.tensors()) and not any(k.startswith(("embed", "lm_head")) for k in written)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight", "layers.0.mlp.gate_proj.weight"} <= set(
        written
    )
    proposer = load_proposer({"type": "dflash", "model": str(tmp_path / "d")}, target=target)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(proposer.draft.state_dict()[name], tensor), name
    assert proposer.draft_depth() == draft.cfg.block_size - 1


def test_vllm_export_has_the_engines_files_and_fields(targets, drafters, tmp_path):
    target = targets["llama"]
    proposer = DFlashProposer(drafters["llama"], target=target, k=3)
    with pytest.warns(UserWarning, match="the export asks for the 4 this drafter trained on"):
        exported = proposer.export(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    layers = proposer.cfg.aux_layers
    assert config["dflash_config"] == {
        "block_size": 5,
        "mask_token_id": proposer.cfg.mask_token_id,
        "target_layer_ids": [i - 1 for i in layers],
    }
    mask = torch.load(tmp_path / "out" / MASK_EMBEDDING, weights_only=True)
    assert mask["mask_token_id"] == proposer.cfg.mask_token_id and torch.equal(mask["embedding"], proposer.draft.mask_embedding.detach())
    assert exported.speculative_config == {"method": "dflash", "model": str(tmp_path / "out"), "num_speculative_tokens": 4}
    reloaded = DFlashProposer(tmp_path / "out", target=target)
    for name, tensor in proposer.draft.state_dict().items():
        assert torch.equal(reloaded.draft.state_dict()[name], tensor), name
    labels = [control.label for control in proposer.export_controls(exported, tmp_path / "work")]
    assert labels == ["no mask embedding"]  # 3 aux layers for 1 drafter layer: vLLM's default layer count refuses loudly
    two_layers = DFlashProposer(random_drafter(target, block_size=5, num_layers=2, aux_layers=[1, 3]), target=target)
    labels = [control.label for control in two_layers.export_controls(two_layers.export(tmp_path / "two"), tmp_path / "work2")]
    assert labels == ["no mask embedding", "no layer ids"]
    assert not (tmp_path / "work" / "out-no-mask-embedding" / MASK_EMBEDDING).exists()
    with pytest.raises(InputError, match=r"exports to \['vllm'\], got format 'sglang'"):
        proposer.export(tmp_path / "sg", format="sglang")


def test_an_export_that_lost_its_layer_ids_or_mask_embedding_is_refused(targets, drafters, tmp_path, monkeypatch):
    proposer = DFlashProposer(drafters["llama"], target=targets["llama"])
    save = proposer.draft.save

    def without_layer_ids(directory, dtype=torch.float32):
        save(directory, dtype)
        config = json.loads((directory / "config.json").read_text())
        config["dflash_config"].pop("target_layer_ids")
        (directory / "config.json").write_text(json.dumps(config))

    monkeypatch.setattr(proposer.draft, "save", without_layer_ids)
    with pytest.raises(InputError, match="dflash_config is"):
        proposer.export(tmp_path / "a")
    assert not (tmp_path / "a").exists()

    def without_mask(directory, dtype=torch.float32):
        save(directory, dtype)
        (directory / MASK_EMBEDDING).unlink()

    monkeypatch.setattr(proposer.draft, "save", without_mask)
    with pytest.raises(InputError, match="has no mask_embedding.pt"):
        proposer.export(tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_bad_drafters_and_settings_are_refused(targets, drafters, make_llama, tmp_path):
    target, draft = targets["llama"], drafters["llama"]
    with pytest.raises(InputError, match=r"k must be in \[1, 4\]: this drafter was trained on blocks of 5"):
        DFlashProposer(draft, target=target, k=6)
    with pytest.raises(InputError, match="max_nodes must be at least the depth k=4"):
        DFlashProposer(draft, target=target, tree_width=2, max_nodes=3)
    with pytest.raises(InputError, match="needs the target model"):
        DFlashProposer(draft)
    draft.save(tmp_path / "d")
    with pytest.raises(InputError, match="trained for a target of hidden size 32, this target's is 64"):
        DFlashProposer(tmp_path / "d", target=make_llama(hidden_size=64, layers=4))
    with pytest.raises(InputError, match="trained for a target of number of layers 4, this target's is 6"):
        DFlashProposer(tmp_path / "d", target=make_llama(layers=6))
    (tmp_path / "d" / MASK_EMBEDDING).unlink()
    with pytest.raises(InputError, match="has no mask_embedding.pt"):
        DFlashProposer(tmp_path / "d", target=target)
    torch.save({"mask_token_id": 5, "embedding": torch.zeros(32)}, tmp_path / "d" / MASK_EMBEDDING)
    with pytest.raises(InputError, match="is for mask_token_id 5"):
        DFlashProposer(tmp_path / "d", target=target)


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"aux_layers": [0, 2]}, r"ascending ids of layer outputs in \[1, 3\]"),
        ({"aux_layers": [1, 4]}, r"in \[1, 3\]"),
        ({"aux_layers": []}, "non-empty list"),
        ({"block_size": 1}, "draft.block_size must be >= 2"),
        ({"num_layers": 0}, "draft.num_layers must be >= 1"),
        ({"mask_token_id": 128}, r"mask_token_id must be a token id in \[0, 128\)"),
        ({"loss": "tvd"}, r"draft.loss must be one of \['forward_kl', 'cross_entropy'\]"),
        ({"decay": -1.0}, "draft.decay must be a finite number >= 0"),
    ],
)
def test_bad_objective_settings_are_refused(keys, message, targets):
    with pytest.raises(InputError, match=message):
        DFlashObjective(**keys).check(targets["llama"], None)


def test_default_layers_spread_to_the_last_one_an_engine_hands_over():
    assert default_dflash_layers(8) == [1, 3, 5, 7] and default_dflash_layers(36) == [1, 12, 24, 35] and default_dflash_layers(2) == [1]
    with pytest.raises(InputError, match="no layer output before the last"):
        default_dflash_layers(1)
