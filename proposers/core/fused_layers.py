"""Llama-family decoder layers in a few fused tensor ops, for the lean forward on small models.

A decode step of a small model on a CPU is bound by per-op overhead, not arithmetic: each
HF decoder layer runs about a dozen module calls and thirty tensor ops for one token
(five for each RMSNorm, three projections where one would do). ``FusedLayers`` computes
the same layer from the same weights with one q / k / v matmul, one gate / up matmul and
``F.rms_norm``, writing into the same cache through its ``update``.

It is a fast path, never a replacement: it is built only for layer classes whose math it
knows (Llama, Mistral, Qwen2: RMSNorm, rotary q / k, optional q / k / v biases, SiLU
gated MLP), only while the fused weight copies stay small, and ``LeanForward.probe``
uses it only when it reproduces the model's own logits; otherwise the layers' own
modules run. The copies are taken once: weights changed afterwards are not seen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KNOWN_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
KNOWN_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
MAX_COPY_BYTES = 256 * 2**20  # fused copies of q / k / v and gate / up; above this the layers' own modules run


class FusedLayers:
    """The decoder layers of one model as fused ops over their own weights (build with ``build``)."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = [_fused(layer) for layer in layers]

    @classmethod
    def build(cls, layers: list[nn.Module]) -> FusedLayers | None:
        """``FusedLayers`` for ``layers`` when every one is of a known kind and the copies fit ``MAX_COPY_BYTES``; else None."""
        if not layers or not all(_known(layer) for layer in layers):
            return None
        copy = sum(
            sum(p.weight.numel() * p.weight.element_size() for p in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj))
            for a, m in ((layer.self_attn, layer.mlp) for layer in layers)
        )
        return cls(layers) if copy <= MAX_COPY_BYTES else None

    def __call__(self, index: int, hidden: torch.Tensor, mask, cache, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Layer ``index`` on ``hidden`` ``[1, m, hidden]``: its keys and values go into ``cache`` (layer ``index``)."""
        p = self.layers[index]
        rows = hidden.shape[1]
        qkv = F.linear(_rms_norm(hidden, p["norm1"], p["eps1"]), p["qkv"], p["qkv_bias"])
        q, k, v = qkv.view(1, rows, -1, p["head_dim"]).transpose(1, 2).split(p["heads"], dim=1)
        cos, sin = rotary[0].unsqueeze(1), rotary[1].unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = cache.update(k, v, index)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p["scaling"], enable_gqa=p["gqa"])  # [1, heads, m, d]
        hidden = hidden + F.linear(attended.transpose(1, 2).reshape(1, rows, -1), p["o"], p["o_bias"])
        gate, up = F.linear(_rms_norm(hidden, p["norm2"], p["eps2"]), p["gate_up"]).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, p["down"])


def _known(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in KNOWN_LAYERS or attn is None or mlp is None:
        return False
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if any(type(norm).__name__ not in KNOWN_NORMS for norm in norms):
        return False
    if getattr(attn, "sliding_window", None) or not hasattr(attn, "scaling"):
        return False
    if any(getattr(m, "bias", None) is not None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        return False
    return type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")


def _fused(layer: nn.Module) -> dict:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    biases = [p.bias for p in projections]
    head_dim = attn.head_dim
    heads = (attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim, attn.v_proj.out_features // head_dim)
    with torch.no_grad():
        return {
            "norm1": layer.input_layernorm.weight.detach(),
            "eps1": layer.input_layernorm.variance_epsilon,
            "qkv": torch.cat([p.weight for p in projections]).detach(),
            "qkv_bias": torch.cat(biases).detach() if all(b is not None for b in biases) else None,
            "o": attn.o_proj.weight.detach(),
            "o_bias": attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None,
            "norm2": layer.post_attention_layernorm.weight.detach(),
            "eps2": layer.post_attention_layernorm.variance_epsilon,
            "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
            "down": mlp.down_proj.weight.detach(),
            "head_dim": head_dim,
            "heads": heads,
            # a bool of its own: computed from ``heads`` inside a compiled graph it would be symbolic, which SDPA refuses
            "gqa": heads[0] != heads[1],
            "scaling": attn.scaling,
        }


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalised in float32, cast back, then scaled (the weight inside the kernel when nothing is cast)."""
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)
    return weight * F.rms_norm(hidden.float(), (hidden.shape[-1],), eps=eps).to(hidden.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
