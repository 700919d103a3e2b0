"""Decoding on the model's device: every family token-identical and lawful there, and nothing made off it.

``device`` is the GPU when there is one. Without one it is the CPU running the forms a GPU
runs (``proposers.core.devices.FREE_READS`` emptied: the verifier tests every node at once
and reads once per step, siblings are drawn at once, drafts are read once), which the rest of
the suite, on the CPU's own forms, does not reach. Every family's greedy output equals plain
decoding there; the sampled families keep the target's law, a broken sibling row fails it.

Without a GPU, ``benchmarks.device_mode.StandInDevice`` puts the models on a stand-in device
and fails an op that mixes them with a host tensor, or draws a device tensor with a host
generator, as CUDA would; each family decodes under it, and deliberately broken paths (a host
generator, a tree mask made on the host, a host weight) must be caught.
"""

from __future__ import annotations

import pytest
import torch
from law import V, assert_follows_law, assert_law_rejects

import draftsmith.proposers.core.devices as devices
import draftsmith.proposers.core.dynamic_tree as tree_module
import draftsmith.verify.target as target_module
from benchmarks.device_mode import StandInDevice
from draftsmith.proposers import Draft, InputError, ProposerBase, load_proposer
from draftsmith.proposers.core.sampling import SamplingParams, Siblings
from draftsmith.proposers.dflash import DFlashProposer
from draftsmith.proposers.dflash_head import dflash_config_for_target, dflash_for_target
from draftsmith.proposers.draft_model import DraftModelProposer
from draftsmith.proposers.eagle import EagleProposer
from draftsmith.proposers.eagle_head import config_for_target, draft_for_target
from draftsmith.proposers.medusa import MedusaProposer
from draftsmith.proposers.medusa_head import MedusaHeads
from draftsmith.proposers.mtp import MtpProposer
from draftsmith.proposers.mtp_head import config_for_target as mtp_config
from draftsmith.proposers.mtp_head import modules_for_target
from draftsmith.verify import SpeculativeDecoder

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FAMILIES = ("ngram_tree", "suffix", "draft_model_tree", "medusa", "eagle1", "eagle3_tree", "peagle_tree", "dflash", "mtp", "composite")
PROMPT = [5, 9, 17, 5, 9, 17, 5, 9, 23, 41, 5, 9]


@pytest.fixture
def device(monkeypatch) -> torch.device:
    """The GPU, or the CPU running the GPU's forms."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(devices, "FREE_READS", set())
    return DEVICE


def build(family: str, target, make_llama) -> ProposerBase:
    """A proposer of ``family`` for ``target``, its modules where a loaded proposer puts them (``target.device``); random heads."""
    torch.manual_seed(7)
    vocab, layers = target.config.vocab_size, target.config.num_hidden_layers
    if family == "ngram_tree":
        return load_proposer({"type": "ngram", "min_n": 1, "max_n": 3, "branches": 2})
    if family == "suffix":
        return load_proposer({"type": "suffix"})
    if family == "draft_model_tree":
        draft = make_llama(vocab_size=vocab, hidden_size=16, layers=1, seed=11).to(target.device)
        return DraftModelProposer(draft, k=3, tree_width=2, target=target)
    if family == "medusa":
        return MedusaProposer(MedusaHeads.for_target(target, 3), tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]], target=target)
    if family in ("eagle1", "eagle3_tree", "peagle_tree"):
        version, width = (1, 1) if family == "eagle1" else (3, 2)
        cfg = config_for_target(target, version, parallel_depth=3 if family == "peagle_tree" else 0, mask_token_id=0)
        return EagleProposer(draft_for_target(cfg, target), target, k=3, tree_width=width)
    if family == "dflash":
        cfg = dflash_config_for_target(target, block_size=4, num_layers=1, aux_layers=[1, layers - 1], mask_token_id=0)
        return DFlashProposer(dflash_for_target(cfg, target), target)
    if family == "mtp":
        return MtpProposer(modules_for_target(mtp_config(target, 2), target), k=3, recursive=True, target=target)
    return load_proposer({"type": "composite", "proposers": [{"type": "suffix"}, {"type": "ngram", "min_n": 1, "k": 3}]})


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_token_identical_to_plain_on_the_device(family, device, make_llama):
    target = make_llama(layers=4).to(device)
    prompt = torch.tensor([PROMPT], device=device)
    plain = SpeculativeDecoder(target).generate(prompt, max_new_tokens=24).new_tokens
    proposer = build(family, target, make_llama)
    result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt, max_new_tokens=24)
    assert result.new_tokens == plain
    assert sum(result.stats.drafted_by_depth) > 0  # it drafted


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", FAMILIES)
def test_half_precision_targets_decode_every_family(family, dtype, device, make_llama):
    target = make_llama(layers=4).to(device, dtype)
    prompt = torch.tensor([PROMPT], device=device)
    plain = SpeculativeDecoder(target).generate(prompt, max_new_tokens=16).new_tokens
    decoder = SpeculativeDecoder(target, build(family, target, make_llama), adaptive=False)
    assert decoder.generate(prompt, max_new_tokens=16).new_tokens == plain  # this target's margins are wide: no rounding flips
    assert len(decoder.generate(prompt, max_new_tokens=16, temperature=0.8, seed=1).new_tokens) == 16


N_LAW = 1500
LAW_FAMILIES = {"draft_model_tree": SamplingParams(1.0), "dflash": SamplingParams(0.7), "mtp": SamplingParams(1.0, top_k=5)}
SLOW_LAW = {"eagle3_tree": SamplingParams(1.0), "medusa": SamplingParams(0.7)}


@pytest.fixture
def law_target(make_llama, device):
    return make_llama(vocab_size=V, hidden_size=16, layers=4, seed=5).to(device)


def sharpened_tree(make_llama, device):
    """A one-layer V = 8 target and a sampled 3-wide tree of a confident draft (``test_draft_model``'s law pair): its first
    sibling is often a confident miss, where the later siblings' rows matter most."""
    target = make_llama(vocab_size=V, hidden_size=16, layers=1, seed=5).to(device)
    draft = make_llama(vocab_size=V, hidden_size=16, layers=1, seed=11).to(device)
    with torch.no_grad():
        draft.lm_head.weight.mul_(4.0)
    return target, DraftModelProposer(draft, k=4, tree_width=3, target=target)


@pytest.mark.parametrize("family", [*LAW_FAMILIES, *(pytest.param(f, marks=pytest.mark.slow) for f in SLOW_LAW)])
def test_sampled_output_follows_the_target_law_on_the_device(family, law_target, make_llama, device, law_check):
    sampling = {**LAW_FAMILIES, **SLOW_LAW}[family]
    target, proposer = (
        sharpened_tree(make_llama, device) if family == "draft_model_tree" else (law_target, build(family, law_target, make_llama))
    )
    accepted = assert_follows_law(target, proposer, sampling, N_LAW, law_check, f"{family}: ")
    assert 0.05 < sum(a > 0 for a in accepted) / len(accepted) < 0.95  # not vacuous: first drafts accepted and rejected


def test_negative_control_unconditioned_sibling_rows_fail_the_law_on_the_device(make_llama, device, law_check, monkeypatch):
    drawn_at_once = tree_module.sampled_children_at_once

    def unconditioned(logits, count, sampling, generator) -> Siblings:
        """Broken: every sibling reports its parent's whole row, as if the earlier siblings could be drawn again."""
        siblings = drawn_at_once(logits, count, sampling, generator)
        return Siblings(siblings.tokens, siblings.probs, siblings.masses, siblings.rows[:, :1].expand_as(siblings.rows))

    monkeypatch.setattr(tree_module, "sampled_children_at_once", unconditioned)
    assert_law_rejects(*sharpened_tree(make_llama, device), SamplingParams(1.0), 1000, law_check)


class NanRows(ProposerBase):
    """Broken: a sampled chain whose draft_probs hold a NaN."""

    def begin(self, prompt, features):
        pass

    def propose(self, context):
        probs = torch.full((1, 128), 1 / 128, device=DEVICE)
        probs[0, 3] = float("nan")
        return Draft.chain([5], probs)

    def observe(self, result, features):
        pass


def test_bad_draft_probs_are_named_by_the_verifiers_one_read(device, make_llama):
    target = make_llama().to(device)
    with pytest.raises(ValueError, match="NaN"):
        SpeculativeDecoder(target, NanRows(), adaptive=False).generate(torch.tensor([PROMPT]), max_new_tokens=4, temperature=1.0)


@pytest.mark.parametrize("family", ["eagle3_tree", "dflash", "mtp"])
def test_a_head_away_from_the_target_tensors_it_shares_is_refused(family, make_llama):
    target = make_llama(layers=4)
    proposer = build(family, target, make_llama)
    head = getattr(proposer, "draft", None) or proposer.modules
    with pytest.raises(InputError, match="put the head on cpu"):
        type(proposer)(head.to("meta"), target=target)  # moving the head does not move the target's embedding it reads


# -- a stand-in device on the CPU ------------------------------------------------------------


def decode_on_stand_in(target, family, make_llama, temperature: float, proposer=None) -> StandInDevice:
    """Build ``family``'s proposer and decode greedy or sampled with the models on a stand-in device; return the mode."""
    with StandInDevice(target) as mode:
        proposer = proposer if proposer is not None else build(family, target, make_llama) if family else None
        decoder = SpeculativeDecoder(target, proposer, adaptive=False)
        prompt = torch.tensor([PROMPT])  # on the host, as a tokenizer gives it: the decoder moves it
        mode.syncs.clear()
        result = decoder.generate(prompt, max_new_tokens=16, temperature=temperature, seed=3)
    mode.steps = result.stats.steps
    return mode


@pytest.fixture
def stand_in(monkeypatch, make_llama):
    """A 4-layer target for the stand-in device, decoding in the GPU's forms."""
    monkeypatch.setattr(devices, "FREE_READS", set())
    return make_llama(layers=4)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("family", (None, *FAMILIES))
def test_no_tensor_is_made_off_the_model_device(family, temperature, stand_in, make_llama):
    mode = decode_on_stand_in(stand_in, family, make_llama, temperature)
    assert mode.violations == []
    if family in (None, "ngram_tree", "suffix", "composite"):  # host drafts: the verifier's one read per step, nothing else
        assert sum(mode.syncs.values()) <= mode.steps + 2  # + the first token's and the request's


def test_negative_control_a_host_generator_is_caught(stand_in, make_llama, monkeypatch):
    monkeypatch.setattr(devices.SeededGenerators, "on", lambda self, device: torch.Generator().manual_seed(0))  # the old decoder's
    mode = decode_on_stand_in(stand_in, "ngram_tree", make_llama, 0.8)
    assert any("host generator" in v for v in mode.violations), mode.violations


def test_negative_control_a_tree_mask_made_on_the_host_is_caught(stand_in, make_llama, monkeypatch):
    made_on = target_module.tree_attention_mask
    monkeypatch.setattr(target_module, "tree_attention_mask", lambda parents, past, dtype, device: made_on(parents, past, dtype))
    mode = decode_on_stand_in(stand_in, "eagle3_tree", make_llama, 0.0)
    assert any("mixes device tensors with host tensors" in v for v in mode.violations), mode.violations


class HostWeight(ProposerBase):
    """Broken: scores the target's last feature with a weight made without the model's device."""

    hidden_layers = (-1,)

    def begin(self, prompt, features):
        self.features = features

    def propose(self, context):
        hidden = self.features.hidden_states[-1][-1]
        token = int((hidden @ torch.ones(hidden.shape[-1], 128)).argmax())
        return Draft.chain([token])

    def observe(self, result, features):
        self.features = features


def test_negative_control_a_host_weight_in_a_proposer_is_caught(stand_in, make_llama):
    mode = decode_on_stand_in(stand_in, None, make_llama, 0.0, proposer=HostWeight())
    assert any("matmul mixes" in v for v in mode.violations), mode.violations
