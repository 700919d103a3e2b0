"""The speculation controller's ``StopRule``: a drafter stops a path only where the trim would cut it anyway.

A controller that has learnt costs and calibration on synthetic steps (``law.simulate``, a
deterministic clock) prices random trees; every node the rule would leave unexpanded, the
trim cuts. Negative control: a rule twice as strict would stop nodes the trim keeps,
so the bound is not vacuous. Greedy outputs with the rule on are checked for every proposer
in ``test_controller.py`` (the decoder passes the rule wherever the plan trims).
"""

from __future__ import annotations

import random

import pytest
import torch
from law import linear_costs, simulate

from draftsmith.proposers.composite import CompositeProposer
from draftsmith.proposers.core.proposer import ProposerBase
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.types import Draft, ProposeContext, StopRule, VerifyResult
from draftsmith.verify.controller import Controller


def random_tree(rng: random.Random, nodes: int) -> Draft:
    """A tree of ``nodes`` nodes (each parent an earlier node or the root) with random confidences in (0, 1)."""
    parents = [rng.randrange(-1, i) for i in range(nodes)]
    return Draft(torch.arange(nodes), torch.tensor(parents), scores=[rng.random() for _ in range(nodes)])


def trained() -> Controller:
    """A controller after 300 synthetic steps: its costs, rows curve and calibration learnt."""
    controller = Controller(6)
    for _ in simulate(controller, 300, lambda step, depth: 0.6 if depth < 3 else 0.3, score=0.6, costs=linear_costs()):
        pass
    return controller


def test_the_trim_keeps_no_node_the_stop_rule_would_have_left_unexpanded():
    """Over 300 random trees of 1-24 nodes: no node the trim keeps is worth less than ``least`` (some are, and are cut);
    at twice ``least`` some kept node would have been stopped. (After a drafted plan the trim counts its drafting as spent,
    and in a step whose rate falls below a plain step's it may keep such a node: there the stop saves drafting.)"""
    controller = trained()
    rule = controller.stop_rule()
    assert rule is not None and rule.least > 0, "the controller has learnt its rows and calibration by now"
    rng, below, kept_values = random.Random(0), 0, []
    for _ in range(300):
        draft = random_tree(rng, rng.randint(1, 24))
        values: list[float] = []
        rule.values(draft.parent_list, draft.depth_list, draft.scores, values)
        _, kept = controller.trim(draft, 100, True)
        kept = range(draft.num_nodes) if kept is None else kept
        kept_values += [values[n] for n in kept]
        below += sum(v < rule.least for v in values)
        assert all(values[n] >= rule.least for n in kept), (rule.least, [values[n] for n in kept])
    assert below > 0, "no node fell below the rule's least: the check above is empty"
    assert kept_values and min(kept_values) < 2 * rule.least, (min(kept_values), rule.least)


def test_no_stop_rule_before_the_trim_trims_and_a_new_one_when_a_plain_steps_cost_moves():
    """A fresh controller (no plain step measured, no rows curve) gives no rule: a drafter drafts as planned. A trained one
    keeps its rule while nothing moves, and gives one with a lower ``least`` once a plain step is dearer."""
    assert Controller(6).stop_rule() is None
    controller = trained()
    rule = controller.stop_rule()
    assert controller.stop_rule() is rule
    plain = controller.plain_seconds
    controller.observe(Controller.PLAIN, Draft.empty(), VerifyResult([], [3], 0, False), 100, 0.0, 2.0 * plain, True)
    assert controller.plain_seconds > plain and controller.stop_rule().least < rule.least


class Recording(ProposerBase):
    """A member that records the rule it was given, and drafts one token."""

    vocab_size = 8

    def __init__(self):
        self.stops: list[StopRule | None] = []

    def begin(self, prompt, features):
        pass

    def observe(self, result, features):
        pass

    def draft_depth(self):
        return 1

    def draft_width(self):
        return 1

    def propose(self, context: ProposeContext) -> Draft:
        self.stops.append(context.stop)
        return Draft.chain([1], scores=[0.5])


def test_a_composite_passes_no_stop_rule_to_its_members():
    """A member's draft is calibrated under its own name, or merged without scores: the rule (for the proposer's own
    drafts) is not passed on."""
    members = [Recording(), Recording()]
    rule = StopRule(lambda depth, confidence: 1.0, 0.5)
    for policy in ("first_confident", "merge"):
        composite = CompositeProposer([{"type": "ngram"}, {"type": "ngram"}], policy=policy)
        composite.names, composite.members = ["a", "b"], members  # recording members in the ngram ones' place
        composite.propose(ProposeContext([1, 2], 1, SamplingParams(0.0), stop=rule))
    assert [stop for member in members for stop in member.stops] == [None] * sum(len(m.stops) for m in members) != []


def test_the_trim_counts_the_step_s_drafting_as_spent_and_keeps_no_fewer_nodes_the_dearer_it_was():
    """A trim maximises the step's tokens per second with its drafting already spent: the dearer the drafting, the lower
    the step's rate, and the more rows pay at it. Over 300 random trees (seed 1) the trim of a step whose drafting cost
    half a plain step keeps at least the nodes it keeps with the drafting free, and more on some trees. Negative control:
    priced as free (the rule before: the drafting left out), it keeps fewer on those trees."""
    controller, rng = trained(), random.Random(1)
    controller._planned = controller._plan(6, 0)
    counts = {}
    for drafting in (0.0, 0.5 * controller.plain_seconds):
        controller._draft_prices = [[drafting] * (controller.max_depth + 1) for _ in controller.shapes]
        rng.seed(1)
        counts[drafting] = [len(kept) if kept is not None else n for n in (rng.randint(1, 24) for _ in range(300))
                            for _, kept in [controller.trim(random_tree(rng, n), 100, True)]]  # fmt: skip
    free, spent = counts.values()
    assert all(b >= a for a, b in zip(free, spent, strict=True))
    assert sum(b > a for a, b in zip(free, spent, strict=True)) >= 50  # 127 of 300 here


def test_the_stop_rule_s_level_adds_a_depth_s_drafting_to_the_least_a_row_adds():
    """A depth's forward costs its row and a level of the planned shape's drafting (its measured price's growth per depth):
    with drafting measured at 0.4 plain steps a level, ``level`` is ``least`` + 0.4 (a plain step's rate), whatever the
    first depth's catching up costs; free drafting, or a single depth measured, leaves ``level`` at ``least``. Negative
    control: the two differ."""
    controller = trained()
    controller._planned = controller._plan(6, 0)
    shape, plain, levels = controller.shapes[0], controller.plain_seconds, {}
    for per_level, measured in ((0.0, (1, 2, 5)), (0.4, (1, 2, 5)), (0.4, (3,))):
        shape.draft_base = [None] * 7
        for depth in measured:
            shape.draft_base[depth] = (0.7 + per_level * depth) * plain / controller.draft_scale
        controller._stop = None  # as after a refresh
        rule = controller.stop_rule()
        levels[per_level, measured] = rule.level
        assert rule.level == pytest.approx(rule.least + (per_level if len(measured) > 1 else 0.0), rel=1e-6)
    assert levels[0.4, (1, 2, 5)] > levels[0.0, (1, 2, 5)] + 0.39
