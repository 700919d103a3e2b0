"""The rejection sampler: hand-built exact cases, determinism, and the output law.

The law tests draw a draft, verify it, and look at the first two emitted tokens
(completing the second from the target when the verifier emitted only one, as the next
decode step would). Their joint must be p_root(x) * p_next[x](y). Bound: chi-square at
alpha = 1e-3 (Wilson-Hilferty critical value). With N = 12000 samples a total variation
of 0.05 gives a statistic of at least 4 * N * TV^2 = 120 (Cauchy-Schwarz), far above
the critical value (< 60 for the <= 64 cells here), so the test detects TV 0.05.
Negative controls reproduce known sampler bugs and must fail the same check.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import draftsmith.verify.rejection as rejection
from draftsmith.proposers.core.sampling import SamplingParams, logits_to_probs
from draftsmith.proposers.core.types import Draft
from draftsmith.verify.rejection import (
    greedy_accept,
    rejection_sample,
    residual_distribution,
    speculative_sample,
    speculative_sample_on_device,
)

V = 8
N = 12000


def test_greedy_follows_matching_children_and_appends_argmax():
    # root children: 0 -> token 5, 1 -> token 3; node 1's child 2 -> token 4; node 2's child 3 -> token 6
    draft = Draft(torch.tensor([5, 3, 4, 6]), torch.tensor([-1, -1, 1, 2]))
    argmax = [3, 0, 4, 7, 1]  # root wants 3, node1 wants 4, node2 wants 7 (node 3 has 6: reject)
    result = greedy_accept(draft, argmax)
    assert result.accepted_nodes == [1, 2]
    assert result.accepted_tokens == [3, 4]
    assert result.next_token == 7 and result.recovered


def test_greedy_full_acceptance_gives_bonus():
    draft = Draft.chain([1, 2])
    result = greedy_accept(draft, [1, 2, 6])
    assert result.accepted_tokens == [1, 2] and result.next_token == 6 and not result.recovered


def test_point_mass_draft_accepted_with_target_probability():
    target_probs = torch.tensor([[0.25, 0.75, 0, 0, 0, 0, 0, 0], [1.0] + [0.0] * 7])
    draft = Draft.chain([1])
    g = torch.Generator().manual_seed(0)
    accepted = sum(speculative_sample(draft, target_probs, g).num_accepted for _ in range(4000))
    assert abs(accepted / 4000 - 0.75) < 0.03
    # after rejecting token 1, the residual is the point mass on token 0
    assert torch.equal(residual_distribution(target_probs[0], None, 1), torch.tensor([1.0] + [0.0] * 7))


def test_residual_is_normalised_positive_part():
    target = torch.tensor([0.5, 0.3, 0.2])
    draft = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual_distribution(target, draft, 1), torch.tensor([1.0, 0.0, 0.0]))


def test_seeded_determinism():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    draft_probs = torch.softmax(torch.randn(3, V), -1)
    draft = Draft.chain([1, 2, 3], draft_probs)
    s = SamplingParams(temperature=1.0)
    runs = [[rejection_sample(draft, logits, s, torch.Generator().manual_seed(7)) for _ in range(20)] for _ in range(2)]
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------------------
# The output law


class Case:
    """A fixed target (root logits + next-token logits per first token) and a nearby draft."""

    def __init__(self, seed: int, sampling: SamplingParams):
        g = torch.Generator().manual_seed(seed)
        self.root_logits = 1.5 * torch.randn(V, generator=g)
        self.next_logits = 1.5 * torch.randn(V, V, generator=g)  # row x: logits after first token x
        self.draft_root_logits = self.root_logits + torch.randn(V, generator=g)
        self.draft_next_logits = self.next_logits + torch.randn(V, V, generator=g)
        # processed once: target and draft get the same temperature / top-k / top-p
        self.root_probs = logits_to_probs(self.root_logits, sampling)
        self.next_probs = logits_to_probs(self.next_logits, sampling)
        self.q_root = logits_to_probs(self.draft_root_logits, sampling)
        self.q_next = logits_to_probs(self.draft_next_logits, sampling)


def build_draft(case: Case, shape: str, g: torch.Generator) -> Draft:
    """A draft of the given shape, tokens drawn from the (processed) draft distributions."""
    q_root = case.q_root
    if shape == "chain":  # x1 ~ q_root, x2 ~ q_next[x1]
        x1 = int(torch.multinomial(q_root, 1, generator=g))
        q2 = case.q_next[x1]
        x2 = int(torch.multinomial(q2, 1, generator=g))
        return Draft.chain([x1, x2], torch.stack([q_root, q2]))
    if shape == "deterministic_tree":  # top-3 root children, top-2 under the first
        top = torch.topk(case.draft_root_logits, 3).indices.tolist()
        under = torch.topk(case.draft_next_logits[top[0]], 2).indices.tolist()
        return Draft(torch.tensor(top + under), torch.tensor([-1, -1, -1, 0, 0]))
    # sampled trees: 3 root children (i.i.d. or without replacement), 2 i.i.d. children under the first
    tokens, rows, remaining = [], [], q_root.clone()
    for _ in range(3):
        q = remaining / remaining.sum() if shape == "sampled_tree_without_replacement" else q_root
        if q.sum() <= 0 or not torch.isfinite(q).all():
            break
        x = int(torch.multinomial(q, 1, generator=g))
        tokens.append(x)
        rows.append(q)
        remaining = remaining.clone()
        remaining[x] = 0.0
    q_child = case.q_next[tokens[0]]
    for _ in range(2):
        tokens.append(int(torch.multinomial(q_child, 1, generator=g)))
        rows.append(q_child)
    parents = [-1] * (len(tokens) - 2) + [0, 0]
    return Draft(torch.tensor(tokens), torch.tensor(parents), torch.stack(rows))


SAMPLERS = {"host": speculative_sample, "device": speculative_sample_on_device}  # read node by node, or once per step (a GPU's)


def sample_pairs(case: Case, shape: str, n: int = N, seed: int = 0, sampler: str = "host") -> Counter:
    """Counts of the first two emitted tokens over n verifications."""
    g = torch.Generator().manual_seed(seed)
    root_probs, next_probs = case.root_probs, case.next_probs
    counts: Counter = Counter()
    for _ in range(n):
        draft = build_draft(case, shape, g)
        tokens = draft.token_ids.tolist()
        # the target row of a depth-1 node with token x is next_probs[x]; deeper rows are never reached twice here
        rows = [root_probs] + [next_probs[tokens[i]] if p < 0 else next_probs[0] for i, p in enumerate(draft.parents.tolist())]
        result = SAMPLERS[sampler](draft, torch.stack(rows), g)
        emitted = result.committed
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(next_probs[emitted[0]], 1, generator=g)))
        counts[(emitted[0], emitted[1])] += 1
    return counts


def expected_pairs(case: Case) -> dict:
    root, nxt = case.root_probs, case.next_probs
    return {(x, y): float(root[x] * nxt[x, y]) for x in range(V) for y in range(V) if root[x] * nxt[x, y] > 0}


SAMPLINGS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7": SamplingParams(temperature=0.7),
    "t1_topk5_topp0.9": SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
    "t0.7_topk6_topp0.8": SamplingParams(temperature=0.7, top_k=6, top_p=0.8),
}
SHAPES = ["chain", "deterministic_tree", "sampled_tree_iid", "sampled_tree_without_replacement"]
# The default run covers every shape once, each with another sampling; --slow runs the whole grid.
FAST = {
    ("chain", "t0.7_topk6_topp0.8"),
    ("deterministic_tree", "t1"),
    ("sampled_tree_iid", "t0.7"),
    ("sampled_tree_without_replacement", "t1_topk5_topp0.9"),
}


# The host form runs the fast pairs by default and the whole grid with --slow. The device form
# (a GPU's, the same arithmetic on every node at once) runs the fast pairs only, each shape once:
# its chain and its sampled tree by default, the rest with --slow (on a GPU, gpu_check runs it).
def grid(pairs, fast, device_fast=("chain", "sampled_tree_without_replacement")):
    """Each pair with the host sampler (slow unless fast); each fast pair with the device one (slow unless in ``device_fast``)."""
    host = [pytest.param("host", *pair, marks=() if pair in fast else pytest.mark.slow) for pair in pairs]
    device = [pytest.param("device", *pair, marks=() if pair[0] in device_fast else pytest.mark.slow) for pair in pairs if pair in fast]
    return host + device


@pytest.mark.parametrize("sampler, shape, sampling_name", grid([(shape, name) for shape in SHAPES for name in SAMPLINGS], FAST))
def test_output_law_matches_target(shape, sampling_name, sampler, law_check):
    sampling = SAMPLINGS[sampling_name]
    case = Case(seed=11, sampling=sampling)
    stat, critical, tv = law_check(sample_pairs(case, shape, sampler=sampler), expected_pairs(case), N)
    assert stat < critical, f"{sampler} {shape}/{sampling_name}: chi2 {stat:.1f} >= {critical:.1f} (TV {tv:.3f})"


def broken_target_minus_target(target_probs, draft_probs, token):
    """The seed article's bug: residual = target - target, which is zero, so it resamples from the target."""
    residual = (target_probs - target_probs).clamp(min=0)
    return residual / residual.sum() if residual.sum() > 0 else target_probs


def broken_resample_from_target(target_probs, draft_probs, token):
    return target_probs


def broken_scalar_draft_prob(target_probs, draft_probs, token):
    """Keeps only q(x) of the sampled token, as if the full draft distribution were not stored (row by row, as the device form asks)."""
    index = torch.as_tensor(token).reshape(*target_probs.shape[:-1], 1)
    kept = target_probs.gather(-1, index) - (draft_probs.gather(-1, index) if draft_probs is not None else target_probs.gather(-1, index))
    residual = target_probs.scatter(-1, index, kept.clamp(min=0.0))
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total, target_probs)


BROKEN = [broken_target_minus_target, broken_resample_from_target, broken_scalar_draft_prob]
FAST_CONTROLS = {("sampled_tree_without_replacement", broken_target_minus_target), ("chain", broken_scalar_draft_prob)}


@pytest.mark.parametrize(
    "sampler, shape, broken",
    grid([(shape, broken) for shape in ("chain", "sampled_tree_without_replacement") for broken in BROKEN], FAST_CONTROLS, ("chain",)),
)
def test_negative_controls_fail_the_law_test(broken, shape, sampler, monkeypatch, law_check):
    monkeypatch.setattr(rejection, "residual_distribution", broken)
    sampling = SAMPLINGS["t1"]
    case = Case(seed=11, sampling=sampling)
    stat, critical, tv = law_check(sample_pairs(case, shape, sampler=sampler), expected_pairs(case), N)
    assert stat >= critical, f"broken {sampler} sampler {broken.__name__} passed the law test (chi2 {stat:.1f}, TV {tv:.3f})"
