"""MTP modules on a frozen target (DeepSeek-V3's multi-token prediction, trained after the fact).

Module d (0-based m = d - 1) at position p reads token p + d and module d - 1's output at
p (the target's final hidden state for d = 1), attends causally over its own positions,
and learns the target's distribution at position p + d, which predicts the token d + 1
places after p: forward KL (``loss: forward_kl``) or cross-entropy to the target's greedy token
(``loss: cross_entropy``), weighted by ``decay ** (d - 1)``. The modules run teacher-forced on the
target's features, exactly as ``proposers.mtp`` runs them over committed tokens. Held-out
evaluation reports each module's KL and top-1 agreement with the target (``acc{m}``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from draftsmith.proposers.core.errors import InputError, check_integer, check_real
from draftsmith.proposers.mtp_head import MtpModules, config_for_target, modules_for_target

from .capture import Captured
from .losses import check_loss, cross_entropy_to, decayed_mean, forward_kl_to, log_probs, masked_mean

LOSSES = ("forward_kl", "cross_entropy")


class MtpObjective:
    """Train D MTP modules toward the frozen target (the recipe's ``draft:`` section).

    Args:
        num_modules: D, the modules (depths) trained.
        loss: ``forward_kl`` (to the target's distribution) or ``cross_entropy`` (to its greedy token).
        decay: module d's loss weight is ``decay ** (d - 1)``.
        intermediate_size: the blocks' MLP width (None: the target's).
    """

    needs_logits = True
    hidden_layers: tuple[int, ...] = (-1,)

    def __init__(
        self,
        num_modules: int = 2,
        loss: Literal["forward_kl", "cross_entropy"] = "forward_kl",
        decay: float = 1.0,
        intermediate_size: int | None = None,
    ):
        if check_integer("draft.num_modules", num_modules) < 1:
            raise InputError(f"draft.num_modules must be >= 1, got {num_modules}")
        check_loss(loss, LOSSES)
        if not 0.0 <= check_real("draft.decay", decay) < math.inf:
            raise InputError(f"draft.decay must be a finite number >= 0, got {decay!r}")
        if intermediate_size is not None and check_integer("draft.intermediate_size", intermediate_size) < 1:
            raise InputError(f"draft.intermediate_size must be >= 1, got {intermediate_size}")
        self.num_modules, self.loss_name, self.decay, self.intermediate_size = num_modules, loss, float(decay), intermediate_size

    def check(self, target: nn.Module, tokenizer) -> None:
        self.config = config_for_target(target, self.num_modules, self.intermediate_size)

    def build(self, target: nn.Module, tokenizer, rows=None) -> nn.Module:
        self.check(target, tokenizer)
        return modules_for_target(self.config, target)

    def loss(self, draft: MtpModules, batch: dict[str, torch.Tensor], captured: Captured) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        tokens, mask = batch["input_ids"], batch["loss_mask"]
        target_logp = log_probs(captured.logits, 1.0)
        greedy = captured.logits.argmax(-1)
        hidden = captured.hidden[-1].float()
        seq = tokens.shape[1]
        losses, metrics = [], {}
        for m in range(min(draft.cfg.num_modules, seq - 1)):
            rows = seq - 1 - m  # positions p whose token p + m + 1 exists
            hidden = draft.causal(m, tokens[:, m + 1 : m + 1 + rows], hidden[:, :rows])
            logits = draft.logits(m, hidden).float()
            counted, wanted = mask[:, m + 1 : m + 1 + rows], greedy[:, m + 1 : m + 1 + rows]
            kl = forward_kl_to(logits, target_logp[:, m + 1 : m + 1 + rows], counted)
            losses.append(kl if self.loss_name == "forward_kl" else cross_entropy_to(logits, wanted, counted))
            metrics[f"kl{m}"] = kl.detach()
            metrics[f"acc{m}"] = masked_mean((logits.detach().argmax(-1) == wanted).float(), counted)
        return decayed_mean(losses, self.decay), metrics

    def export(self, draft: MtpModules, out_dir: Path, tokenizer, dtype: torch.dtype, heldout: dict | None = None) -> None:
        draft.save(out_dir, dtype)
