"""The sampled-output law check shared by the proposers' tests.

A V = 8 target decodes 3 tokens after LAW_PROMPT, one request per seed; the joint of the
3 tokens is compared with the exact joint from the target's own processed next-token
probabilities (chi-square at alpha = 1e-3, ``conftest.chi_square_test``), and so is the
marginal of the first 2 tokens.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from draftsmith.proposers.core.sampling import SamplingParams, logits_to_probs
from draftsmith.verify import SpeculativeDecoder

V = 8
LAW_PROMPT = torch.tensor([[1, 2, 7]])


def exact_law(target, sampling: SamplingParams) -> dict:
    """The target's joint law of the first 3 tokens after LAW_PROMPT, from its own next-token probabilities."""
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))  # [V * V, 2]
    sequences = torch.cat([LAW_PROMPT.expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = target(sequences).logits[:, -3:]  # after the prompt, after x, after (x, y)
    probs = logits_to_probs(logits, sampling).double()
    law = {}
    for row, (x, y) in enumerate(pairs.tolist()):
        for z in range(V):
            law[(x, y, z)] = float(probs[row, 0, x] * probs[row, 1, y] * probs[row, 2, z])
    return {outcome: p for outcome, p in law.items() if p > 0}


def sample_law(target, proposer, sampling: SamplingParams, n: int, controller=None) -> tuple[Counter, list[int]]:
    """Counts of the 3 decoded tokens over n seeded requests, and the tokens accepted in each first step.

    Args:
        controller: a speculation controller to decode with (None: the proposer's fixed config).
    """
    decoder = SpeculativeDecoder(target, proposer, adaptive=False, controller=controller)
    counts: Counter = Counter()
    accepted: list[int] = []
    for seed in range(n):
        result = decoder.generate(
            LAW_PROMPT, max_new_tokens=3, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=seed
        )
        counts[tuple(result.new_tokens)] += 1
        accepted.append(result.stats.accept_lengths[0])  # the first step drafts (depth 1) unless a controller plans it plain
    return counts, accepted


def law_statistics(counts: Counter, law: dict, n: int, law_check) -> dict[str, tuple[float, float, float]]:
    """(chi2, critical, TV) for the joint of the 3 tokens and for the marginal of the first 2.

    The pair marginal has 8x fewer cells, so it is the sharper test of depth-1 drafts.
    """
    pair_counts, pair_law = Counter(), Counter()
    for outcome, count in counts.items():
        pair_counts[outcome[:2]] += count
    for outcome, p in law.items():
        pair_law[outcome[:2]] += p
    return {"tokens 1-3": law_check(counts, law, n), "tokens 1-2": law_check(pair_counts, dict(pair_law), n)}


def assert_follows_law(target, proposer, sampling: SamplingParams, n: int, law_check, label: str = "", controller=None) -> list[int]:
    """Sample ``n`` requests and assert both statistics are under their critical values; return each first step's accepted tokens."""
    counts, accepted = sample_law(target, proposer, sampling, n, controller)
    for name, (stat, critical, tv) in law_statistics(counts, exact_law(target, sampling), n, law_check).items():
        assert stat < critical, f"{label}{name}: chi2 {stat:.1f} >= {critical:.1f} (TV {tv:.3f})"
    return accepted


def assert_law_rejects(target, proposer, sampling: SamplingParams, n: int, law_check, controller=None) -> None:
    """The negative control (the caller has broken the sampler): at least one statistic reaches its critical value."""
    counts, _ = sample_law(target, proposer, sampling, n, controller)
    results = law_statistics(counts, exact_law(target, sampling), n, law_check)
    assert any(stat >= critical for stat, critical, _ in results.values()), results
