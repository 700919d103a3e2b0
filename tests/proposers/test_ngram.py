"""Prompt lookup: matches, trees, incremental index, config loading."""

from __future__ import annotations

import pytest
import yaml

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.types import ProposeContext
from draftsmith.proposers.ngram import NgramProposer

GREEDY = SamplingParams()


def propose(proposer, tokens, max_depth=8):
    return proposer.propose(ProposeContext(tokens, max_depth, GREEDY))


def test_chain_copies_what_followed_the_latest_match():
    p = NgramProposer(min_n=2, max_n=3, k=3)
    p.begin([], None)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3]
    draft = propose(p, tokens)
    assert draft.token_ids.tolist() == [4, 5, 7]  # the most recent earlier "1 2 3" was followed by 4 5 7
    assert draft.is_chain()


def test_longer_suffix_wins_and_min_n_bounds_matches():
    p = NgramProposer(min_n=1, max_n=3, k=2)
    p.begin([], None)
    assert propose(p, [5, 6, 7, 1, 7, 2, 5, 6, 7]).token_ids.tolist() == [1, 7]  # "5 6 7" beats the later "7"
    strict = NgramProposer(min_n=3, max_n=3, k=2)
    strict.begin([], None)
    assert propose(strict, [1, 2, 3, 4, 2, 3]).num_nodes == 0


def test_depth_is_capped_by_context():
    p = NgramProposer(k=5)
    p.begin([], None)
    assert propose(p, [1, 2, 3, 4, 5, 6, 1, 2], max_depth=2).token_ids.tolist() == [3, 4]


def test_index_is_incremental_and_resets_per_request():
    p = NgramProposer(min_n=2, max_n=2, k=2)
    p.begin([], None)
    tokens = [1, 2, 3, 4]
    assert propose(p, tokens).num_nodes == 0
    tokens += [1, 2]
    assert propose(p, tokens).token_ids.tolist() == [3, 4]
    p.begin([], None)
    assert propose(p, [8, 9, 1, 2]).num_nodes == 0  # the previous request's index is gone


def test_tree_merges_shared_prefixes():
    p = NgramProposer(min_n=1, max_n=1, k=3, branches=3)
    p.begin([], None)
    tokens = [7, 1, 2, 7, 1, 3, 7, 4, 5, 7]
    draft = propose(p, tokens)
    # continuations of "7": [4,5,7], [1,3,7], [1,2,7] -> trie with a shared "1"
    assert draft.token_ids.tolist() == [4, 5, 7, 1, 3, 7, 2, 7]
    assert draft.parents.tolist() == [-1, 0, 1, -1, 3, 4, 3, 6]


def test_tree_node_budget():
    p = NgramProposer(min_n=1, max_n=1, k=3, branches=3, max_nodes=4)
    p.begin([], None)
    assert propose(p, [7, 1, 2, 7, 1, 3, 7, 4, 5, 7]).num_nodes == 4


def test_load_from_dict_and_yaml(tmp_path):
    assert isinstance(load_proposer({"type": "ngram"}), NgramProposer)
    path = tmp_path / "ngram.yaml"
    path.write_text(yaml.safe_dump({"type": "ngram", "k": 7, "branches": 2}))
    p = load_proposer(path)
    assert (p.k, p.branches) == (7, 2)


def test_config_errors_name_valid_choices(tmp_path):
    with pytest.raises(ValueError, match=r"unknown proposer type 'ngarm'; available: \[.*'ngram'"):
        load_proposer({"type": "ngarm"})
    with pytest.raises(ValueError, match=r"proposer type 'ngram': unknown key\(s\) \['kk'\]; valid keys: \['min_n'"):
        load_proposer({"type": "ngram", "kk": 3})
    with pytest.raises(FileNotFoundError):
        load_proposer(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="min_n"):
        load_proposer({"type": "ngram", "min_n": 5, "max_n": 2})


def test_match_just_before_the_end_continues_the_repeating_pattern():
    p = NgramProposer(min_n=2, max_n=2, k=5)
    p.begin([], None)
    # the latest "8 9" starts two tokens from the end: the copy runs on with its own output
    assert propose(p, [1, 8, 9, 8, 9]).token_ids.tolist() == [8, 9, 8, 9, 8]


def vllm_reference(tokens, min_n, max_n, k):
    """vLLM's n-gram rule, written out by brute force: the longest suffix n-gram in [min_n, max_n] that occurred
    earlier, its earliest occurrence, and the tokens after it up to the context's end."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):  # occurrences that end before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_earliest_match_without_wrap_drafts_as_vllm_does():
    """A negative control too: the default (latest match, wrapping copy) drafts otherwise on the same contexts."""
    import random

    rng = random.Random(0)
    differs = 0
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        engine_like = NgramProposer(min_n=1, max_n=3, k=4, match="earliest", wrap=False)
        engine_like.begin([], None)
        assert propose(engine_like, tokens).token_ids.tolist() == vllm_reference(tokens, 1, 3, 4), tokens
        default = NgramProposer(min_n=1, max_n=3, k=4)
        default.begin([], None)
        differs += propose(default, tokens).token_ids.tolist() != vllm_reference(tokens, 1, 3, 4)
    assert differs > 50


def test_export_is_vllms_ngram_config(tmp_path):
    import json
    import warnings

    proposer = NgramProposer(min_n=2, max_n=3, k=6, match="earliest", wrap=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # drafting as the engine does: no warning
        exported = proposer.export(tmp_path / "ngram")
    spec = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 3, "num_speculative_tokens": 6}
    assert exported.speculative_config == spec
    assert json.loads((tmp_path / "ngram" / "speculative_config.json").read_text()) == spec
    assert "vllm serve T --speculative-config" in exported.serve_commands("T")[0]
    with pytest.warns(UserWarning, match="vLLM drafts from the earliest match"):
        NgramProposer().export(tmp_path / "default")


def test_export_refuses_trees_other_formats_and_a_used_directory(tmp_path):
    from draftsmith.proposers.core.errors import InputError

    with pytest.raises(InputError, match="drafts a chain: export needs branches: 1, got branches: 3"):
        NgramProposer(branches=3, match="earliest", wrap=False).export(tmp_path / "a")
    with pytest.raises(InputError, match=r"exports to \['vllm'\], got format 'sglang'"):
        NgramProposer().export(tmp_path / "b", format="sglang")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("x")
    with pytest.raises(InputError, match="is not empty"):
        NgramProposer(match="earliest", wrap=False).export(tmp_path / "c")
    assert (tmp_path / "c" / "keep.txt").read_text() == "x"
    with pytest.raises(InputError, match=r"match must be one of \['latest', 'earliest'\], got 'first'"):
        NgramProposer(match="first")
