"""Composite proposers: the policies, per-member state and stats, greedy identity, the sampled law
(with a negative control), bad input."""

from __future__ import annotations

import pytest
import torch
from law import V, assert_follows_law, assert_follows_law_deciding, assert_law_rejects, control_decisions

import draftsmith.verify.rejection as rejection
from draftsmith.proposers import load_proposer
from draftsmith.proposers.composite import CompositeProposer
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.tree import merge_drafts
from draftsmith.proposers.core.types import Draft, ProposeContext
from draftsmith.verify import SpeculativeDecoder

N_LAW = 1500
N_CONTROL = 600
SUFFIX = {"type": "suffix", "cache_prompts": True, "alpha": 4.0, "min_token_prob": 0.05, "min_score": 0.5}


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory, make_llama):
    """Saved draft models: one for the 128-token test target, one for the V = 8 law target."""
    out = {}
    for name, vocab, hidden in (("big", 128, 16), ("law", V, 8)):
        path = tmp_path_factory.mktemp(f"draft_{name}")
        make_llama(vocab_size=vocab, hidden_size=hidden, layers=1, seed=11).save_pretrained(path)
        out[name] = str(path)
    return out


def test_first_confident_asks_in_order_and_names_the_member():
    p = CompositeProposer([{"type": "suffix", "alpha": 1.0, "min_score": 1.5}, {"type": "ngram", "min_n": 1, "max_n": 1, "k": 2}])
    p.begin([], None)
    context = ProposeContext([4, 1, 2, 3, 9, 1, 2, 3], 8, SamplingParams())
    draft = p.propose(context)  # suffix: "1 2 3" once went on to 9 (score >= 1.5 with a 3-node budget)
    assert draft.source == "suffix" and draft.token_ids.tolist()[:1] == [9]
    draft = p.propose(ProposeContext([4, 1, 5, 7, 1], 8, SamplingParams()))  # suffix: "1" -> 5 scores 1 < 1.5
    assert draft.source == "ngram" and draft.token_ids.tolist() == [5, 7]


def test_merge_unites_trees_under_the_budget():
    a = Draft(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]), torch.full((3, 10), 0.1))
    b = Draft.chain([5, 8, 9])
    merged = merge_drafts([a, b], max_nodes=4, source="a+b")
    assert merged.token_ids.tolist() == [5, 6, 7, 8] and merged.parent_list == [-1, 0, 0, 0]
    assert merged.draft_probs is None and merged.source == "a+b"  # point masses: exact whatever the members sampled
    p = CompositeProposer([{"type": "ngram", "min_n": 1, "k": 2}, {"type": "suffix", "alpha": 4.0}], policy="merge", max_nodes=3)
    p.begin([], None)
    draft = p.propose(ProposeContext([1, 2, 3, 1, 4, 5, 1], 8, SamplingParams()))
    assert draft.num_nodes == 3 and draft.source == "ngram+suffix"


def test_stats_count_steps_and_accepted_tokens_per_member(model, draft_dirs):
    members = [SUFFIX, {"type": "draft_model", "model": draft_dirs["big"], "k": 3}]
    decoder = SpeculativeDecoder(model, CompositeProposer(members, target=model), adaptive=False)
    prompt = torch.tensor([[5, 9, 13, 5, 9, 13, 5, 9]])
    first = decoder.generate(prompt, max_new_tokens=30)
    result = decoder.generate(prompt, max_new_tokens=30)  # the suffix member has the first output now
    by_source = result.stats.steps_by_source
    assert set(by_source) <= {"suffix", "draft_model"} and sum(by_source.values()) == result.stats.steps
    assert by_source.get("suffix", 0) > 0 and sum(result.stats.accepted_by_source.values()) == sum(result.stats.accept_lengths)
    assert first.stats.steps_by_source.get("draft_model", 0) > 0


@pytest.mark.parametrize("policy", ["first_confident", "merge"])
@pytest.mark.parametrize("second", ["ngram", "draft_model"])
def test_greedy_output_is_plain(model, draft_dirs, policy, second):
    other = {"type": "ngram"} if second == "ngram" else {"type": "draft_model", "model": draft_dirs["big"], "k": 3}
    decoder = SpeculativeDecoder(
        model, load_proposer({"type": "composite", "proposers": [SUFFIX, other], "policy": policy}, target=model), adaptive=False
    )
    plain = SpeculativeDecoder(model)
    generator = torch.Generator().manual_seed(1)
    base = torch.randint(3, 128, (10,), generator=generator)
    for request in range(4):
        prompt = torch.cat([torch.randint(3, 128, (request + 2,), generator=generator), base, base[:4]]).unsqueeze(0)
        assert decoder.generate(prompt, max_new_tokens=24).new_tokens == plain.generate(prompt, max_new_tokens=24).new_tokens


def law_composite(target, second: str, draft_dirs) -> CompositeProposer:
    other = {"type": "ngram", "min_n": 1, "max_n": 2, "k": 3} if second == "ngram" else {"type": "draft_model", "model": draft_dirs["law"]}
    return CompositeProposer([SUFFIX, other], target=target)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("second", ["ngram", "draft_model"])
def test_sampled_output_follows_the_target_law(small_vocab_model, draft_dirs, law_check, temperature, second):
    sampling = SamplingParams(temperature=temperature)
    proposer = law_composite(small_vocab_model, second, draft_dirs)
    accepted = assert_follows_law(small_vocab_model, proposer, sampling, N_LAW, law_check)
    assert N_LAW // 20 < sum(a > 0 for a in accepted) < N_LAW - N_LAW // 20  # first drafts accepted and rejected


@pytest.mark.parametrize("temperature", [0.7, pytest.param(1.0, marks=pytest.mark.slow)])
@pytest.mark.parametrize("second", ["ngram", "draft_model"])
def test_sampled_output_follows_the_target_law_with_the_controller_deciding(small_vocab_model, draft_dirs, law_check, temperature, second):
    proposer = law_composite(small_vocab_model, second, draft_dirs)
    assert_follows_law_deciding(small_vocab_model, proposer, SamplingParams(temperature=temperature), N_LAW, law_check)


@pytest.mark.parametrize("decisions", ["fixed", "controller"])
@pytest.mark.parametrize("second", ["ngram", "draft_model"])
def test_negative_control_broken_residual_fails_the_law_test(small_vocab_model, draft_dirs, law_check, monkeypatch, second, decisions):
    monkeypatch.setattr(rejection, "residual_distribution", lambda target_probs, draft_probs, token: target_probs)
    sampling = SamplingParams(temperature=1.0)
    proposer = law_composite(small_vocab_model, second, draft_dirs)
    controller, n = control_decisions(decisions, proposer, N_CONTROL)
    assert_law_rejects(small_vocab_model, proposer, sampling, n, law_check, controller)


def test_bad_composites_are_refused(model, draft_dirs, make_llama, tmp_path):
    with pytest.raises(InputError, match="non-empty list"):
        load_proposer({"type": "composite", "proposers": []})
    with pytest.raises(InputError, match="unknown composite policy 'best'"):
        load_proposer({"type": "composite", "proposers": [{"type": "ngram"}], "policy": "best"})
    with pytest.raises(InputError, match=r"proposers\[0\]"):
        load_proposer({"type": "composite", "proposers": [{"k": 3}]})
    with pytest.raises(InputError, match="unknown proposer type"):
        load_proposer({"type": "composite", "proposers": [{"type": "nope"}]})
    make_llama(vocab_size=64, hidden_size=8, layers=1).save_pretrained(tmp_path / "v64")
    members = [{"type": "draft_model", "model": draft_dirs["big"]}, {"type": "draft_model", "model": str(tmp_path / "v64")}]
    with pytest.raises(InputError, match="vocabularies differ"):
        load_proposer({"type": "composite", "proposers": members})
    with pytest.raises(InputError, match="vocabular"):
        load_proposer({"type": "composite", "proposers": members[1:]}, target=model)
