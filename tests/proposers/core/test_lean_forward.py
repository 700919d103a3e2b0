"""The lean draft forward: used only where it reproduces the model's own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel

from draftsmith.proposers.core.lean_forward import LeanForward, causal_mask


def test_lean_steps_match_the_model_forward(model):
    """Decode steps of 1, 3 and 1 tokens (causal, then one with a tree-style 4D mask) give the forward's logits and cache."""
    lean = LeanForward.probe(model)
    assert lean is not None
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full_cache = DynamicCache(config=model.config)
        expected = model(ids, cache=full_cache, use_cache=True).logits[0]
        cache = DynamicCache(config=model.config)
        model(ids[:, :9], cache=cache, use_cache=True)
        positions = torch.arange(14).unsqueeze(0)
        got = [lean(ids[:, 9:10], cache, positions[:, 9:10]), lean(ids[:, 10:13], cache, positions[:, 10:13])]
        got.append(lean(ids[:, 13:], cache, positions[:, 13:], mask=causal_mask(13, 1, torch.float32)))
    torch.testing.assert_close(torch.cat(got), expected[9:], atol=1e-5, rtol=1e-4)
    for mine, ref in zip(cache.layers, full_cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # last=k keeps the final rows only
        cache = DynamicCache(config=model.config)
        model(ids[:, :9], cache=cache, use_cache=True)
        torch.testing.assert_close(lean(ids[:, 9:], cache, positions[:, 9:], last=1), expected[-1:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}])
def test_rotary_table_rows_equal_the_rotary_module(rope, make_llama):
    """Table rows (grown past the first 256 positions, in any order) equal the module's own cos / sin; dynamic RoPE keeps the module."""
    model = make_llama(max_positions=64)
    if rope is not None:
        model.config.rope_parameters = {**model.config.rope_parameters, **rope}
        model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    lean = LeanForward(model)
    assert lean.static_rotary == (rope is None or rope["rope_type"] != "dynamic")
    hidden = torch.zeros(1, 3, model.config.hidden_size)
    for positions in ([[5, 0, 17]], [[300, 299, 2]], [[1023, 40, 511]]):
        position_ids = torch.tensor(positions)
        got = lean._rotary(position_ids, max(positions[0]) + 1)
        expected = model.model.rotary_emb(hidden, position_ids=position_ids)
        for mine, ref in zip(got, expected, strict=True):
            assert torch.equal(mine, ref)
    if lean.static_rotary:
        assert lean.rotary_table[0].shape[0] >= 1024  # grown by doubling as positions ran past it
    else:  # negative control: a table of dynamic RoPE (rescaled for the table's length) is wrong for short inputs
        lean.static_rotary = True
        lean._rotary(torch.tensor([[1023, 0, 1]]), 1024)
        position_ids = torch.tensor([[5, 0, 17]])
        got = lean._rotary(position_ids, 18)
        assert not torch.equal(got[0], model.model.rotary_emb(hidden, position_ids=position_ids)[0])


def test_causal_mask():
    mask = causal_mask(2, 3, torch.float32)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert mask.min() == torch.finfo(torch.float32).min


def gemma(version: int, **overrides):
    """Llama layouts with more in the wrapper: Gemma scales the embeddings (inside its embedding
    module), Gemma 2 soft-caps the final logits (in ``forward``) and alternates sliding-window layers."""
    torch.manual_seed(0)
    config_class, model_class = (GemmaConfig, GemmaForCausalLM) if version == 1 else (Gemma2Config, Gemma2ForCausalLM)
    config = config_class(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, **overrides,
    )  # fmt: skip
    return model_class(config).eval()


def test_probe_accepts_work_done_inside_the_submodules():
    assert LeanForward.probe(gemma(1)) is not None


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: gemma(2, final_logit_softcapping=1.0, layer_types=["full_attention"] * 2), id="extra-work-in-forward"),
        pytest.param(lambda: gemma(2, final_logit_softcapping=None), id="sliding-window-layers"),
        pytest.param(lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4)).eval(), id="other-layout"),
    ],
)
def test_probe_refuses_models_it_does_not_reproduce(build):
    model = build()
    assert LeanForward.probe(model) is None


def test_probe_control_without_the_differences():
    """The same Gemma 2 without soft-capping or sliding windows passes: the refusals above are for those reasons."""
    assert LeanForward.probe(gemma(2, final_logit_softcapping=None, layer_types=["full_attention"] * 2)) is not None


def test_probe_refuses_attention_that_ignores_additive_masks(model, monkeypatch):
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
    assert LeanForward.probe(model) is None
