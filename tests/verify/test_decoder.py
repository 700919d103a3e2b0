"""The decode loop: greedy identity with every kind of draft, KV commit, limits, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import draftsmith.verify.decoder as decoder_module
from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.cache import PreallocatedLayer
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.proposer import ProposerBase
from draftsmith.proposers.core.types import Draft, ProposeContext
from draftsmith.verify import SpeculativeDecoder
from draftsmith.verify.target import Target, load_target

MAX_NEW = 48


class ScriptedProposer(ProposerBase):
    """Test proposer: builds drafts from a function of the context (oracle, random, trees)."""

    hidden_layers = ()

    def __init__(self, make_draft):
        self.make_draft = make_draft
        self.max_depths: list[int] = []

    def begin(self, prompt, features):
        pass

    def observe(self, result, features):
        pass

    def propose(self, context: ProposeContext) -> Draft:
        self.max_depths.append(context.max_depth)
        return self.make_draft(context)


@pytest.fixture(scope="module")
def prompt():
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (1, 10))
    return torch.cat([ids, ids, ids[:, :3]], dim=1)  # repeats, so lookup has something to find


@pytest.fixture(scope="module")
def reference(model, prompt):
    out = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, prompt.shape[1] :].tolist()


def oracle(reference, prompt_len, k=4):
    def make(context):
        done = len(context.tokens) - prompt_len
        return Draft.chain(reference[done : done + k]) if reference[done : done + k] else Draft.empty()

    return make


def random_chain(seed, k=4):
    g = torch.Generator().manual_seed(seed)
    return lambda context: Draft.chain(torch.randint(0, 128, (k,), generator=g))


def random_tree(reference, prompt_len, seed, nodes=8):
    """Random shapes; each node copies the reference token on its path half the time."""
    g = torch.Generator().manual_seed(seed)

    def make(context):
        done = len(context.tokens) - prompt_len
        parents, tokens, depths = [], [], []
        for i in range(nodes):
            parent = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
            depth = 1 if parent < 0 else depths[parent] + 1
            ref_pos = done + depth - 1
            copy = torch.rand((), generator=g) < 0.5 and ref_pos < len(reference)
            tokens.append(reference[ref_pos] if copy else int(torch.randint(0, 128, (1,), generator=g)))
            parents.append(parent)
            depths.append(depth)
        return Draft(torch.tensor(tokens), torch.tensor(parents))

    return make


def proposers_under_test(reference, prompt_len):
    return {
        "empty": None,
        "ngram_chain": load_proposer({"type": "ngram"}),
        "ngram_tree": load_proposer({"type": "ngram", "min_n": 1, "branches": 4}),
        "ngram_earliest": load_proposer({"type": "ngram", "min_n": 1, "match": "earliest", "wrap": False}),  # as vLLM drafts
        "oracle": ScriptedProposer(oracle(reference, prompt_len)),
        "random_reject": ScriptedProposer(random_chain(seed=0)),
        **{f"random_tree_{s}": ScriptedProposer(random_tree(reference, prompt_len, seed=s)) for s in range(3)},
    }


@pytest.mark.parametrize("fast", [True, False], ids=["fast_paths", "plain_paths"])
@pytest.mark.parametrize(
    "name",
    ["empty", "ngram_chain", "ngram_tree", "ngram_earliest", "oracle", "random_reject", "random_tree_0", "random_tree_1", "random_tree_2"],
)
def test_greedy_is_token_identical_to_generate(name, fast, model, prompt, reference):
    """With the preallocated cache and the lean forward (both probed on the model) and with neither."""
    proposer = proposers_under_test(reference, prompt.shape[1])[name]
    decoder = SpeculativeDecoder(model, proposer, preallocated_cache=fast, lean_forward=fast, adaptive=False)
    assert (decoder.preallocate, decoder.lean is not None) == (fast, fast)  # the probes pass on a Llama
    result = decoder.generate(prompt, max_new_tokens=MAX_NEW)
    assert result.new_tokens == reference
    stats = result.stats
    assert stats.new_tokens == MAX_NEW
    assert stats.tau == pytest.approx(MAX_NEW / stats.target_forwards)
    if name == "empty":
        assert stats.target_forwards == MAX_NEW and stats.tau == 1.0
    if name == "oracle":
        assert stats.tau > 4.0  # 4 accepted + 1 bonus per forward, less the final partial step
        assert all(a == 4 for a in stats.accept_lengths[:-1])
    if name == "random_reject":
        assert stats.tau < 1.2


class CheckedTarget(Target):
    """A Target that, after every commit, compares its cache with a fresh prefill."""

    checks = 0

    def prefill(self, input_ids, capacity=0):
        self.sequence = input_ids[0].tolist()
        return super().prefill(input_ids, capacity)

    def score(self, root_token, draft):
        self._root, self._draft_tokens = root_token, draft.token_ids.tolist()
        return super().score(root_token, draft)

    def commit(self, accepted_nodes):
        super().commit(accepted_nodes)
        self.sequence += [self._root] + [self._draft_tokens[i] for i in accepted_nodes]
        fresh = Target(self.model)  # a DynamicCache filled by one prefill
        fresh.prefill(torch.tensor([self.sequence]))
        assert self.cache_len == len(self.sequence)
        assert all(isinstance(layer, PreallocatedLayer) == self.preallocate for layer in self.cache.layers)
        for mine, ref in zip(self.cache.layers, fresh.cache.layers, strict=True):
            torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-4)
        CheckedTarget.checks += 1


@pytest.mark.parametrize("fast", [True, False], ids=["fast_paths", "plain_paths"])
@pytest.mark.parametrize("name", ["ngram_tree", "random_tree_0", "oracle"])
def test_kv_cache_equals_fresh_prefill_after_every_step(name, fast, model, prompt, reference, monkeypatch):
    monkeypatch.setattr(decoder_module, "Target", CheckedTarget)
    monkeypatch.setattr(decoder_module, "CACHE_HEADROOM", 1)  # small buffers: commits also cross a growth
    CheckedTarget.checks = 0
    proposer = proposers_under_test(reference, prompt.shape[1])[name]
    result = SpeculativeDecoder(model, proposer, preallocated_cache=fast, lean_forward=fast, adaptive=False).generate(
        prompt, max_new_tokens=24
    )
    assert CheckedTarget.checks == result.stats.target_forwards - 1 > 0


def test_eos_inside_an_accepted_block_ends_generation(model, prompt, reference):
    eos = reference[10]
    cut = reference.index(eos) + 1
    result = SpeculativeDecoder(model, ScriptedProposer(oracle(reference, prompt.shape[1], k=6)), adaptive=False).generate(
        prompt, max_new_tokens=MAX_NEW, eos_token_id=eos
    )
    assert result.new_tokens == reference[:cut]


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_output_never_exceeds_max_new_tokens(model, prompt, reference, max_new):
    proposer = ScriptedProposer(oracle(reference, prompt.shape[1], k=6))
    result = SpeculativeDecoder(model, proposer, adaptive=False).generate(prompt, max_new_tokens=max_new)
    assert result.new_tokens == reference[:max_new]
    # a step commits at most max_depth + 1 tokens; the first token comes from the prefill
    assert all(1 <= d <= max_new - 2 for d in proposer.max_depths)


def test_draft_shrinks_to_fit_max_positions(make_llama, prompt):
    small = make_llama(max_positions=prompt.shape[1] + 6)
    reference = small.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, prompt.shape[1] :].tolist()
    proposer = ScriptedProposer(random_chain(seed=1, k=20))
    result = SpeculativeDecoder(small, proposer, adaptive=False).generate(prompt, max_new_tokens=6)
    assert result.new_tokens == reference


def test_warm_up_decodes_plain_then_drafting_and_leaves_the_requests_state_alone(model, make_llama, prompt, reference):
    proposer = ScriptedProposer(oracle(reference, prompt.shape[1]))
    resets = []
    proposer.reset = lambda: resets.append(1)
    decoder = SpeculativeDecoder(model, proposer)
    before = decoder.controller.snapshot()
    seconds = decoder.warm_up(prompt.shape[1])
    assert seconds > 0.0
    assert proposer.max_depths and resets == [1]  # it drafted, at its fixed config, and forgot
    assert decoder.controller.snapshot() == before and sum(decoder.controller.planned) == 0  # the controller learnt nothing
    proposer.max_depths.clear()
    assert decoder.proposer is proposer and decoder.controller is not None
    assert decoder.generate(prompt, max_new_tokens=MAX_NEW).new_tokens == reference
    # a prompt longer than the model's positions is shortened to fit, not refused
    short = make_llama(max_positions=24)
    assert SpeculativeDecoder(short).warm_up(100) > 0.0 and SpeculativeDecoder(short).warm_up(1, new_tokens=40) > 0.0
    for bad in (0, -3, 2.5, "8", True):
        with pytest.raises(InputError, match="prompt_tokens"):
            decoder.warm_up(bad)
    with pytest.raises(InputError, match="new_tokens"):
        decoder.warm_up(4, new_tokens=0)


def test_reset_forgets_what_the_proposer_and_the_decoder_s_own_controller_learnt(model, prompt, reference):
    """After a request, ``reset`` gives the decoder a fresh controller (nothing planned, no costs) and resets the
    proposer; a controller passed in is kept as it is (its owner's to reset); a plain decoder has nothing to forget."""
    resets = []
    proposer = ScriptedProposer(oracle(reference, prompt.shape[1]))
    proposer.reset = lambda: resets.append(1)
    decoder = SpeculativeDecoder(model, proposer)
    assert decoder.generate(prompt, max_new_tokens=MAX_NEW).new_tokens == reference
    learnt = decoder.controller
    assert sum(learnt.planned) > 0 and learnt.plain_seconds is not None
    decoder.reset()
    assert resets == [1] and decoder.controller is not learnt
    assert sum(decoder.controller.planned) == 0 and decoder.controller.plain_seconds is None
    assert decoder.controller.max_depth == learnt.max_depth
    assert decoder.generate(prompt, max_new_tokens=MAX_NEW).new_tokens == reference
    shared = SpeculativeDecoder(model, proposer, controller=learnt)
    shared.reset()
    assert shared.controller is learnt and resets == [1, 1]
    SpeculativeDecoder(model).reset()


def test_sampling_is_seeded(model, prompt):
    decoder = SpeculativeDecoder(model, load_proposer({"type": "ngram", "min_n": 1}), adaptive=False)
    a = decoder.generate(prompt, max_new_tokens=20, temperature=0.8, top_k=20, top_p=0.9, seed=5).new_tokens
    b = decoder.generate(prompt, max_new_tokens=20, temperature=0.8, top_k=20, top_p=0.9, seed=5).new_tokens
    c = decoder.generate(prompt, max_new_tokens=20, temperature=0.8, top_k=20, top_p=0.9, seed=6).new_tokens
    assert a == b and a != c


# ---------------------------------------------------------------------------------------
# Bad input


def bad_draft(kind):
    def make(context):
        if kind == "parent_after_child":
            return Draft(torch.tensor([1, 2]), torch.tensor([1, -1]))
        if kind == "self_parent":
            return Draft(torch.tensor([1, 2]), torch.tensor([-1, 1]))
        if kind == "token_out_of_vocab":
            return Draft.chain([1, 500])
        probs = torch.full((1, 128), 1 / 128)
        if kind == "nan_probs":
            probs[0, 3] = float("nan")
        if kind == "negative_probs":
            probs[0, 3] = -0.1
        if kind == "unnormalised_probs":
            probs = probs * 2
        if kind == "zero_prob_token":
            probs = torch.zeros(1, 128)
            probs[0, 5] = 1.0
        return Draft.chain([7], probs)

    return make


@pytest.mark.parametrize(
    "kind,message",
    [
        ("parent_after_child", "parent"),
        ("self_parent", "parent"),
        ("token_out_of_vocab", "outside the vocabulary"),
        ("nan_probs", "NaN"),
        ("negative_probs", "negative"),
        ("unnormalised_probs", "sums to"),
        ("zero_prob_token", "probability is 0"),
    ],
)
def test_invalid_drafts_are_rejected(kind, message, model, prompt):
    with pytest.raises(ValueError, match=message):
        SpeculativeDecoder(model, ScriptedProposer(bad_draft(kind)), adaptive=False).generate(
            prompt, max_new_tokens=4, temperature=1.0, seed=0
        )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_generation_arguments(kwargs, message, model, prompt):
    with pytest.raises(InputError, match=message):
        SpeculativeDecoder(model).generate(prompt, **kwargs)


def test_bad_prompts(model, make_llama):
    decoder = SpeculativeDecoder(model)
    with pytest.raises(InputError, match=r"\[1, T\]"):
        decoder.generate(torch.tensor([1, 2, 3]))
    with pytest.raises(InputError, match="outside the vocabulary"):
        decoder.generate(torch.tensor([[1, 999]]))
    short = make_llama(max_positions=8)
    with pytest.raises(InputError, match="max_position_embeddings"):
        SpeculativeDecoder(short).generate(torch.ones(1, 9, dtype=torch.long))


def test_proposer_with_another_vocabulary_is_refused(model):
    proposer = ScriptedProposer(random_chain(0))
    proposer.vocab_size = 64
    with pytest.raises(InputError, match="vocabulary size 64 differs from the target's 128"):
        SpeculativeDecoder(model, proposer, adaptive=False)


# ---------------------------------------------------------------------------------------
# Loading a target: broken files are one InputError line naming the file

CORRUPTIONS = {
    "truncated weights": ("model.safetensors", lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])),
    "garbage weights": ("model.safetensors", lambda f: f.write_bytes(b"\x00not safetensors" * 8)),
    "config not JSON": ("config.json", lambda f: f.write_text("{not json")),
    "config without model_type": ("config.json", lambda f: f.write_text(json.dumps(drop_key(json.loads(f.read_text()), "model_type")))),
    "tokenizer.json truncated": ("tokenizer.json", lambda f: f.write_text(f.read_text()[:100])),
    "tokenizer.json of another shape": ("tokenizer.json", lambda f: f.write_text(json.dumps({"model": {"type": "Nope"}}))),
    "tokenizer_config.json not JSON": ("tokenizer_config.json", lambda f: f.write_text("{oops")),
}


def drop_key(values: dict, key: str) -> dict:
    return {k: v for k, v in values.items() if k != key}


def corrupt_copy(source, tmp_path, kind):
    """A copy of the checkpoint directory ``source`` with one file broken as ``kind`` says; returns (directory, broken file)."""
    target = tmp_path / "checkpoint"
    shutil.copytree(source, target)
    name, corrupt = CORRUPTIONS[kind]
    corrupt(target / name)
    return target, target / name


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_load_target_names_the_broken_file_in_one_line(kind, tiny_target_dir, tmp_path):
    directory, broken = corrupt_copy(tiny_target_dir, tmp_path, kind)
    with pytest.raises(InputError) as error:
        load_target(directory)
    message = str(error.value)
    assert message.startswith("target ") and str(broken) in message and "\n" not in message, message
