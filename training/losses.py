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

from draftsmith.proposers.core.errors import InputError


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


def cross_entropy_to(draft_logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy to given tokens (the target's greedy ones), masked mean over positions.

    Args:
        draft_logits: ``[batch, seq, vocab]``; tokens: ``[batch, seq]`` long; mask: ``[batch, seq]`` bool.
    """
    per_position = F.cross_entropy(draft_logits.flatten(0, 1).float(), tokens.flatten(), reduction="none")  # [batch * seq]
    return masked_mean(per_position.view_as(mask), mask)


def top1_agreement(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of masked positions where the argmaxes agree: greedy acceptance of one drafted token. Shapes as above."""
    agree = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()  # [batch, seq]
    return masked_mean(agree, mask)


#: The ``loss:`` vocabulary every objective shares; each family's ``draft.loss`` takes the ones it computes.
#: ``cross_entropy`` is to the target's greedy token; the others compare whole distributions.
LOSS_NAMES = ("forward_kl", "reverse_kl", "tvd", "cross_entropy")
#: The distribution losses by name (the draft LM's ``draft.loss``).
LOSSES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "tvd": tvd}


def check_loss(name: str, allowed: tuple[str, ...]) -> str:
    """``name`` when it is one of the ``allowed`` losses (words of ``LOSS_NAMES``); else an InputError naming ``draft.loss``."""
    assert set(allowed) <= set(LOSS_NAMES), allowed
    if name not in allowed:
        raise InputError(f"draft.loss must be one of {list(allowed)}, got {name!r}")
    return name


def decayed_mean(terms: list[torch.Tensor], decay: float) -> torch.Tensor:
    """``sum_j decay**j * terms[j] / sum_j decay**j``: one loss per draft depth (a head, a module, an unrolled step).

    Deeper guesses are accepted only when every shallower one was, so their loss counts less
    (Medusa, Cai et al. 2024; the MTP modules and EAGLE-3's unrolled steps alike).
    """
    total, weights = 0.0, 0.0
    for depth, term in enumerate(terms):
        weight = decay**depth
        total, weights = total + weight * term, weights + weight
    return total / weights
