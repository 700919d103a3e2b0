"""Draft-LM distillation: a small causal LM that shares the target's tokenizer learns its distribution.

The draft (a fresh Llama, or a checkpoint) is trained in full or through ``peft`` LoRA
adapters toward the target's next-token distribution at every position that counts
(forward KL by default, as in DistillSpec, Zhou et al. 2024; ``training.losses``). It
exports as a plain ``save_pretrained`` directory that ``{type: draft_model, model: DIR}`` loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import GenerationConfig

from draftsmith.proposers.core.errors import InputError, check_real
from draftsmith.proposers.core.models import context_limit, load_causal_lm
from draftsmith.proposers.draft_model import check_vocabulary, warn_if_bigger

from .capture import Captured
from .common import small_llama
from .losses import LOSSES, check_loss, forward_kl, top1_agreement

FALLBACK_POSITIONS = 8192  # a fresh draft's positions when the target's config states none


@dataclass(frozen=True)
class DraftInit:
    """A fresh Llama draft; vocabulary, positions and special tokens come from the target."""

    num_layers: int = 1
    hidden_size: int = 128
    intermediate_size: int = 384
    num_heads: int = 4
    num_kv_heads: int = 4
    copy_target_embeddings: bool = False  # start from the target's token embeddings (needs the target's hidden_size)


@dataclass(frozen=True)
class LoraSettings:
    """``peft`` LoRA adapters on the draft's ``target_modules`` instead of full fine-tuning."""

    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    merge: bool = False  # also write the merged model (a plain save_pretrained directory) to output_dir


class DraftLMObjective:
    """Distil a draft LM toward the frozen target (the recipe's ``draft:`` section).

    Args:
        pretrained: a causal LM directory sharing the target's vocabulary to start from;
            None builds a fresh model from ``init``.
        init: the fresh draft's shape.
        lora: train LoRA adapters on ``pretrained`` instead of every weight.
        loss: ``forward_kl`` (default), ``reverse_kl`` or ``tvd`` (``training.losses``).
        temperature: both distributions are softened by it in the loss.
    """

    hidden_layers: tuple[int, ...] = ()
    needs_logits = True

    def __init__(
        self,
        pretrained: str | None = None,
        init: DraftInit = DraftInit(),
        lora: LoraSettings = LoraSettings(),
        loss: Literal["forward_kl", "reverse_kl", "tvd"] = "forward_kl",
        temperature: float = 1.0,
    ):
        if lora.enabled and pretrained is None:
            raise InputError("lora.enabled needs draft.pretrained (a trained draft to adapt); a fresh draft is trained in full")
        check_loss(loss, tuple(LOSSES))
        if not 0.0 < check_real("draft.temperature", temperature) < math.inf:
            raise InputError(f"draft.temperature must be a finite number > 0, got {temperature!r}")
        self.pretrained, self.init, self.lora, self.loss_name, self.temperature = pretrained, init, lora, loss, temperature

    def check(self, target: nn.Module, tokenizer) -> None:
        if self.pretrained is not None and not Path(self.pretrained).is_dir():
            raise FileNotFoundError(f"draft.pretrained {self.pretrained} is not a directory")

    def build(self, target: nn.Module, tokenizer, rows=None) -> nn.Module:
        """The draft: loaded from ``pretrained`` (with LoRA adapters when asked), or a fresh Llama."""
        if self.pretrained is not None:
            draft = load_causal_lm(Path(self.pretrained), "draft.pretrained", dtype=torch.float32)
            check_vocabulary(draft, target)
        else:
            draft = fresh_llama(self.init, target, tokenizer)
        warn_if_bigger(draft, target)
        if self.lora.enabled:
            draft = apply_lora(draft, self.lora)
        return draft

    def loss(self, draft: nn.Module, batch: dict[str, torch.Tensor], captured: Captured) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The draft's divergence from the target on ``batch``; metrics: forward KL at temperature 1 and top-1 agreement."""
        mask, target_logits = batch["loss_mask"], captured.logits  # [batch, seq], [batch, seq, vocab]
        draft_logits = draft(input_ids=batch["input_ids"]).logits  # [batch, seq, vocab]
        loss = LOSSES[self.loss_name](draft_logits, target_logits, mask, self.temperature)
        plain_kl = self.loss_name == "forward_kl" and self.temperature == 1.0
        kl = loss.detach() if plain_kl else forward_kl(draft_logits.detach(), target_logits, mask)
        return loss, {"forward_kl": kl, "top1": top1_agreement(draft_logits.detach(), target_logits, mask)}

    def export(self, draft: nn.Module, out_dir: Path, tokenizer, dtype: torch.dtype, heldout: dict | None = None) -> None:
        """A ``save_pretrained`` directory with the tokenizer; LoRA: the adapter in ``adapter/`` (and the merged draft on request)."""
        if self.lora.enabled:
            draft.save_pretrained(out_dir / "adapter")
            if not self.lora.merge:
                return
            draft = draft.merge_and_unload()
        draft.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        draft.to(dtype).save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)


def fresh_llama(init: DraftInit, target: nn.Module, tokenizer) -> nn.Module:
    """A fresh Llama draft with the target's vocabulary, positions and special tokens."""
    vocab, positions = target.config.vocab_size, context_limit(target) or FALLBACK_POSITIONS
    draft = small_llama(
        tokenizer, vocab, init.hidden_size, init.intermediate_size, init.num_layers, init.num_heads, init.num_kv_heads, positions
    )
    if init.copy_target_embeddings:
        source = target.get_input_embeddings().weight
        if source.shape != draft.get_input_embeddings().weight.shape:
            raise InputError(f"copy_target_embeddings: target embeddings {tuple(source.shape)} do not fit the draft's hidden_size")
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(source.float())
    return draft


def apply_lora(draft: nn.Module, lora: LoraSettings) -> nn.Module:
    """Freeze the draft and add trainable LoRA adapters (``peft``) on ``lora.target_modules``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), task_type="CAUSAL_LM"
    )
    return get_peft_model(draft, config)
