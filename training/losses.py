"""Distillation losses: how far a draft's next-token distribution is from the frozen target's.

Each loss takes raw logits of both models over the same positions and a mask of the
positions that count, and returns the mean over those positions (nats per token).
Forward KL(target || draft) to the target's full distribution is the default, as in
DistillSpec (Zhou et al. 2024), which compares these divergences for speculative
decoding. TVD is what sampled speculative decoding accepts by (Leviathan et al. 2023:
a drafted token is accepted with probability 1 - TVD(target, draft)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` ``[...]`` where ``mask`` ``[...]`` is true (0 when nothing is masked in)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    assert temperature > 0, f"temperature must be > 0, got {temperature}"
    return F.log_softmax(logits.float() / temperature, dim=-1)


def forward_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(target || draft), masked mean over positions: mass-covering, the default.

    Args:
        draft_logits: ``[batch, seq, vocab]`` the trained model's logits.
        target_logits: ``[batch, seq, vocab]`` the frozen target's logits (no gradient needed).
        mask: ``[batch, seq]`` bool, the positions whose next-token distribution counts.
        temperature: both logits are divided by it before the softmax.
    """
    return forward_kl_to(draft_logits, log_probs(target_logits, temperature), mask, temperature)


def forward_kl_to(draft_logits: torch.Tensor, target_logp: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``forward_kl`` given the target's log-probabilities ``[batch, seq, vocab]`` at ``temperature`` (computed once for several drafts)."""
    draft_logp = log_probs(draft_logits, temperature)
    per_position = (target_logp.exp() * (target_logp - draft_logp)).sum(-1)  # [batch, seq]
    return masked_mean(per_position, mask)


def reverse_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(draft || target), masked mean over positions: mode-seeking. Shapes as in ``forward_kl``."""
    target_logp, draft_logp = log_probs(target_logits, temperature), log_probs(draft_logits, temperature)
    per_position = (draft_logp.exp() * (draft_logp - target_logp)).sum(-1)  # [batch, seq]
    return masked_mean(per_position, mask)


def tvd(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Total variation distance 0.5 * sum |target - draft|, masked mean over positions. Shapes as in ``forward_kl``."""
    target_probs = log_probs(target_logits, temperature).exp()
    draft_probs = log_probs(draft_logits, temperature).exp()
    per_position = 0.5 * (target_probs - draft_probs).abs().sum(-1)  # [batch, seq]
    return masked_mean(per_position, mask)


def top1_agreement(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of masked positions where the argmaxes agree: greedy acceptance of one drafted token. Shapes as above."""
    agree = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()  # [batch, seq]
    return masked_mean(agree, mask)


#: ``loss:`` recipe value -> function
LOSSES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "tvd": tvd}
