"""Parallel EAGLE-3 (P-EAGLE): one forward equals the parallel training steps, greedy identity on three
architectures (chain and tree), the sampled law with a negative control, the engine export and bad input.

Heads are fitted for a few seconds by the EAGLE objective with ``parallel: true`` on the
target's greedy continuations (``fit_parallel``), so drafts are accepted and rejected often.
"""

from __future__ import annotations

import json

import pytest
import torch
from heads import fit, greedy_sequences, tiny_neox, tiny_qwen2
from law import V, assert_control_rejects, assert_law_case
from safetensors.torch import load_file

import draftsmith.verify.rejection as rejection
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.types import ProposeContext, TargetFeatures
from draftsmith.proposers.eagle import EagleProposer
from draftsmith.proposers.eagle_head import EagleConfig, config_for_target, draft_for_target
from draftsmith.training.capture import capture
from draftsmith.training.eagle import EagleObjective, unrolled_logits
from draftsmith.verify import SpeculativeDecoder

PROMPTS = [[5, 9, 17, 33, 5, 9, 17], [3, 3, 3, 3], [100, 7, 64, 2, 90], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
SHAPES = {"chain": {"k": 4}, "tree": {"k": 4, "tree_width": 3, "max_nodes": 10}}


def fit_parallel(target, steps: int = 150, ttt_steps: int = 4, **keys):
    objective = EagleObjective(version=3, ttt_steps=ttt_steps, parallel=True, **keys)
    return fit(objective, target, greedy_sequences(target), lr=3e-3, steps=steps, build_seed=0)


@pytest.fixture(scope="module")
def targets(make_llama):
    return {"llama": make_llama(layers=4), "qwen2": tiny_qwen2(layers=4), "gpt_neox": tiny_neox(layers=4)}


@pytest.fixture(scope="module")
def heads(targets):
    return {arch: fit_parallel(target) for arch, target in targets.items()}


def drafted_and_trained(target, draft, parallel_depth: int):
    """The proposer's logits of every depth after one parallel forward, and the unrolled parallel training steps' at that row."""
    prompt, root = [5, 9, 17, 33, 5, 9, 17, 40], 12
    proposer = EagleProposer(draft, target=target, k=parallel_depth)
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    proposer.begin(prompt, TargetFeatures({layer: out.hidden_states[layer][0] for layer in proposer.hidden_layers}))
    recorded = []
    original = proposer._target_logits
    proposer._target_logits = lambda hidden: recorded.append(original(hidden)) or recorded[-1]
    proposer.propose(ProposeContext(prompt + [root], 16, SamplingParams()))
    sequence = torch.tensor([prompt + [root] + [7] * parallel_depth])  # the tokens after the root are never read
    captured = capture(target, sequence, proposer.hidden_layers, True)
    with torch.no_grad():
        steps = [
            logits[0, len(prompt) - 1] for logits in unrolled_logits(draft, sequence, captured, proposer.hidden_layers, parallel_depth)
        ]
    return recorded[0], torch.stack(steps)


def random_parallel_head(target, parallel_depth: int = 3):
    torch.manual_seed(4)
    draft = draft_for_target(config_for_target(target, 3, parallel_depth=parallel_depth), target)
    for parameter in draft.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return draft.eval()


def test_one_parallel_forward_equals_the_parallel_training_steps(make_llama):
    target = make_llama(layers=4, seed=3)
    drafted, trained = drafted_and_trained(target, random_parallel_head(target), 3)
    assert drafted.shape == trained.shape == (3, 128)
    torch.testing.assert_close(drafted, trained, atol=1e-4, rtol=1e-4)


def test_negative_control_mask_entries_one_position_off_differ(make_llama, monkeypatch):
    """Mask entries placed one position further than training put them must fail the equality above."""
    target = make_llama(layers=4, seed=3)
    draft = random_parallel_head(target)
    step = draft.step

    def shifted(tokens, hidden, positions, cache, mask):
        rows, positions = tokens.shape[1], torch.as_tensor(list(positions))  # the proposer hands the host's positions over
        return step(tokens, hidden, torch.cat([positions[: rows - 2], positions[rows - 2 :] + 1]), cache, mask)

    monkeypatch.setattr(draft, "step", shifted)
    drafted, trained = drafted_and_trained(target, draft, 3)
    assert torch.allclose(drafted[0], trained[0], atol=1e-4)  # depth 1 is the usual entry, untouched
    assert not torch.allclose(drafted[1:], trained[1:], atol=1e-3)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_greedy_is_token_identical_to_plain(arch, shape, targets, heads):
    target = targets[arch]
    proposer = EagleProposer(heads[arch], target=target, **SHAPES[shape])
    plain, parallel = SpeculativeDecoder(target), SpeculativeDecoder(target, proposer, adaptive=False)
    accepted = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        result = parallel.generate(ids, max_new_tokens=40)
        assert result.new_tokens == plain.generate(ids, max_new_tokens=40).new_tokens, prompt
        accepted += sum(result.stats.accept_lengths)
    assert accepted >= 15  # drafts were accepted


N_LAW = 2000
N_CONTROL = 1000
LAW_CASES = {  # name -> (tree width, sampling)
    "chain_t0.7": (1, SamplingParams(0.7)),
    "chain_t1.0_top_k": (1, SamplingParams(1.0, top_k=5)),
    "tree_t1.0_top_p": (2, SamplingParams(1.0, top_p=0.9)),
    "tree_t0.7": (2, SamplingParams(0.7)),
}
FAST_LAW_CASES = ("chain_t1.0_top_k", "tree_t0.7")


@pytest.fixture(scope="module")
def law_setup(make_llama):
    target = make_llama(vocab_size=V, hidden_size=16, layers=4, seed=5)
    return target, fit_parallel(target, steps=15, ttt_steps=2)  # a rough head: rejections (and the residual) are frequent


@pytest.mark.parametrize("decisions", ["fixed", "controller"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST_LAW_CASES else pytest.mark.slow) for c in LAW_CASES])
def test_sampled_output_follows_the_target_law(case, decisions, law_setup, law_check):
    width, sampling = LAW_CASES[case]
    target, head = law_setup
    assert_law_case(target, EagleProposer(head, target=target, k=2, tree_width=width), sampling, decisions, N_LAW, law_check, f"{case}, ")


@pytest.mark.parametrize("decisions", ["fixed", "controller"])
@pytest.mark.parametrize("width", [1, 2], ids=["sampled_chain", "top_k_tree"])
def test_negative_control_broken_residual_fails_the_law_test(width, decisions, law_setup, law_check, monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda target_probs, draft_probs, token: target_probs)
    target, head = law_setup
    assert_control_rejects(target, EagleProposer(head, target=target, k=2, tree_width=width), decisions, N_CONTROL, law_check)


def test_vllm_export_carries_the_mask_hidden_and_token(make_llama, tmp_path):
    target = make_llama(layers=6, seed=7)  # aux ids from 2 on, as the export asks
    torch.manual_seed(0)
    head = draft_for_target(config_for_target(target, 3, aux_layers=[2, 3, 5], parallel_depth=4), target)
    torch.nn.init.normal_(head.mask_hidden)
    proposer = EagleProposer(head, target=target, k=3)
    exported = proposer.export(tmp_path / "out")
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written["mask_hidden"].shape == (3 * 32,) and torch.equal(written["mask_hidden"], proposer.draft.mask_hidden.detach())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["mask_token_id"] == proposer.cfg.mask_token_id == 0 and config["draftsmith_eagle"]["parallel_depth"] == 4
    assert exported.speculative_config == {
        "method": "eagle3", "model": str(tmp_path / "out"), "num_speculative_tokens": 3, "parallel_drafting": True,
    }  # fmt: skip
    reloaded = EagleProposer(tmp_path / "out", target=target)
    assert torch.equal(reloaded.draft.mask_hidden, proposer.draft.mask_hidden)
    controls = {c.label: c for c in proposer.export_controls(exported, tmp_path / "work")}
    assert "parallel_drafting" not in controls["served sequentially"].export.speculative_config
    with pytest.raises(InputError, match=r"a parallel eagle head exports to \['vllm'\], got format 'sglang'"):
        proposer.export(tmp_path / "sg", format="sglang")


def test_bad_parallel_settings_are_refused(targets, heads):
    target, head = targets["llama"], heads["llama"]
    with pytest.raises(InputError, match="trained to draft 4 depths in one forward; give k <= 4"):
        EagleProposer(head, target=target, k=5)
    with pytest.raises(InputError, match="a parallel head drafts every depth at once"):
        EagleProposer(head, target=target, k=3, confidence_threshold=0.2)
    with pytest.raises(InputError, match="draft.parallel .P-EAGLE. is an EAGLE-3 option"):
        EagleObjective(version=1, parallel=True)
    with pytest.raises(InputError, match="draft.mask_token_id is for parallel heads"):
        EagleObjective(version=3, mask_token_id=3)
    with pytest.raises(InputError, match="draft.parallel must be true or false"):
        EagleObjective(version=3, parallel="yes")
    with pytest.raises(InputError, match=r"a parallel head needs a mask_token_id in \[0, 128\)"):
        config_for_target(target, 3, parallel_depth=2, mask_token_id=500)
    with pytest.raises(InputError, match="parallel drafting .P-EAGLE. is an EAGLE-3 option"):
        EagleConfig(**{**vars(head.cfg), "version": 1, "aux_layers": [-1]})
