"""``torch.compile`` of the lean forwards (off by default): same greedy output, the compiled graphs really run."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from draftsmith.proposers.draft_model import DraftModelProposer
from draftsmith.verify import SpeculativeDecoder

PROMPT = torch.tensor([[1, 7, 9, 7, 9, 11, 13, 7, 9, 7]])
ON = {"preallocated_cache": True, "lean_forward": True}  # compilation needs both, whatever DRAFTSMITH_FAST_PATHS says


@pytest.fixture(scope="module")
def draft(make_llama):
    return make_llama(hidden_size=16, layers=1, seed=5)


@pytest.mark.slow  # compiling takes about 35 s per case on one core
@pytest.mark.parametrize("tree_width", [1, 2], ids=["chain", "tree"])
def test_compiled_target_and_draft_decode_like_plain_greedy(model, draft, tree_width, caplog):
    torch._dynamo.reset()
    counters.clear()
    plain = SpeculativeDecoder(model).generate(PROMPT, max_new_tokens=24).new_tokens
    proposer = DraftModelProposer(draft, k=3, tree_width=tree_width, target=model, compile=True, **ON)
    decoder = SpeculativeDecoder(model, proposer, compile_forward=True, **ON, adaptive=False)
    assert decoder.compiled and proposer.compiled
    for _ in range(2):  # the second request reuses the compiled graphs
        result = decoder.generate(PROMPT, max_new_tokens=24)
        assert result.new_tokens == plain
    assert counters["stats"]["unique_graphs"] >= 2  # target and draft graphs were compiled and run
    assert not counters["graph_break"], dict(counters["graph_break"])  # each forward is one graph, not eager pieces between
    assert "runs eagerly" not in caplog.text  # no input kind fell back from its compiled graph
    # the same decoder's plain requests (no proposer) and an eager draft beside a compiled target
    assert SpeculativeDecoder(model, compile_forward=True, **ON).generate(PROMPT, max_new_tokens=24).new_tokens == plain
    eager_draft = DraftModelProposer(draft, k=3, tree_width=tree_width, target=model)
    assert (
        SpeculativeDecoder(model, eager_draft, compile_forward=True, **ON, adaptive=False).generate(PROMPT, max_new_tokens=24).new_tokens
        == plain
    )


def test_compile_without_the_preallocated_cache_is_ignored_with_a_reason(model, draft, caplog):
    with caplog.at_level(logging.WARNING):
        decoder = SpeculativeDecoder(model, preallocated_cache=False, compile_forward=True)
        proposer = DraftModelProposer(draft, lean_forward=False, compile=True)
    assert not decoder.compiled and not proposer.compiled
    assert "target: compile ignored" in caplog.text and "preallocated cache" in caplog.text
    assert "draft: compile ignored" in caplog.text and "lean forward" in caplog.text


def test_decoders_and_drafts_of_one_model_share_its_compiled_forward(model, draft, make_llama):
    # Construction compiles nothing (the first call does): this checks the sharing only.
    first, second = SpeculativeDecoder(model, compile_forward=True, **ON), SpeculativeDecoder(model, compile_forward=True, **ON)
    assert first.forward is second.forward
    assert DraftModelProposer(draft, compile=True, **ON).forward is DraftModelProposer(draft, compile=True, **ON).forward
    other = make_llama(seed=7)  # negative control: another model of the same shapes has its own
    assert SpeculativeDecoder(other, compile_forward=True, **ON).forward is not first.forward
