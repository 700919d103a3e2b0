"""Sampling: one processing of next-token distributions for the target and every draft, and the draws proposers make.

``SamplingParams`` and ``logits_to_probs`` process target and draft logits exactly alike
(temperature, top-k, top-p); the draws (top-k children, siblings sampled without
replacement) are what tree builders and proposers use to pick draft tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .devices import host_lists
from .errors import InputError, check_integer, check_real

MIN_SIBLING_MASS = 1e-6  # stop drawing siblings when less draft mass than this is left


@dataclass(frozen=True)
class SamplingParams:
    """How next-token distributions are processed, identically for target and draft.

    Args:
        temperature: 0 selects greedy decoding (its own branch); a finite value > 0 divides the logits.
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: keep the smallest set of tokens whose mass reaches top_p; 1.0 keeps all.

    Numpy scalars are accepted and stored as Python numbers; anything else that is not a
    real number (an integer for ``top_k``) is an ``InputError``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        temperature = check_real("temperature", self.temperature)
        top_p = check_real("top_p", self.top_p)
        top_k = check_integer("top_k", self.top_k)
        # ``not x >= 0`` also refuses NaN; inf would sample uniformly, ignoring top-k / top-p.
        if not 0.0 <= temperature < math.inf:
            raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1] (1 = no top-p), got {self.top_p!r}")
        if top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = no top-k), got {self.top_k!r}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, sampling: SamplingParams, check: bool = True) -> torch.Tensor:
    """Turn logits into the processed sampling distribution (temperature, top-k, top-p).

    The same function serves the target and every proposer, so draft and target
    distributions are processed exactly alike. At temperature 0 the result is the
    point mass on the argmax.

    Args:
        logits: ``[..., vocab]`` raw logits; ``-inf`` marks forbidden tokens.
        sampling: the processing to apply.
        check: raise ``ValueError`` when a row is entirely masked (one read by the host, a sync on a
            GPU); False leaves that to the caller (the verifier folds it into its own read).
    Returns:
        ``[..., vocab]`` float32 probabilities, each row summing to 1.
    """
    logits = logits.float()
    if check and not torch.isfinite(logits.amax(dim=-1)).all():
        raise ValueError("every token is masked (-inf/NaN logits): there is no distribution to sample from")
    if sampling.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    # Shift by the row maximum before dividing: the top logit becomes 0 and every other one
    # < 0, so a tiny temperature drives them to -inf (the argmax point mass, ties shared)
    # instead of overflowing to inf and a NaN softmax. A temperature below float32's
    # smallest normal number (down to 5e-324) divides in float64, where it is not 0.
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    if sampling.temperature >= torch.finfo(torch.float32).tiny:
        logits = shifted / sampling.temperature
    else:
        logits = (shifted.double() / sampling.temperature).float()
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p; the top
        # token always survives, so the kept set is never empty.
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw_rows(rows: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token from each row of ``rows`` ``[R, vocab]`` (non-negative, a positive total each), by the inverse of its CDF: ``[R]``.

    One uniform per row, from ``generator`` on the rows' device; the CDF in float64, so a
    large vocabulary's small probabilities keep their share. The GPU forms draw with it: no
    read, no device-side assert, and many rows in a few ops (``torch.multinomial`` draws the
    same law, 70 us a row on a CPU core against 15 us here; the CPU forms keep it, and with it
    the CPU's seeded streams).
    """
    cdf = rows.cumsum(-1, dtype=torch.float64)  # [R, vocab]
    # u in (0, 1]: the first token whose CDF reaches u * total has positive probability (u = 0 would pick a leading zero)
    uniform = 1.0 - torch.rand(rows.shape[0], 1, generator=generator, device=rows.device, dtype=torch.float64)
    return torch.searchsorted(cdf, uniform * cdf[:, -1:]).squeeze(1).clamp_(max=rows.shape[-1] - 1)


def top_k_rows(logits: torch.Tensor, count: int) -> tuple[list[list[int]], list[list[float]]]:
    """The ``count`` most likely tokens of each row of ``logits`` ``[rows, vocab]`` and their raw softmax probabilities.

    Deterministic children (point masses for the verifier): scores and confidences use the
    raw softmax at any temperature, as in EAGLE-2 (a processed greedy distribution is a
    point mass); which deterministic children are proposed never affects what is lossless.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    values, indices = torch.topk(probs, min(count, probs.shape[-1]), dim=-1)
    return host_lists(indices, values)  # one read


def sampled_children(
    logits: torch.Tensor, count: int, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], list[float], list[torch.Tensor]]:
    """Up to ``count`` distinct tokens drawn from the processed ``logits`` ``[vocab]``: tokens, draft probabilities, rows."""
    probs = logits_to_probs(logits, sampling)
    picks = sample_without_replacement(probs, count, generator)
    tokens = [token for token, _ in picks]
    return tokens, [float(probs[token]) for token in tokens], [row for _, row in picks]  # a list index costs more for 1-3 tokens


def sample_without_replacement(probs: torch.Tensor, count: int, generator: torch.Generator | None) -> list[tuple[int, torch.Tensor]]:
    """Draw up to ``count`` distinct tokens from ``probs`` ``[vocab]``; pair each with the law it was drawn from.

    Sibling i is drawn from ``probs`` with the earlier siblings' tokens zeroed and the rest
    renormalised (Jeon et al. 2024); the verifier needs exactly that row (the Draft contract).
    """
    remaining = probs.clone()
    picks = []
    for _ in range(count):
        mass = float(remaining.sum())
        if mass < MIN_SIBLING_MASS:  # a stopping rule on earlier siblings only: the law stays exact
            break
        row = remaining / mass
        token = int(torch.multinomial(row, 1, generator=generator))
        picks.append((token, row))
        remaining = remaining.clone()
        remaining[token] = 0.0
    return picks


@dataclass(frozen=True)
class Siblings:
    """Each parent's siblings drawn at once (``sampled_children_at_once``): tokens, draft probabilities and the mass left before each.

    Args:
        tokens: ``[parents][count]`` in draw order.
        probs: the processed draft probability of each.
        masses: the processed mass not yet drawn when each was drawn (1 for the first).
        rows: ``[parents, count, vocab]``: the law each was drawn from, given the earlier ones (the Draft contract's row).
    """

    tokens: list[list[int]]
    probs: list[list[float]]
    masses: list[list[float]]
    rows: torch.Tensor

    def take(self, parent: int, count: int) -> tuple[list[int], list[float], list[torch.Tensor]]:
        """Parent ``parent``'s first siblings, at most ``count``, stopping before one drawn from less than ``MIN_SIBLING_MASS``."""
        kept = 0
        while kept < count and self.masses[parent][kept] >= MIN_SIBLING_MASS:
            kept += 1
        return self.tokens[parent][:kept], self.probs[parent][:kept], list(self.rows[parent, :kept])


def sampled_children_at_once(logits: torch.Tensor, count: int, sampling: SamplingParams, generator: torch.Generator | None) -> Siblings:
    """``sampled_children`` for every row of ``logits`` ``[parents, vocab]`` at once, with one read by the host (a GPU's form).

    Each row's ``count`` siblings are its largest ``log(probs) + Gumbel noise`` keys: the
    Gumbel-top-k trick (Kool et al. 2019), whose ordered draws have exactly the law of drawing
    without replacement one by one, each from the rest renormalised. Which of them a tree
    keeps (``Siblings.take``) depends only on earlier draws, as in ``sample_without_replacement``.
    """
    probs = logits_to_probs(logits, sampling, check=False)  # [parents, vocab]
    count = min(count, probs.shape[-1])
    gumbel = -torch.empty_like(probs).exponential_(generator=generator).log()
    order = (probs.log() + gumbel).topk(count, dim=-1).indices  # [parents, count], in draw order
    chosen = probs.gather(1, order)
    masses = probs.sum(-1, keepdim=True) - (chosen.cumsum(-1) - chosen)  # the mass left when each was drawn
    earlier = torch.zeros(*order.shape, probs.shape[-1], device=probs.device).scatter_(2, order[..., None], 1.0).cumsum(1)
    earlier = earlier - torch.zeros_like(earlier).scatter_(2, order[..., None], 1.0)  # [parents, count, vocab]: drawn before
    rows = probs[:, None] * (1.0 - earlier) / masses[..., None].clamp(min=MIN_SIBLING_MASS)
    tokens, probs_list, masses_list = host_lists(order, chosen, masses)  # one read
    return Siblings(tokens, probs_list, masses_list, rows)
