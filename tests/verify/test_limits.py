"""Context limits and cache kinds, for targets and drafts, RoPE (Llama) and learned positions (GPT-2).

- prompt + max_new_tokens beyond the target's positions is refused up front;
- a draft with fewer positions than the request drafts while its context fits, then
  returns empty drafts: the output stays token-identical to plain greedy decoding;
- sliding-window models are refused when the decoder or the draft proposer is built.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.models import context_limit
from draftsmith.proposers.draft_model import DraftModelProposer
from draftsmith.verify import SpeculativeDecoder
from draftsmith.verify.target import Target

PROMPT = torch.tensor([[5, 9, 17, 33, 5, 9, 17, 60, 71, 5, 9, 17]])
PROMPT_LEN = PROMPT.shape[1]


def tiny_gpt2(n_positions: int, n_embd: int = 32, seed: int = 0) -> GPT2LMHeadModel:
    """A fixed-seed GPT-2 (learned positions: a position past ``n_positions`` is an IndexError)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=128, n_positions=n_positions, n_embd=n_embd, n_layer=2, n_head=4, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # greedy argmaxes far from ties, as in the Llama fixture
    return model


def plain_greedy(model, max_new: int) -> list[int]:
    out = model.generate(PROMPT, max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, PROMPT_LEN:].tolist()


# ---------------------------------------------------------------------------------------
# The target's positions


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_prompt_plus_output_beyond_the_target_positions_is_refused(family, make_llama):
    limit = PROMPT_LEN + 8
    target = make_llama(max_positions=limit) if family == "llama" else tiny_gpt2(limit)
    assert context_limit(target) == limit
    decoder = SpeculativeDecoder(target, load_proposer({"type": "ngram", "min_n": 1}), adaptive=False)
    message = rf"prompt of {PROMPT_LEN} tokens \+ max_new_tokens=9 needs {limit + 1} positions, more than the target's {limit}"
    with pytest.raises(InputError, match=message):
        decoder.generate(PROMPT, max_new_tokens=9)
    assert decoder.generate(PROMPT, max_new_tokens=8).new_tokens == plain_greedy(target, 8)  # exactly full is fine


def test_a_model_whose_config_states_no_positions_is_not_limited():
    torch.manual_seed(0)
    target = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)).eval()  # ALiBi: no position table
    assert context_limit(target) is None
    decoder = SpeculativeDecoder(target, load_proposer({"type": "ngram", "min_n": 1}), adaptive=False)
    assert decoder.check_request(PROMPT, 10**6, 0.0, 0, 1.0, None, None).max_new_tokens == 10**6
    assert decoder.generate(PROMPT, max_new_tokens=10).new_tokens == plain_greedy(target, 10)


# ---------------------------------------------------------------------------------------
# A draft with fewer positions than the request

DRAFT_LIMIT = PROMPT_LEN + 10
MAX_NEW = 24  # the request ends 14 positions past the draft's limit


def short_draft(family: str, make_llama):
    if family == "llama":  # the target's own weights (seed 0), so drafts are accepted up to the limit
        return make_llama(max_positions=DRAFT_LIMIT)
    return tiny_gpt2(DRAFT_LIMIT, n_embd=16, seed=3)


def record_positions(draft, proposer) -> list[int]:
    """Every position id the draft's position embedding sees from now on (the learned table for GPT-2; Llama's below).

    Llama's rotary cos / sin come from a table in the lean forward, whose fused layers never
    call the layer modules, so its position ids are read where they go in: the lean
    forward's arguments, and the first decoder layer's for the model's own forward.
    """
    seen: list[int] = []
    if isinstance(draft, GPT2LMHeadModel):
        draft.transformer.wpe.register_forward_pre_hook(lambda module, args: seen.extend(args[0].flatten().tolist()))
        return seen
    hook = lambda module, args, kwargs: seen.extend(kwargs["position_ids"].flatten().tolist())  # noqa: E731
    draft.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    lean = proposer.forward
    if lean is not None:

        def recorded(input_ids, cache, position_ids, *args, **kwargs):
            seen.extend(position_ids.flatten().tolist())
            return lean(input_ids, cache, position_ids, *args, **kwargs)

        proposer.forward = recorded
    return seen


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_draft_with_fewer_positions_drafts_until_full_then_decoding_continues_plain(family, tree_width, model, make_llama):
    draft_lm = short_draft(family, make_llama)
    proposer = DraftModelProposer(draft_lm, k=4, tree_width=tree_width, target=model)
    positions = record_positions(draft_lm, proposer)
    propose, steps = proposer.propose, []  # (committed tokens, draft depth) per propose

    def recorded_propose(context):
        draft = propose(context)
        steps.append((len(context.tokens), max(_depths(draft.parent_list), default=0)))
        return draft

    proposer.propose = recorded_propose
    result = SpeculativeDecoder(model, proposer, adaptive=False).generate(PROMPT, max_new_tokens=MAX_NEW)
    assert result.new_tokens == plain_greedy(model, MAX_NEW)
    # The policy: a draft only while committed tokens + draft fit the draft's positions; none beyond.
    assert all(depth == 0 or committed + depth <= DRAFT_LIMIT for committed, depth in steps), steps
    assert max(positions) < DRAFT_LIMIT, max(positions)
    assert any(depth > 0 for _, depth in steps), steps  # it drafted while there was room
    assert any(committed >= DRAFT_LIMIT for committed, _ in steps), steps  # and the request went on past the limit
    if family == "llama":  # the copy's drafts were accepted in full while they fitted
        assert result.stats.accept_lengths[:2] == [4, 4], result.stats.accept_lengths


def _depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def test_a_draft_with_no_room_after_the_prompt_never_runs(model):
    draft = tiny_gpt2(PROMPT_LEN, n_embd=16, seed=3)  # fits the prompt, not one token more
    result = SpeculativeDecoder(model, DraftModelProposer(draft, target=model), adaptive=False).generate(PROMPT, max_new_tokens=6)
    assert result.new_tokens == plain_greedy(model, 6) and result.stats.drafted_tokens == 0


# ---------------------------------------------------------------------------------------
# Sliding-window caches are refused (rejected guesses cannot be dropped from them)


def windowed(family: str, sliding_window: int | None = 4, layers: int = 2):
    """A tiny Mistral or Qwen2 whose layers all use sliding attention (``sliding_window=None``: none do)."""
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512,
    )  # fmt: skip
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=sliding_window, **sizes)).eval()
    window = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0) if sliding_window else {}
    return Qwen2ForCausalLM(Qwen2Config(**window, **sizes)).eval()


FAMILY_CLASS = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_sliding_window_draft_is_refused_at_construction(family, tree_width, model):
    message = rf"draft model {FAMILY_CLASS[family]} has DynamicSlidingWindowLayer cache layers \(sliding_window=4\)"
    with pytest.raises(InputError, match=message):
        DraftModelProposer(windowed(family), tree_width=tree_width, target=model)


@pytest.mark.parametrize("proposer", ["none", "ngram_chain", "ngram_tree"])
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_sliding_window_target_is_refused_at_construction(family, proposer):
    target = windowed(family)
    config = {"none": None, "ngram_chain": {"type": "ngram"}, "ngram_tree": {"type": "ngram", "min_n": 1, "branches": 3}}[proposer]
    message = rf"target model {FAMILY_CLASS[family]} has DynamicSlidingWindowLayer cache layers"
    with pytest.raises(InputError, match=message):
        SpeculativeDecoder(target, load_proposer(config) if config else None, adaptive=False)
    with pytest.raises(InputError, match=message):
        Target(target)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_control_the_same_models_without_a_window_decode_token_identically(family, model):
    """The refusals above are for the window: the same architectures without one work as target and as draft."""
    target = windowed(family, sliding_window=None)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    for tree_width in (1, 3):
        proposer = DraftModelProposer(windowed(family, sliding_window=None, layers=1), tree_width=tree_width, target=model)
        assert SpeculativeDecoder(model, proposer, adaptive=False).generate(PROMPT, max_new_tokens=12).new_tokens == plain_greedy(model, 12)
    tree = load_proposer({"type": "ngram", "min_n": 1, "branches": 3})
    assert SpeculativeDecoder(target, tree, adaptive=False).generate(PROMPT, max_new_tokens=12).new_tokens == plain_greedy(target, 12)
