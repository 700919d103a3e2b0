"""Suffix decoding: trie counts against brute force, speculation trees, the global store across
requests (eviction, save / load), greedy identity and the sampled law, bad input."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from law import assert_follows_law, assert_follows_law_deciding, assert_law_rejects, control_decisions

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.types import ProposeContext
from draftsmith.proposers.suffix import SuffixProposer, SuffixTrie
from draftsmith.verify import SpeculativeDecoder

GREEDY = SamplingParams()
N_LAW = 1500


def propose(proposer, tokens, max_depth=16):
    return proposer.propose(ProposeContext(list(tokens), max_depth, GREEDY))


def substring_counts(sequences, depth):
    counts = Counter()
    for seq in sequences:
        for i in range(len(seq)):
            for n in range(1, depth + 1):
                if i + n <= len(seq):
                    counts[tuple(seq[i : i + n])] += 1
    return dict(counts)


def lookup(trie: SuffixTrie, string: tuple[int, ...]) -> int:
    """How often ``string`` occurred, read from the trie (below an implicit node, from its sequence)."""
    node, extra = 0, 0
    for token in string:
        if extra == 0 and trie.explicit[node]:
            if token not in trie.children[node]:
                return 0
            node = trie.children[node][token]
        elif trie._next_token(node, extra) == token:
            extra += 1
        else:
            return 0
    return trie.count[node]


def check_counts(trie: SuffixTrie, sequences, alphabet: int) -> None:
    """Every substring up to the trie's depth, and every other string over the alphabet, has its true count."""
    expected = substring_counts(sequences, trie.depth)
    strings = [s for n in range(1, trie.depth + 1) for s in itertools.product(range(alphabet), repeat=n)]
    assert {s: lookup(trie, s) for s in strings if lookup(trie, s)} == expected
    for node in range(1, len(trie.token)):
        if node not in trie.free and trie.explicit[node]:
            assert trie.total[node] == sum(trie.count[c] for c in trie.children[node].values())


sequences = st.lists(st.integers(0, 3), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(sequences, min_size=1, max_size=6), st.integers(1, 4), st.data())
def test_trie_counts_every_substring_and_removal_undoes_it(seqs, depth, data):
    trie = SuffixTrie(depth)
    for i, seq in enumerate(seqs):
        trie.add(i, seq)
    check_counts(trie, seqs, 4)
    removed = data.draw(st.sets(st.integers(0, len(seqs) - 1)))
    for i in sorted(removed):
        trie.remove(i)
    kept = [s for i, s in enumerate(seqs) if i not in removed]
    check_counts(trie, kept, 4)
    trie.add(len(seqs), seqs[0])  # freed nodes are reused consistently
    check_counts(trie, kept + [seqs[0]], 4)


def test_single_occurrences_stay_implicit():
    trie = SuffixTrie(depth=32)
    trie.add(0, list(range(100)))  # no repeats: one node per distinct token, continuations read from the sequence
    assert trie.num_nodes == 101
    trie.add(1, list(range(50, 60)))  # 10 repeated tokens: their 45 longer substrings and 10 old continuations
    assert trie.num_nodes == 101 + 45 + 10


def test_speculation_is_best_first_by_continuation_frequency():
    trie = SuffixTrie(depth=6)
    for i, seq in enumerate(([5, 1, 2], [5, 1, 2], [5, 1, 3], [5, 4, 4])):
        trie.add(i, seq)
    node = trie.children[0][5]
    tokens, parents, score = trie.speculate(node, 0, budget=10, max_depth=4, min_prob=0.3)
    # after 5: 1 (3/4), 4 (1/4, under 0.3); after 5 1: 2 (2/3 x 3/4 = 1/2), 3 (1/4, under 0.3)
    assert tokens == [1, 2] and parents == [-1, 0]
    assert score == pytest.approx(0.75 + 0.5)
    tokens, _, _ = trie.speculate(node, 0, budget=1, max_depth=4, min_prob=0.0)
    assert tokens == [1]


def test_draft_grows_with_the_match_and_comes_from_this_request():
    p = SuffixProposer(k=8, max_nodes=8, alpha=1.0, min_token_prob=0.0)
    p.begin([], None)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert propose(p, tokens).token_ids.tolist() == [3, 4]  # match "1 2": at most 2 nodes
    tokens += [3, 4, 5]
    assert propose(p, tokens).token_ids.tolist() == [6, 7, 8, 9, 1]  # match "1 2 3 4 5": 5 nodes
    assert propose(p, tokens, max_depth=2).token_ids.tolist() == [6, 7]


def test_the_global_store_carries_outputs_to_later_requests(model):
    decoder = SpeculativeDecoder(model, SuffixProposer(), adaptive=False)
    prompt = torch.tensor([[3, 17, 42, 9, 88, 5]])
    first = decoder.generate(prompt, max_new_tokens=40)
    again = decoder.generate(prompt, max_new_tokens=40)
    assert again.new_tokens == first.new_tokens
    assert again.stats.target_forwards < first.stats.target_forwards / 2  # the earlier output is drafted whole
    alone = SpeculativeDecoder(model, SuffixProposer(global_store=False), adaptive=False)
    alone.generate(prompt, max_new_tokens=40)
    assert alone.generate(prompt, max_new_tokens=40).stats.target_forwards == first.stats.target_forwards


def test_the_oldest_requests_are_evicted_under_the_bound():
    p = SuffixProposer(max_cached_tokens=10, cache_prompts=True)
    for request in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        p.begin(request, None)
    p.flush()
    assert p.cached_requests() == [[5, 6, 7, 8], [9, 10, 11, 12]] and p.cached_tokens == 8
    assert lookup(p.cache, (9, 10)) == 1 and lookup(p.cache, (1, 2)) == 0
    p.reset()
    assert p.cached_tokens == 0 and lookup(p.cache, (9, 10)) == 0 and p.cache.num_nodes == 1


def test_min_score_withholds_weak_drafts():
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]  # "1 2" went on to 7 and to 8, each 1/2: a tree of 2 nodes scores 1.0
    for min_score, nodes in ((0.0, 2), (1.0, 2), (1.01, 0)):
        p = SuffixProposer(min_token_prob=0.1, min_score=min_score, alpha=1.0)
        p.begin([], None)
        assert propose(p, tokens).num_nodes == nodes


def test_store_round_trip_and_foreign_stores(tmp_path, tiny_target_dir):
    from draftsmith.verify import load_target

    target, tokenizer = load_target(tiny_target_dir)
    p = SuffixProposer(cache_prompts=True, target=target, tokenizer=tokenizer)
    p.begin([5, 6, 7, 8, 9], None)
    path = p.save_store(tmp_path / "store.json")
    config = {"type": "suffix", "store": str(path), "cache_prompts": True}
    loaded = load_proposer(config, target=target, tokenizer=tokenizer)
    assert loaded.cached_requests() == [[5, 6, 7, 8, 9]]
    loaded.begin([1, 5, 6], None)
    assert propose(loaded, [1, 5, 6, 7]).token_ids.tolist() == [8, 9]  # what followed 5 6 7 in the saved request
    other = json.loads(path.read_text()) | {"tokenizer": "0123456789abcdef"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(InputError, match="another tokenizer"):
        load_proposer({**config, "store": str(tmp_path / "other.json")}, target=target, tokenizer=tokenizer)
    (tmp_path / "bad.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(InputError, match="not a suffix store"):
        load_proposer({**config, "store": str(tmp_path / "bad.json")}, target=target, tokenizer=tokenizer)
    big = json.loads(path.read_text()) | {"requests": [[10**6]]}
    (tmp_path / "big.json").write_text(json.dumps(big))
    with pytest.raises(InputError, match="outside the vocabulary"):
        load_proposer({**config, "store": str(tmp_path / "big.json")}, target=target, tokenizer=tokenizer)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_cached_tokens", 100, "under one request"),
        ("max_cached_tokens", 0, ">= 1"),
        ("alpha", 0, "alpha"),
        ("min_token_prob", 1.5, "min_token_prob"),
        ("min_score", -1, "min_score"),
        ("k", 1.5, "'k'"),
    ],
)
def test_bad_settings_are_refused(model, key, value, message):
    with pytest.raises(InputError, match=message):
        load_proposer({"type": "suffix", key: value}, target=model)


def test_greedy_output_is_plain_over_a_run_of_requests(model):
    plain = SpeculativeDecoder(model)
    decoder = SpeculativeDecoder(model, SuffixProposer(max_nodes=12), adaptive=False)
    generator = torch.Generator().manual_seed(0)
    base = torch.randint(0, 128, (12,), generator=generator)
    drafted = 0
    for request in range(6):
        prompt = torch.cat([base[: 6 + request], torch.randint(0, 128, (3,), generator=generator), base]).unsqueeze(0)
        result = decoder.generate(prompt, max_new_tokens=32)
        assert result.new_tokens == plain.generate(prompt, max_new_tokens=32).new_tokens
        drafted += result.stats.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_output_follows_the_target_law(small_vocab_model, law_check, temperature):
    """Drafts from earlier requests' outputs (prompts cached), accepted and rejected often; chi-square at alpha = 1e-3."""
    sampling = SamplingParams(temperature=temperature)
    proposer = SuffixProposer(cache_prompts=True, alpha=4.0, min_token_prob=0.05)
    accepted = assert_follows_law(small_vocab_model, proposer, sampling, N_LAW, law_check)
    assert N_LAW // 10 < sum(a > 0 for a in accepted) < N_LAW - N_LAW // 10


@pytest.mark.parametrize("temperature", [0.7, pytest.param(1.0, marks=pytest.mark.slow)])
def test_sampled_output_follows_the_target_law_with_the_controller_deciding(small_vocab_model, law_check, temperature):
    """Deterministic drafts, so the controller also trims them by their scores: the law holds whatever it keeps."""
    proposer = SuffixProposer(cache_prompts=True, alpha=4.0, min_token_prob=0.05)
    assert_follows_law_deciding(small_vocab_model, proposer, SamplingParams(temperature=temperature), N_LAW, law_check)


@pytest.mark.parametrize("decisions", ["fixed", "controller"])
def test_negative_control_broken_residual_fails_the_law_test(decisions, small_vocab_model, law_check, monkeypatch):
    import draftsmith.verify.rejection as rejection

    monkeypatch.setattr(rejection, "residual_distribution", lambda target_probs, draft_probs, token: target_probs)
    sampling = SamplingParams(temperature=1.0)
    proposer = SuffixProposer(cache_prompts=True, alpha=4.0, min_token_prob=0.05)
    controller, n = control_decisions(decisions, proposer, 600)
    assert_law_rejects(small_vocab_model, proposer, sampling, n, law_check, controller)


def test_vllm_export_is_the_suffix_config(tmp_path):
    exported = SuffixProposer(k=12, max_match=20, alpha=2.0, min_token_prob=0.2).export(tmp_path / "s")
    spec = {
        "method": "suffix",
        "num_speculative_tokens": 12,
        "suffix_decoding_max_tree_depth": 32,
        "suffix_decoding_max_spec_factor": 2.0,
        "suffix_decoding_min_token_prob": 0.2,
    }
    assert exported.speculative_config == spec
    assert json.loads((tmp_path / "s" / "speculative_config.json").read_text()) == spec
    local = SuffixProposer(global_store=False).export(tmp_path / "local")
    assert local.speculative_config["suffix_decoding_max_cached_requests"] == 0  # the engine's "no global tree"
