"""End to end: the decoder's sampled output follows the target's exact joint law.

A tiny model with a vocabulary of 8 generates 4 tokens per request with a proposer that
samples a two-level tree (siblings without replacement) from its own random "draft
model". After the first token (from the prefill) every step verifies a draft, so tokens
2 to 4 all come through the rejection sampler. The joint law of tokens (2, 3) is
sum_t1 p(t1) p(t2 | t1) p(t3 | t1, t2), computed exactly from target forwards. Bound:
chi-square at alpha = 1e-3 over N = 6000 requests; a broken residual must fail it (the
control fails by a wide margin, so it runs on fewer requests). The same check runs with
the n-gram proposer, whose deterministic trees (point masses) draft from the context.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import draftsmith.verify.rejection as rejection
from draftsmith.proposers.core.proposer import ProposerBase
from draftsmith.proposers.core.sampling import SamplingParams, logits_to_probs
from draftsmith.proposers.core.types import Draft, ProposeContext
from draftsmith.proposers.ngram import NgramProposer
from draftsmith.verify import SpeculativeDecoder

V = 8
N = 6000
SAMPLING = dict(temperature=0.8, top_k=6, top_p=1.0)
PROMPT = torch.tensor([[1, 5, 3, 6]])


class RandomTreeProposer(ProposerBase):
    """Samples a 2-wide, 2-deep tree from a fixed random bigram table, reporting draft_probs."""

    hidden_layers = ()

    def __init__(self, seed: int = 0):
        self.bigram_logits = 2.0 * torch.randn(V, V, generator=torch.Generator().manual_seed(seed))
        self.verified_steps = 0

    def begin(self, prompt, features):
        pass

    def observe(self, result, features):
        self.verified_steps += 1

    def propose(self, context: ProposeContext) -> Draft:
        g, sampling = context.generator, context.sampling
        q = logits_to_probs(self.bigram_logits[context.tokens[-1]], sampling)
        first = int(torch.multinomial(q, 1, generator=g))
        rest = q.clone()
        rest[first] = 0.0
        rows, tokens, parents = [q], [first], [-1]
        if rest.sum() > 0:  # second sibling, drawn without replacement
            rest = rest / rest.sum()
            rows.append(rest)
            tokens.append(int(torch.multinomial(rest, 1, generator=g)))
            parents.append(-1)
        if context.max_depth >= 2:
            q_child = logits_to_probs(self.bigram_logits[first], sampling)
            rows.append(q_child)
            tokens.append(int(torch.multinomial(q_child, 1, generator=g)))
            parents.append(0)
        return Draft(torch.tensor(tokens), torch.tensor(parents), torch.stack(rows))


def exact_pair_law(model) -> dict:
    """P(t2, t3) = sum_t1 p(t1) p(t2 | t1) p(t3 | t1, t2) under the processed target."""
    sampling = SamplingParams(**SAMPLING)
    with torch.no_grad():
        p1 = logits_to_probs(model(PROMPT).logits[0, -1], sampling)
        seqs1 = torch.cat([PROMPT.repeat(V, 1), torch.arange(V)[:, None]], 1)
        p2 = logits_to_probs(model(seqs1).logits[:, -1], sampling)  # [t1, t2]
        seqs2 = torch.cat([seqs1.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
        p3 = logits_to_probs(model(seqs2).logits[:, -1], sampling).view(V, V, V)  # [t1, t2, t3]
    joint = torch.einsum("a,ab,abc->bc", p1, p2, p3)
    return {(b, c): float(joint[b, c]) for b in range(V) for c in range(V) if joint[b, c] > 0}


def sample_pairs(model, n: int = N, proposer=None) -> tuple[Counter, int, int, int]:
    """Joint counts of tokens (2, 3) over ``n`` seeded requests; also requests that drafted, draft tokens drafted and accepted."""
    decoder = SpeculativeDecoder(model, proposer if proposer is not None else RandomTreeProposer(), adaptive=False)
    counts: Counter = Counter()
    requests = drafted = accepted = 0
    for seed in range(n):
        result = decoder.generate(PROMPT, max_new_tokens=4, seed=seed, **SAMPLING)
        counts[(result.new_tokens[1], result.new_tokens[2])] += 1
        requests += result.stats.drafted_tokens > 0
        drafted += result.stats.drafted_tokens
        accepted += sum(result.stats.accept_lengths)
    return counts, requests, drafted, accepted


@pytest.fixture(scope="module")
def exact(small_vocab_model):
    return exact_pair_law(small_vocab_model)


@pytest.mark.slow
def test_decoder_output_follows_target_joint(small_vocab_model, exact, law_check):
    proposer = RandomTreeProposer()
    counts, *_ = sample_pairs(small_vocab_model, proposer=proposer)
    assert proposer.verified_steps >= N  # every request verified at least one draft
    stat, critical, tv = law_check(counts, exact, N)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f} (TV {tv:.3f})"


def test_ngram_tree_output_follows_target_joint(small_vocab_model, exact, law_check):
    """Deterministic lookup trees, verified as point masses, at T = 0.8 with top-k."""
    proposer = NgramProposer(min_n=1, max_n=2, k=3, branches=3)
    counts, requests, drafted, accepted = sample_pairs(small_vocab_model, proposer=proposer)
    assert requests >= N // 2 and N // 4 <= accepted <= drafted - N // 4  # most requests drafted; drafts accepted and rejected
    stat, critical, tv = law_check(counts, exact, N)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f} (TV {tv:.3f})"


@pytest.mark.parametrize("proposer", ["random_tree", "ngram_tree"])
def test_broken_residual_fails_the_same_check(proposer, small_vocab_model, exact, law_check, monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda target_probs, draft_probs, token: target_probs)
    drafts = RandomTreeProposer() if proposer == "random_tree" else NgramProposer(min_n=1, max_n=2, k=3, branches=3)
    counts, *_ = sample_pairs(small_vocab_model, n=N // 4, proposer=drafts)
    stat, critical, tv = law_check(counts, exact, N // 4)
    assert stat >= critical, f"a sampler that resamples from the target passed (chi2 {stat:.1f}, TV {tv:.3f})"
