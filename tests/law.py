"""The sampled-output law check shared by the proposers' tests.

A V = 8 target decodes 3 tokens after LAW_PROMPT, one request per seed; the joint of the
3 tokens is compared with the exact joint from the target's own processed next-token
probabilities (chi-square at alpha = 1e-3, ``conftest.chi_square_test``), and so is the
marginal of the first 2 tokens.

The same check runs with the speculation controller deciding (``deciding_controller``): on
a deterministic clock (``Clocked``), so that its decisions (plain or drafted, chain or
tree, which nodes) vary from request to request with what it has learnt, not with this
machine's timing noise; ``simulate`` drives one over synthetic chains on that clock.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import torch

from draftsmith.proposers.core.sampling import SamplingParams, logits_to_probs
from draftsmith.proposers.core.types import Draft, VerifyResult
from draftsmith.verify import SpeculativeDecoder
from draftsmith.verify.controller import Controller, Plan

V = 8
LAW_PROMPT = torch.tensor([[1, 2, 7]])


def linear_costs(drafting_per_depth: float = 0.1, per_row: float = 0.05, drafted: float = 0.1):
    """Seconds of a plan and its draft: (drafting, the rest of the step).

    A plain step costs 1, a drafted one ``drafted`` more plus ``per_row`` per node.
    """

    def costs(plan: Plan, draft: Draft) -> tuple[float, float]:
        return drafting_per_depth * plan.depth, 1.0 + (drafted + per_row * draft.num_nodes if draft.num_nodes else 0.0)

    return costs


def simulate(controller: Controller, steps: int, accept, score: float = 0.5, seed: int = 0, costs=None):
    """Drive ``controller`` over synthetic steps: a chain of the planned depth, each node accepted with ``accept(step, depth)``.

    Yields each step's plan. ``costs`` (default ``linear_costs()``) gives its seconds.
    """
    rng, costs = random.Random(seed), costs or linear_costs()
    for step in range(steps):
        plan = controller.plan(context=100, room=8)
        draft = Draft.chain(list(range(plan.depth)), scores=[score] * plan.depth) if plan.depth else Draft.empty()
        if plan.depth and plan.trims:
            draft, _ = controller.trim(draft, 100, True)
        n = 0
        while n < draft.num_nodes and rng.random() < accept(step, n + 1):
            n += 1
        result = VerifyResult(list(range(n)), list(range(n)), 0, n < draft.num_nodes)
        drafting, rest = costs(plan, draft)
        controller.observe(plan, draft, result, 100, drafting, drafting + rest, True)
        yield plan


PROMPT, TOKENS = 960, 63  # ``requests``: the demo's long domain, whose requests feed a drafter 960 positions before its first draft


def requests(controller: Controller, count: int, accept, catch_up=(0.5, 0.005), seed: int = 0, prompt=lambda request: PROMPT,
             costs=None, tokens: int = TOKENS, cold=(0, 0.0)):  # fmt: skip
    """Drive ``controller`` over ``count`` requests of ``tokens`` tokens after a prompt of ``prompt(request)`` tokens
    (``PROMPT``), on the clock ``costs`` (``linear_costs()``: a plain step costs 1): a drafted step first feeds its
    drafter the positions it has not seen, at ``catch_up[0] + catch_up[1]`` per position (960: 5.3 plain steps); a
    request's first ``cold[0]`` steps cost ``cold[1]`` more (its prefill's aftermath). Each node of a chain is accepted
    with ``accept(request)``. Yields (request, plan, seconds, tokens committed) per step."""
    rng, costs = random.Random(seed), costs or linear_costs()
    for request in range(count):
        controller.start()
        start = context = prompt(request)
        fed = step = 0
        while context < start + tokens:
            plan = controller.plan(context=context, room=start + tokens - context)
            draft = Draft.chain(list(range(plan.depth)), scores=[0.5] * plan.depth) if plan.depth else Draft.empty()
            if plan.depth and plan.trims:
                draft, _ = controller.trim(draft, context, True)
            n = 0
            while n < draft.num_nodes and rng.random() < accept(request):
                n += 1
            drafting, rest = costs(plan, draft)
            rest, step = rest + (cold[1] if step < cold[0] else 0.0), step + 1
            if plan.depth and context - fed > 1:
                drafting += catch_up[0] + catch_up[1] * (context - fed)
            result = VerifyResult(list(range(n)), list(range(n)), 0, n < draft.num_nodes)
            controller.observe(plan, draft, result, context, drafting, drafting + rest, True)
            context += n + 1
            fed = context if plan.depth else fed
            yield request, plan, drafting + rest, n + 1


def least_squares(points: list[tuple[float, float]], forget: float) -> tuple[float, float]:
    """``y ~ a + b x`` by least squares, each older point weighing ``forget`` times less: (a, b).

    The cost line the controller used before its robust catch-up line and its rows curve: their tests' negative control.
    """
    weights = [forget ** (len(points) - 1 - i) for i in range(len(points))]
    total = sum(weights)
    mean_x = sum(w * x for w, (x, _) in zip(weights, points, strict=True)) / total
    mean_y = sum(w * y for w, (_, y) in zip(weights, points, strict=True)) / total
    spread = sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points, strict=True))
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, (x, y) in zip(weights, points, strict=True)) / spread
    return mean_y - slope * mean_x, slope


class Clocked(Controller):
    """The controller with a deterministic clock: ``costs(plan, draft)`` replaces the measured seconds."""

    def __init__(self, max_depth, costs, **kwargs):
        super().__init__(max_depth, **kwargs)
        self.costs = costs

    def observe(self, plan, draft, result, context, draft_seconds, step_seconds, greedy):
        drafting, rest = self.costs(plan, draft)
        self._refreshed = 0.0  # the clock's seconds hold no recomputation of the estimates (a plain step's price leaves it out)
        super().observe(plan, draft, result, context, drafting, drafting + rest, greedy)


def deciding_controller(proposer, per_row: float = 0.05) -> Clocked:
    """A controller for ``proposer`` on a clock where a verified row costs ``per_row`` plain steps: dear enough that it
    goes plain, cuts trees to chains and trims where its estimates say so, and cheap enough that it drafts."""
    return Clocked(
        proposer.draft_depth(), linear_costs(drafting_per_depth=0.0, per_row=per_row, drafted=0.0), max_width=proposer.draft_width()
    )


def control_decisions(decisions: str, proposer, n: int) -> tuple[Clocked | None, int]:
    """A negative control's controller and request count: ``"fixed"`` (None, n), or ``"controller"``
    (``deciding_controller``, 2n). A plain step is exact whatever the sampler's bug, and the
    controller plans about a third of the steps plain, so its control takes twice the requests."""
    if decisions == "fixed":
        return None, n
    if decisions == "controller":
        return deciding_controller(proposer), 2 * n
    raise ValueError(f"decisions must be 'fixed' or 'controller', got {decisions!r}")


def assert_follows_law_deciding(target, proposer, sampling: SamplingParams, n: int, law_check, label: str = "") -> None:
    """``assert_follows_law`` with ``deciding_controller``, which must both have drafted (in at least a fifth of the
    ``n`` requests' steps) and planned plain steps: decisions that vary, not a fixed config under another name."""
    controller = deciding_controller(proposer)
    assert_follows_law(target, proposer, sampling, n, law_check, f"{label}controller deciding, ", controller)
    drafted, plain = sum(controller.planned[1:]), controller.planned[0]
    assert drafted > 0.2 * n and plain > 0, f"the controller drafted {drafted} and planned {plain} plain steps over {n} requests"


def exact_law(target, sampling: SamplingParams) -> dict:
    """The target's joint law of the first 3 tokens after LAW_PROMPT, from its own next-token probabilities."""
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))  # [V * V, 2]
    sequences = torch.cat([LAW_PROMPT.expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = target(sequences.to(target.device)).logits[:, -3:]  # after the prompt, after x, after (x, y)
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


def assert_law_case(target, proposer, sampling: SamplingParams, decisions: str, n: int, law_check, label: str = "") -> None:
    """One law test case: with the proposer's fixed config (``"fixed"``: its first drafts must be both accepted and
    rejected, or the test proves nothing) or with ``deciding_controller`` (``"controller"``)."""
    if decisions == "controller":
        assert_follows_law_deciding(target, proposer, sampling, n, law_check, label)
        return
    accepted = assert_follows_law(target, proposer, sampling, n, law_check, label)
    assert 0.05 < sum(a > 0 for a in accepted) / len(accepted) < 0.95  # first drafts accepted and rejected


def assert_control_rejects(target, proposer, decisions: str, n: int, law_check) -> None:
    """The negative control of a law test at T = 1 (the caller has broken the sampler), fixed or with the controller deciding."""
    controller, requests = control_decisions(decisions, proposer, n)
    assert_law_rejects(target, proposer, SamplingParams(1.0), requests, law_check, controller)
