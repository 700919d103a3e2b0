"""The speculation controller: it switches off what does not pay, re-plans when costs move, comes back, and stays exact.

Its decisions are driven here by a deterministic clock where a test needs them to be
(``Clocked``: a step's seconds from a cost function of its plan and draft), so that the
assertions do not ride on this machine's timing noise; one test keeps the real clock.
Bounds are stated in each test. The law tests run with decisions that vary from step to
step, and their negative control trims a sampled draft by its own values, which the
controller refuses to do (drops a sampled node for its own drawn value), and must fail.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from law import Clocked, V, assert_follows_law, assert_law_rejects, least_squares, linear_costs, simulate

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.proposer import ProposerBase
from draftsmith.proposers.core.sampling import SamplingParams, logits_to_probs
from draftsmith.proposers.core.tree import keep_nodes
from draftsmith.proposers.core.types import Draft, ProposeContext, VerifyResult
from draftsmith.proposers.draft_model import DraftModelProposer
from draftsmith.verify import SpeculativeDecoder, load_target
from draftsmith.verify import controller as controller_module
from draftsmith.verify import probes as probes_module
from draftsmith.verify.controller import Controller, Plan
from draftsmith.verify.estimates import RobustLine
from draftsmith.verify.evaluation.demo import DEMO_TARGET, SHIPPED, trained_drafts


def plain_run(plans: list[int], start: int, length: int = 3) -> int | None:
    """Where the first ``length`` plain steps in a row begin at or after ``start`` (None: nowhere)."""
    return next((i for i in range(start, len(plans) - length + 1) if not any(plans[i : i + length])), None)


def test_a_useless_proposer_is_switched_to_plain_within_10_steps():
    """Random drafts (never accepted): within 10 steps of its first draft the controller turns plain (3 plain steps in a
    row: the single plain steps that measure a plain step come whatever the proposer), and keeps >= 90% of the next 200
    plain. Negative control: with drafts that are all accepted there is no such run in 30 steps."""
    plans = [plan.depth for plan in simulate(Controller(6), 210, lambda step, depth: 0.0)]
    first_draft = next(i for i, depth in enumerate(plans) if depth)
    off = plain_run(plans, first_draft)
    assert off is not None and off - first_draft <= 10, plans[:12]
    assert sum(d == 0 for d in plans[10:]) >= 0.9 * 200, plans
    useful = [plan.depth for plan in simulate(Controller(6), 30, lambda step, depth: 1.0)]
    assert plain_run(useful, 1) is None, useful


def simulate_shapes(controller: Controller, steps: int, first: float, second: float, costs, seed: int = 0) -> list[Plan]:
    """Drive a chain-or-tree controller: the tree gives each first child a sibling (its ``width``: 2), the chain does not.

    At each depth the first child is accepted with chance ``first``; else a tree's second
    child with chance ``second``, which ends the path (it has no children).
    """
    rng, plans = random.Random(seed), []
    for _ in range(steps):
        plan = controller.plan(context=100, room=8)
        plans.append(plan)
        if plan.depth == 0:
            draft = Draft.empty()
            accepted = []
        else:
            tree = plan.width is None
            parents = [p for d in range(plan.depth) for p in ([2 * d - 2, 2 * d - 2] if tree else [d - 1])]
            parents = [max(p, -1) for p in parents]
            draft = Draft(torch.arange(len(parents)), torch.tensor(parents), scores=[0.5] * len(parents))
            accepted, node = [], -1
            for _d in range(plan.depth):
                children = [i for i, p in enumerate(parents) if p == node]
                if rng.random() < first:
                    node = children[0]
                elif tree and rng.random() < second:
                    accepted.append(children[1])
                    break
                else:
                    break
                accepted.append(node)
        result = VerifyResult(accepted, accepted, 0, True)
        drafting, rest = costs(plan, draft)
        controller.observe(plan, draft, result, 100, drafting, drafting + rest, True)
    return plans


def test_a_tree_drafter_is_run_as_a_chain_where_its_siblings_do_not_pay_and_as_a_tree_where_they_do():
    """Siblings that add little (0.1) and rows and levels that cost: >= 80% of drafted steps after 100 are chains.
    Siblings that add much (0.8) at no cost: >= 80% are trees."""

    def costs(row: float, level: float):
        return lambda plan, draft: (level * plan.depth * (2 if plan.width is None else 1), 1.0 + row * draft.num_nodes)

    for second, cost, wanted in ((0.1, costs(0.08, 0.08), 1), (0.8, costs(0.0, 0.0), None)):
        plans = simulate_shapes(Controller(4, max_width=2), 400, 0.6, second, cost)[100:]
        drafted = [p for p in plans if p.depth]
        assert len(drafted) > 0.5 * len(plans)
        assert sum(p.width == wanted for p in drafted) >= 0.8 * len(drafted), (second, [p.width for p in drafted])


def test_a_good_proposer_drafts_deep_and_a_costly_one_is_re_planned():
    """Acceptance 0.9 per depth drafts >= 4 deep on average; when drafting turns 75x costlier at step 150 (a level then
    costs more than it brings) it goes plain within 30 steps."""
    controller = Controller(6)
    cheap, costly = linear_costs(0.02), linear_costs(1.5)
    plans: list[int] = []
    steps = simulate(controller, 300, lambda step, depth: 0.9, score=0.9, costs=lambda p, d: (cheap if len(plans) < 150 else costly)(p, d))
    plans.extend(plan.depth for plan in steps)
    before, after = plans[50:150], plans[180:300]
    assert sum(before) / len(before) >= 4.0, before
    assert sum(after) / len(after) <= 1.0 and sum(d == 0 for d in after) >= 0.5 * len(after), after


def refreshes_while_drafting(monkeypatch, after_every_probe: bool) -> tuple[int, int, int]:
    """(estimates computed, drafted steps, exploring steps) over steps 100-300 of steady drafting (0.9 per depth)."""
    computed, original, observe = [], controller_module.ShapeEstimates.estimate, Controller.observe
    monkeypatch.setattr(controller_module.ShapeEstimates, "estimate", lambda *a: computed.append(1) or original(*a))

    def observed(self, plan, *rest):  # the rule before: every probe, an exploring one included, refreshed at once
        observe(self, plan, *rest)
        self._estimates = None if after_every_probe and plan.probe else self._estimates

    monkeypatch.setattr(Controller, "observe", observed)
    controller = Controller(6, explore_every=13)  # exploring steps that mostly fall between the refreshes every 8
    steps = simulate(controller, 300, lambda step, depth: 0.9, score=0.9, costs=linear_costs(0.02))
    plans = [plan for step, plan in enumerate(steps) if step != 99 or computed.clear()][100:]  # counted from step 100 on
    return len(computed), sum(plan.depth > 0 for plan in plans), sum(plan.whole for plan in plans)


def test_the_estimates_are_recomputed_every_8_drafted_steps_not_after_each_exploring_step(monkeypatch):
    """Steady drafting: the estimates are recomputed once per 8 drafted steps; an exploring step (every 13th here, the
    whole draft one depth deeper) waits its turn. Negative control: recomputing after each exploring step too, as before
    (one in 8 of them falls on a refresh anyway)."""
    computed, drafted, explored = refreshes_while_drafting(monkeypatch, after_every_probe=False)
    assert explored >= 10 and len({computed, drafted // 8, drafted // 8 + 1}) == 2, (computed, drafted, explored)
    before = refreshes_while_drafting(monkeypatch, after_every_probe=True)[0]
    assert before >= drafted // 8 + explored - 3, (before, drafted, explored)


def test_a_proposer_that_turns_predictable_again_is_switched_back_on():
    """Random text for 150 steps (nothing accepted), then a repeated passage (0.95): drafting resumes within 160 steps and then holds."""
    plans = [plan.depth for plan in simulate(Controller(6), 500, lambda step, depth: 0.0 if step < 150 else 0.95, score=0.9)]
    assert sum(d == 0 for d in plans[100:150]) >= 45  # off while nothing is accepted
    resumed = next(i for i in range(150, 500) if all(d > 0 for d in plans[i : i + 5]))
    assert resumed <= 150 + 160, plans[150:]
    assert sum(d > 0 for d in plans[resumed + 20 :]) >= 0.9 * len(plans[resumed + 20 :])


def resumed_after_a_paused_probe(monkeypatch, cap: float) -> int:
    """Random text for 200 steps with the machine pausing 50 plain steps inside the first probe after step 60, then a
    repeated passage (0.95): the step where drafting resumes (5 drafted steps in a row), with ``PROBE_LOSS_CAP`` = ``cap``."""
    monkeypatch.setattr(probes_module, "PROBE_LOSS_CAP", cap)
    plans: list[Plan] = []
    paused = []

    def costs(plan, draft):
        drafting, rest = linear_costs()(plan, draft)
        if plan.probe and len(plans) > 60 and not paused:
            paused.append(len(plans))
            rest += 50.0  # a pause of the machine, not the proposer's cost
        return drafting, rest

    for plan in simulate(Controller(6), 1500, lambda step, depth: 0.0 if step < 200 else 0.95, score=0.9, costs=costs):
        plans.append(plan)
    assert paused, "no probe after step 60"
    depths = [plan.depth for plan in plans]
    return next((i for i in range(200, 1500) if all(d > 0 for d in depths[i : i + 5])), 1500)


def test_a_pause_inside_a_probe_does_not_hold_the_next_probes_back(monkeypatch):
    """As the predictable-again test, with a 50-step pause inside one probe: drafting resumes within 350 steps of the
    passage (the pause counts as a probe losing 2 plain steps beyond the 1% credit, which wins them back in about 200 plain steps,
    some of them before the passage). Negative control: without the cap on what one probe loses, the pause holds probing
    back past step 1000."""
    assert resumed_after_a_paused_probe(monkeypatch, probes_module.PROBE_LOSS_CAP) <= 200 + 350
    assert resumed_after_a_paused_probe(monkeypatch, float("inf")) >= 1000


def test_pauses_inside_every_probe_still_leave_probing_bounded(monkeypatch):
    """Random text throughout, and the machine pauses 50 plain steps inside every probe step (a loaded machine): each
    probe counts as losing 2 plain steps at most and the next is priced at the median of the last five, so probes stay
    at most 450 steps apart over 2000 steps. Negative control: without the cap each pause holds probing back until the
    ceiling (``PROBE_CEILING``, 1000 plain steps)."""

    def probe_gaps(cap: float) -> list[int]:
        monkeypatch.setattr(probes_module, "PROBE_LOSS_CAP", cap)
        plans: list[Plan] = []

        def costs(plan, draft):
            drafting, rest = linear_costs()(plan, draft)
            return drafting, rest + (50.0 if plan.probe and not plan.whole else 0.0)

        for plan in simulate(Controller(6), 2000, lambda step, depth: 0.0, costs=costs):
            plans.append(plan)
        starts = [i for i, plan in enumerate(plans) if plan.probe and not (i and plans[i - 1].probe)]
        return [b - a for a, b in zip([0, *starts], [*starts, len(plans)], strict=True)]

    gaps = probe_gaps(probes_module.PROBE_LOSS_CAP)
    assert len(gaps) >= 5 and max(gaps) <= 450, gaps
    assert max(probe_gaps(float("inf"))) >= 900


def test_trimming_keeps_the_likely_nodes_closed_under_ancestors():
    """A tree trimmed where rows cost: kept nodes are the most likely ones, and every kept node's parent is kept."""
    controller = Clocked(4, linear_costs(drafting_per_depth=0.02, per_row=0.3))
    list(simulate(controller, 40, lambda step, depth: 0.5))
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 5])
    draft = Draft(torch.arange(7), parents, scores=[0.9, 0.05, 0.8, 0.1, 0.02, 0.7, 0.6])
    trimmed, kept = controller.trim(draft, 100, exact_any_subset=True)
    assert kept and 0 < len(kept) < 7 and 0 in kept and 1 not in kept, kept
    assert all(parents[i] < 0 or int(parents[i]) in kept for i in kept)
    assert controller.trim(draft, 100, exact_any_subset=False) == (draft, None)  # a sampled draft is never cut by its values


class FiveDeepChain(ProposerBase):
    """A test proposer drafting chains of up to 5 tokens from nothing but the committed tokens."""

    def draft_depth(self):
        return 5

    def begin(self, prompt, features):
        pass

    def observe(self, result, features):
        pass


class RandomChain(FiveDeepChain):
    """Drafts 5 random tokens every step (the target accepts almost none); ``delay`` seconds of drafting when set."""

    def __init__(self, vocab_size: int):
        self.rng, self.vocab_size, self.delay = random.Random(0), vocab_size, 0.0

    def propose(self, context: ProposeContext) -> Draft:
        if self.delay:
            time.sleep(self.delay)
        depth = min(5, context.max_depth)
        return Draft.chain([self.rng.randrange(self.vocab_size) for _ in range(depth)], scores=[0.5] * depth)


def test_on_the_real_clock_random_drafts_go_plain_and_an_injected_delay_is_re_planned():
    """The shipped demo target (a plain step takes 1.5-5 ms, ~10 under heavy load): random drafts that cost 3 ms each are
    planned plain after at most 12 steps; a proposer whose 5-token drafts are always accepted drafts most steps, and when
    its drafting turns 100 ms dearer (dearer than the 6 plain steps it saves, even under load) it is planned plain after
    at most 12; outputs identical. (Random drafts that cost nothing cost a verified row or two, within the noise here:
    the simulated tests above hold the switch to its bound.)"""
    target, tokenizer = load_target(DEMO_TARGET)
    proposer = RandomChain(target.config.vocab_size)
    proposer.delay = 0.003
    decoder, plain = SpeculativeDecoder(target, proposer), SpeculativeDecoder(target)
    prompt = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    result = decoder.generate(prompt, max_new_tokens=60)
    assert result.new_tokens == plain.generate(prompt, max_new_tokens=60).new_tokens
    planned = result.controller["planned_by_depth"]
    assert planned[0] >= result.stats.steps - 12, result.controller
    expected = plain.generate(prompt, max_new_tokens=120).new_tokens
    oracle = Oracle(prompt[0].tolist() + expected, target.config.vocab_size)
    fast = SpeculativeDecoder(target, oracle)
    paying = fast.generate(prompt, max_new_tokens=120)
    assert paying.new_tokens == expected
    assert paying.stats.planned_plain_steps < paying.stats.steps / 2, paying.controller  # it drafts while that pays
    delayed = SpeculativeDecoder(target, Delayed(oracle, 0.1), controller=fast.controller)
    result = delayed.generate(prompt, max_new_tokens=120)
    assert result.new_tokens == expected
    assert result.stats.steps > 24 and result.stats.planned_plain_steps >= result.stats.steps - 12, result.controller


class Oracle(FiveDeepChain):
    """Drafts the next 5 tokens of a known greedy continuation: every draft is accepted whole, whatever the machine's load."""

    def __init__(self, sequence: list[int], vocab_size: int):
        self.sequence, self.vocab_size = sequence, vocab_size

    def propose(self, context: ProposeContext) -> Draft:
        start = len(context.tokens)
        tokens = self.sequence[start : start + min(5, context.max_depth)]
        return Draft.chain(tokens, scores=[0.9] * len(tokens)) if tokens else Draft.empty()


class Delayed(ProposerBase):
    """A proposer whose every draft costs ``delay`` seconds more."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay
        self.vocab_size = inner.vocab_size

    def draft_depth(self):
        return self.inner.draft_depth()

    def begin(self, prompt, features):
        self.inner.begin(prompt, features)

    def observe(self, result, features):
        self.inner.observe(result, features)

    def propose(self, context):
        time.sleep(self.delay)
        return self.inner.propose(context)


@pytest.mark.parametrize("name", ["ngram", "suffix", "demo_draft", "medusa", "eagle1", "eagle2", "eagle3", "mtp"])
def test_greedy_output_is_identical_with_the_controller_on_for_every_proposer(name):
    """The shipped demo target and heads, the controller on (real clock): identical to plain, and it really decided."""
    target, tokenizer = load_target(DEMO_TARGET)
    configs = {"ngram": {"type": "ngram"}, "suffix": {"type": "suffix"}, **trained_drafts(DEMO_TARGET)}
    if name not in configs:
        pytest.skip(f"{SHIPPED[name][0]} is not shipped")
    decoder = SpeculativeDecoder(target, load_proposer(configs[name], target=target, tokenizer=tokenizer))
    plain = SpeculativeDecoder(target)
    texts = ["def merge(a, b):\n    out = []\n    for x in a:\n", "The quick brown fox jumps over the lazy dog. The quick brown"]
    planned = [0] * 2
    for text in texts * 2:
        ids = tokenizer(text, return_tensors="pt").input_ids
        result = decoder.generate(ids, max_new_tokens=48)
        assert result.new_tokens == plain.generate(ids, max_new_tokens=48).new_tokens, (name, text)
        planned = result.controller["planned_by_depth"]
    assert sum(planned[1:]) > 0  # it drafted (at least while it learned)


class ScoredTree(ProposerBase):
    """Samples a 2-wide first level (without replacement) and one child of the first, scoring its own draws.

    It drafts from a fixed random bigram table, or (``twin``) from the target's own processed
    distribution, a draft so good that a choice by its drawn values would bias the output most.
    """

    def __init__(self, twin=None, seed: int = 0):
        self.twin = twin
        self.bigram_logits = 2.0 * torch.randn(V, V, generator=torch.Generator().manual_seed(seed))

    def draft_depth(self):
        return 2

    def draft_width(self):  # it ignores ``max_width``: the decoder's own cut to a chain is what the law tests see
        return 2

    def begin(self, prompt, features):
        pass

    def observe(self, result, features):
        pass

    def _law(self, tokens: list[int], sampling) -> torch.Tensor:
        if self.twin is None:
            return logits_to_probs(self.bigram_logits[tokens[-1]], sampling)
        with torch.no_grad():
            return logits_to_probs(self.twin(torch.tensor([tokens])).logits[0, -1], sampling)

    def propose(self, context: ProposeContext) -> Draft:
        g, sampling = context.generator, context.sampling
        q = self._law(context.tokens, sampling)
        first = int(torch.multinomial(q, 1, generator=g))
        rest = q.clone()
        rest[first] = 0.0
        rows, tokens, parents, scores = [q], [first], [-1], [float(q[first])]
        if rest.sum() > 0:
            rest = rest / rest.sum()
            second = int(torch.multinomial(rest, 1, generator=g))
            rows, tokens, parents, scores = rows + [rest], tokens + [second], parents + [-1], scores + [float(rest[second])]
        if context.max_depth >= 2:
            child = self._law(context.tokens + [first], sampling)
            token = int(torch.multinomial(child, 1, generator=g))
            rows, tokens, parents, scores = rows + [child], tokens + [token], parents + [0], scores + [float(child[token])]
        return Draft(torch.tensor(tokens), torch.tensor(parents), torch.stack(rows), scores=scores)


class DropsUnlikelySampledNodes(Clocked):
    """Broken on purpose: drops the nodes of a sampled draft whose own drawn probability is under 0.3 (and their subtrees)."""

    def trim(self, draft, context, exact_any_subset):
        kept = []
        for node, parent in enumerate(draft.parent_list):
            if draft.scores[node] >= 0.3 and (parent < 0 or parent in kept):
                kept.append(node)
        return keep_nodes(draft, kept), kept


N_LAW, N_CONTROL = 4000, 1500


@pytest.fixture(scope="module")
def law_target(make_llama):
    return make_llama(vocab_size=V, hidden_size=16, layers=1, seed=5)


@pytest.mark.parametrize("temperature", [0.7, pytest.param(1.0, marks=pytest.mark.slow)])
def test_sampled_output_follows_the_law_with_the_controller_deciding(law_target, law_check, temperature):
    """Plans that vary with past outcomes and rows dear enough to trim: a sampled tree and a deterministic n-gram tree stay exact."""
    sampling = SamplingParams(temperature)
    for label, proposer, per_row in (("random tree: ", ScoredTree(), 0.05), ("the target's twin: ", ScoredTree(twin=law_target), 0.15)):
        controller = Clocked(2, linear_costs(drafting_per_depth=0.0, per_row=per_row, drafted=0.0), max_width=2)
        assert_follows_law(law_target, proposer, sampling, N_LAW, law_check, label, controller)
        assert sum(controller.planned[1:]) > 0.2 * N_LAW and controller.planned[0] > 0  # it both drafted and went plain
        assert all(sum(shape.planned) > 0 for shape in controller.shapes)  # and drafted both chains and trees
    ngram = load_proposer({"type": "ngram", "min_n": 1, "branches": 3, "max_nodes": 6})
    trimming = Clocked(ngram.draft_depth(), linear_costs(drafting_per_depth=0.0, per_row=0.2), max_width=3)
    assert_follows_law(law_target, ngram, sampling, N_LAW, law_check, "ngram tree: ", trimming)


def test_negative_control_dropping_sampled_nodes_by_their_values_fails_the_law(law_target, law_check):
    controller = DropsUnlikelySampledNodes(2, linear_costs(drafting_per_depth=0.0, per_row=0.15, drafted=0.0))
    assert_law_rejects(law_target, ScoredTree(twin=law_target), SamplingParams(1.0), N_CONTROL, law_check, controller)


def test_a_draft_model_tree_keeps_the_law_with_the_controller_at_temperature_one(law_target, law_check, make_llama):
    draft = make_llama(vocab_size=V, hidden_size=16, layers=1, seed=11)
    controller = Clocked(3, linear_costs(drafting_per_depth=0.02, per_row=0.05), max_width=2)
    proposer = DraftModelProposer(draft, k=3, tree_width=2)
    assert_follows_law(law_target, proposer, SamplingParams(1.0), N_LAW, law_check, "draft tree: ", controller)


def test_the_catch_up_price_shrugs_off_a_pause_and_small_catch_ups():
    """Catching up costs 0.5 + 0.01 per position here; one of eight catch-ups hit a 50-unit pause, and most were a few
    positions: the robust line prices 960 positions within 20% of 10.1. Negative control: least squares with forgetting
    (the line used before) prices them above 50, which would hold probes back for thousands of plain steps."""
    points = [(3, 0.53), (5, 0.55), (2, 0.52), (130, 1.8 + 50.0), (4, 0.54), (140, 1.9), (6, 0.56), (3, 0.53)]
    robust = RobustLine()
    for x, y in points:
        robust.update(float(x), y)
    a, b = robust.line()
    assert a + 960 * b == pytest.approx(0.5 + 9.6, rel=0.2)
    a, b = least_squares(points, forget=0.9)
    assert a + 960 * b > 50
