"""Decode statistics: the acceptance rates rebuild the measured tau, and only emitted tokens count."""

from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.proposers import load_proposer
from draftsmith.proposers.draft_model import DraftModelProposer
from draftsmith.verify import DecodeStats, SpeculativeDecoder

MAX_NEW = 40


@pytest.fixture(scope="module")
def prompt(model):
    """Random tokens, then the model's own greedy continuation through one period of the loop it falls into.

    The output goes on around that loop, so prompt lookup drafts it from the prompt and
    tokens seen only in the prompt are emitted for the first time inside accepted blocks.
    """
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (1, 10))
    return model.generate(ids, max_new_tokens=11, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def near(model):
    """A noisy copy of the target: a draft that agrees often, not always."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        head = draft.lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * head.std() * 0.5)
    return draft


CASES = {
    "ngram_chain": (lambda model, near: load_proposer({"type": "ngram"}), 0.0),
    "ngram_tree": (lambda model, near: load_proposer({"type": "ngram", "min_n": 1, "branches": 3}), 0.0),
    "draft_chain": (lambda model, near: DraftModelProposer(near, k=4, target=model), 0.0),
    "draft_chain_sampled": (lambda model, near: DraftModelProposer(near, k=4, target=model), 0.7),
    "draft_tree_sampled": (lambda model, near: DraftModelProposer(near, k=4, tree_width=2, target=model), 0.7),
}


def eos_inside_accepted_block(new_tokens: list[int], accept_lengths: list[int]) -> tuple[int, int, int]:
    """A token first emitted as an accepted draft token that has accepted tokens after it.

    Returns (token, its index among the step's accepted tokens, the step's accepted count)
    for an uncut decode, whose step i emitted ``accept_lengths[i] + 1`` tokens.
    """
    start = 1  # new_tokens[0] came from the prefill
    for accepted in accept_lengths:
        for j in range(accepted - 1):
            token = new_tokens[start + j]
            if new_tokens.index(token) == start + j:
                return token, j, accepted
        start += accepted + 1
    raise AssertionError("no accepted block holds a first occurrence: the fixture no longer exercises EOS inside a block")


def assert_reconciles(stats: DecodeStats) -> None:
    accepted = sum(stats.accepted_by_depth)
    assert stats.target_forwards == stats.requests + stats.steps
    assert stats.new_tokens == stats.requests + stats.steps - stats.truncated_steps + accepted
    assert sum(stats.accept_lengths) == accepted
    assert abs(stats.tau_from_rates - stats.tau) <= 1e-12, (stats.tau_from_rates, stats.tau)


@pytest.mark.parametrize("case", list(CASES))
def test_tau_from_rates_equals_measured_tau(case, model, near, prompt):
    make, temperature = CASES[case]
    decoder = SpeculativeDecoder(model, make(model, near), adaptive=False)
    uncut = decoder.generate(prompt, max_new_tokens=MAX_NEW, temperature=temperature, seed=0)
    eos, _, _ = eos_inside_accepted_block(uncut.new_tokens, uncut.stats.accept_lengths)
    requests = [
        uncut,
        decoder.generate(prompt, max_new_tokens=13, temperature=temperature, seed=0),  # the limit prunes the last draft
        decoder.generate(prompt, max_new_tokens=MAX_NEW, temperature=temperature, seed=0, eos_token_id=eos),
    ]
    cut = requests[-1]
    assert cut.new_tokens[-1] == eos and cut.stats.truncated_steps == 1
    assert cut.new_tokens == uncut.new_tokens[: len(cut.new_tokens)]  # the same path up to EOS
    assert max(uncut.stats.accept_lengths) >= 2 and len(uncut.stats.drafted_by_depth) >= 3  # several depths drafted
    for result in requests:
        assert result.stats.requests == 1
        assert_reconciles(result.stats)
    merged = DecodeStats.merged([r.stats for r in requests])
    assert merged.requests == 3 and merged.new_tokens == sum(len(r.new_tokens) for r in requests)
    assert_reconciles(merged)


def test_accepted_counts_exclude_tokens_after_eos(model, prompt):
    decoder = SpeculativeDecoder(model, load_proposer({"type": "ngram"}), adaptive=False)
    uncut = decoder.generate(prompt, max_new_tokens=MAX_NEW)
    eos, index, accepted = eos_inside_accepted_block(uncut.new_tokens, uncut.stats.accept_lengths)
    cut = decoder.generate(prompt, max_new_tokens=MAX_NEW, eos_token_id=eos)
    stats = cut.stats
    # The last step accepted `accepted` draft tokens, but only those up to EOS came out.
    assert stats.accept_lengths[-1] == index + 1 < accepted
    assert sum(stats.accept_lengths) + stats.steps - stats.truncated_steps + 1 == len(cut.new_tokens)
    assert stats.accepted_by_depth == [sum(a >= d for a in stats.accept_lengths) for d in range(1, len(stats.accepted_by_depth) + 1)]


def test_rates_and_the_iid_model_on_hand_counted_steps():
    stats = DecodeStats(requests=1, target_forwards=5)
    stats.record_step(draft_depth=3, num_nodes=3, num_accepted=3, recovered=False, emitted=4)  # all accepted + bonus
    stats.record_step(draft_depth=3, num_nodes=3, num_accepted=1, recovered=True, emitted=2)  # rejected at depth 2
    stats.record_step(draft_depth=0, num_nodes=0, num_accepted=0, recovered=False, emitted=1)  # nothing drafted
    stats.record_step(draft_depth=2, num_nodes=2, num_accepted=2, recovered=False, emitted=1)  # EOS on the first accepted token
    stats.new_tokens = 1 + 4 + 2 + 1 + 1
    assert (stats.steps, stats.truncated_steps, stats.accept_lengths) == (4, 1, [3, 1, 0, 1])
    assert stats.drafted_by_depth == [3, 3, 2]
    assert stats.reached_by_depth == [3, 2, 1]
    assert stats.accepted_by_depth == [3, 1, 1]
    rates = stats.acceptance_by_depth()
    assert rates.given_reached == [1.0, 0.5, 1.0]
    assert rates.given_drafted == [1.0, 1 / 3, 0.5]
    assert rates.per_step == [0.75, 0.25, 0.25]
    assert stats.tau_from_rates == pytest.approx(stats.tau) == 9 / 5
    a, depth = 5 / 6, 8 / 3
    assert stats.tau_iid == pytest.approx((1 - a ** (depth + 1)) / (1 - a))
    stats.accepted_by_depth = list(stats.reached_by_depth)
    assert stats.tau_iid == pytest.approx(depth + 1)  # every tested node accepted
    assert DecodeStats(requests=1, target_forwards=1, new_tokens=1).tau_iid is None
    as_dict = stats.to_dict()
    assert set(as_dict["acceptance_by_depth"]) == {"given_reached", "given_drafted", "per_step"}
    assert {"tau_from_rates", "tau_iid", "truncated_steps", "reached_by_depth"} <= set(as_dict)


def test_per_source_counts_add_up_and_merge():
    a, b = DecodeStats(), DecodeStats()
    a.record_step(3, 3, 2, True, 3, source="suffix")
    a.record_step(2, 2, 0, True, 1, source="draft_model")
    b.record_step(4, 4, 4, False, 5, source="suffix")
    b.record_step(0, 0, 0, False, 1)  # an empty draft names no source
    merged = DecodeStats.merged([a, b])
    assert merged.steps_by_source == {"suffix": 2, "draft_model": 1}
    assert merged.accepted_by_source == {"suffix": 6, "draft_model": 0}
    assert a.steps_by_source == {"suffix": 1, "draft_model": 1}  # merging copies, never aliases
