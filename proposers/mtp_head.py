"""MTP modules (DeepSeek-V3 style): their shape, the module, its checkpoints (``proposers.mtp`` drafts with them).

Module d (1 .. D) reads the hidden state from depth d - 1 (the target's final hidden
state for d = 1) and the embedding of the token at depth d, normalises each (``hnorm``,
``enorm``), projects their concatenation (``eh_proj``) and runs one transformer block;
its output h_d, normalised (``shared_head.norm``) and scored by the target's LM head,
predicts the token at depth d + 1. The embedding and LM head are the target's. The layouts
model checkpoints ship are ``proposers.mtp_native``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from .core.cache import PreallocatedLayer
from .core.checkpoint import CONFIG, WEIGHTS, check_fits_target, check_tensors, read_checkpoint
from .core.draft_layers import MLP, Attention, RMSNorm, RotaryTable, cached_attention, layer_shape
from .core.errors import InputError, check_integer
from .core.models import output_vocab_size

BIASED_ATTENTION = ("qwen2", "mimo")  # model types whose attention has q / k / v biases without saying so in the config


@dataclass(frozen=True)
class MtpConfig:
    """The shape of D MTP modules (``config.json``: ``num_nextn_predict_layers`` and draftsmith's copy under ``draftsmith_mtp``)."""

    hidden_size: int
    vocab_size: int
    num_modules: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "vocab_size", "num_modules", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if check_integer(name, getattr(self, name)) < 1:
                raise InputError(f"MTP {name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise InputError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


class SharedHead(nn.Module):
    def __init__(self, cfg: MtpConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MtpModule(nn.Module):
    """One module: ``enorm``, ``hnorm``, ``eh_proj``, a Llama-style block, ``shared_head.norm`` (DeepSeek-V3's names)."""

    def __init__(self, cfg: MtpConfig):
        super().__init__()
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.self_attn = Attention(hidden, hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = MLP(hidden, cfg.intermediate_size)
        self.shared_head = SharedHead(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """Outputs ``[batch, m, hidden]``; ``attend(q, k, v)`` does the attention (causal in training, cached in decoding)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)
        x = x + self.self_attn.out(attend(q, k, v))
        return x + self.mlp(self.post_attention_layernorm(x))


class MtpModules(nn.Module):
    """D MTP modules sharing the target's embedding and LM head (which are not parameters here)."""

    def __init__(self, cfg: MtpConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(MtpModule(cfg) for _ in range(cfg.num_modules))
        self.shared = {"embed": embed_weight.detach(), "lm_head": lm_head_weight.detach()}
        self.rotary = RotaryTable(cfg.head_dim, cfg.rope_theta)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.shared["embed"])

    def logits(self, d: int, hidden: torch.Tensor) -> torch.Tensor:
        """Module d's (0-based) logits over the target's vocabulary."""
        head = self.shared["lm_head"]  # the target's, in its dtype: a half-precision head is not copied to fp32 per step
        return F.linear(self.layers[d].shared_head.norm(hidden).to(head.dtype), head)

    def run(self, d: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | range | list[int], attend) -> torch.Tensor:
        cos, sin = self.rotary(positions, self.layers[d].eh_proj.weight.device)
        return self.layers[d](self.embed(tokens), hidden, cos, sin, attend)

    def step(
        self, d: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | range | list[int], cache: PreallocatedLayer
    ) -> torch.Tensor:
        """Module d over new rows after its cache, causally: outputs ``[1, m, hidden]``."""
        attn = self.layers[d].self_attn
        return self.run(d, tokens, hidden, positions, lambda q, k, v: cached_attention(attn, q, k, v, cache, None))

    def causal(self, d: int, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Module d over whole rows with causal attention (training): outputs ``[batch, rows, hidden]``."""
        attn = self.layers[d].self_attn
        positions = range(tokens.shape[1])

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, attn.expand_kv(k), attn.expand_kv(v), is_causal=True)

        return self.run(d, tokens, hidden, positions, attend)

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        """``config.json`` (``num_nextn_predict_layers`` and the shape) and ``model.safetensors`` (``layers.{d}.*``)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = {
            "model_type": "draftsmith_mtp",
            "num_nextn_predict_layers": self.cfg.num_modules,
            "hidden_size": self.cfg.hidden_size,
            "vocab_size": self.cfg.vocab_size,
            "draftsmith_mtp": asdict(self.cfg),
        }
        (out / CONFIG).write_text(json.dumps(config, indent=1))
        tensors = {name: t.detach().to(dtype).contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS))


def config_for_target(target: nn.Module, num_modules: int, intermediate_size: int | None = None) -> MtpConfig:
    """MTP modules as wide as ``target``, with its heads, rotary and vocabulary."""
    tc = target.config
    return MtpConfig(
        hidden_size=tc.hidden_size,
        vocab_size=output_vocab_size(target),
        num_modules=num_modules,
        attention_bias=bool(getattr(tc, "attention_bias", False)) or tc.model_type in BIASED_ATTENTION,
        **layer_shape(target, intermediate_size=intermediate_size),
    )


def modules_for_target(cfg: MtpConfig, target: nn.Module) -> MtpModules:
    """Modules of shape ``cfg`` sharing ``target``'s embedding and LM head; InputError for another hidden size or vocabulary."""
    check_fits_target("MTP modules", target, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)
    modules = MtpModules(cfg, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return modules.to(target.device)


def load_modules(path: str | Path, target: nn.Module) -> MtpModules:
    """Load modules written by ``MtpModules.save``; a bad file or another model's modules is one InputError line."""
    checkpoint = read_checkpoint(path, "MTP")
    try:
        cfg = MtpConfig(**checkpoint.config["draftsmith_mtp"])
    except (KeyError, TypeError, ValueError) as error:
        raise InputError(f"MTP config {checkpoint.path / CONFIG} cannot be used: {error}") from error
    modules = modules_for_target(cfg, target)
    check_tensors(checkpoint.weights, checkpoint.tensors, modules.state_dict(), "MTP")
    modules.load_state_dict({name: t.float() for name, t in checkpoint.tensors.items()})
    return modules.eval()
