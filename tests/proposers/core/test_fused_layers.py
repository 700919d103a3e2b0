"""The fused decoder layers of the lean forward: taken only where they give the model's own logits."""

from __future__ import annotations

import pytest
import torch
from heads import tiny_qwen2
from transformers import DynamicCache

import draftsmith.proposers.core.fused_layers as fused_layers
from draftsmith.proposers.core.lean_forward import LeanForward, causal_mask


def lean_steps(model, lean, ids):
    """Logits of decode steps of 1, 3 and 1 tokens (the last with a 4D mask) after a 9-token prefill, and the cache."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :9], cache=cache, use_cache=True)
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        got = [lean(ids[:, 9:10], cache, positions[:, 9:10]), lean(ids[:, 10:13], cache, positions[:, 10:13])]
        got.append(lean(ids[:, 13:], cache, positions[:, 13:], mask=causal_mask(13, 1, torch.float32)))
    return torch.cat(got), cache


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_biases"])
def test_fused_layers_give_the_model_forward_logits_and_cache(arch, make_llama):
    model = make_llama() if arch == "llama_gqa" else tiny_qwen2(layers=2)  # 4 heads over 2 kv heads; q / k / v biases
    lean = LeanForward.probe(model)
    assert lean is not None and lean.fused is not None
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(0))
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        expected = model(ids, cache=full, use_cache=True).logits[0]
    got, cache = lean_steps(model, lean, ids)
    torch.testing.assert_close(got, expected[9:], atol=1e-5, rtol=1e-4)
    for mine, ref in zip(cache.layers, full.layers, strict=True):
        torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-4)


def test_a_wrong_fused_layer_fails_the_probe_and_the_modules_run(make_llama, monkeypatch):
    """Negative control: a fused layer that rotates the wrong half is caught by the probe, which falls back to the modules."""
    model = make_llama()
    monkeypatch.setattr(fused_layers, "_rotate_half", lambda x: torch.cat((x[..., x.shape[-1] // 2 :], -x[..., : x.shape[-1] // 2]), -1))
    lean = LeanForward.probe(model)
    assert lean is not None and lean.fused is None


def test_fusing_is_switched_off_by_the_environment_and_above_the_copy_limit(make_llama, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_FUSED_LAYERS", "0")
    assert LeanForward.probe(make_llama()).fused is None
    monkeypatch.delenv("DRAFTSMITH_FUSED_LAYERS")
    monkeypatch.setattr(fused_layers, "MAX_COPY_BYTES", 1024)
    assert LeanForward.probe(make_llama()).fused is None
    monkeypatch.undo()
    assert LeanForward.probe(make_llama()).fused is not None


def test_one_copy_of_the_fused_weights_per_model(make_llama):
    model = make_llama()
    assert LeanForward.probe(model).fused is LeanForward.probe(model).fused
    assert LeanForward.probe(make_llama()).fused is not LeanForward.probe(model).fused


def test_unknown_layer_kinds_are_not_fused(make_llama):
    model = make_llama()

    class OtherNorm(torch.nn.Module):  # a norm the fused math does not know (Gemma's 1 + w, say)
        def __init__(self, norm):
            super().__init__()
            self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)

    model.model.layers[1].post_attention_layernorm = OtherNorm(model.model.layers[1].post_attention_layernorm)
    assert fused_layers.FusedLayers.build(list(model.model.layers)) is None
    lean = LeanForward.probe(model)
    assert lean is not None and lean.fused is None  # the layers' own modules still run lean
