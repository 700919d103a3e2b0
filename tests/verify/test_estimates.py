"""What the speculation controller knows of a draft shape (its acceptance counts and how they forget), and of a draft's rows."""

from __future__ import annotations

import math
import random

import pytest
import torch
from law import least_squares

from draftsmith.proposers.core.types import Draft, VerifyResult
from draftsmith.verify.controller import Controller, Plan
from draftsmith.verify.estimates import STALE, RowsCurve, ShapeEstimates, average, first_children_chain


def test_a_depth_counted_every_drafted_step_forgets_at_the_stated_decay_and_a_skipped_one_goes_stale():
    """The acceptance window is the stated one: counts drafted at every step keep ``decay`` per step, not ``decay * STALE``.

    Negative control: the formula that also took a step of staleness from a depth drafted at
    the previous step (a window of ~8 where 0.9 states ~10) gives other counts.
    """
    decay, shape = 0.95, ShapeEstimates(None, 3)
    for now in range(1, 6):  # depths 1 and 2 drafted at every drafted step, accepted to depth 2
        shape.learn_depths(2, [1, 2], 2, decay, now)
    expected = sum(decay**i for i in range(5))
    assert shape.reached[1] == pytest.approx(expected) and shape.accepted[2] == pytest.approx(expected)
    assert shape.reached[1] != pytest.approx(sum((decay * STALE) ** i for i in range(5)))  # the double-counted window
    shape.learn_depths(1, [1], 0, decay, 9)  # drafted steps 6, 7 and 8 did not draft depth 1: three steps stale
    assert shape.reached[1] == pytest.approx(decay * STALE**3 * expected + 1.0)
    assert shape.accepted[1] == pytest.approx(decay * STALE**3 * expected)
    shape.learn_depths(1, [1], 1, decay, 9)  # a second count at the same drafted step (a probe's pair): no staleness
    assert shape.reached[1] == pytest.approx(decay * (decay * STALE**3 * expected + 1.0) + 1.0)


def test_a_pause_inside_a_step_moves_its_depths_cost_by_a_bounded_amount_and_a_shallower_depth_costs_no_more():
    """A 40-plain-step pause in one step at depth 4 raises that depth's estimate by at most a tenth of (estimate + plain
    step), and 20 normal steps bring it back within 5%; a depth whose few steps were dear is priced at a deeper depth's
    cost when that is lower. Negative control: the unbounded average, after the same steps, is still 80% too dear."""
    plain, normal, shape = 1.0, 0.5, ShapeEstimates(1, 6)
    for depth in range(1, 7):
        shape.learn_draft_cost(depth, 0.1 * depth, 1.0)
        for _ in range(10):
            shape.learn_verify_cost(depth, normal * depth / 4, plain)
    before = shape.verify_seconds[4]
    shape.learn_verify_cost(4, 40.0 * plain, plain)
    assert shape.verify_seconds[4] <= before + 0.1 * (before + max(before, plain)) + 1e-9
    unbounded = average(before, 40.0 * plain)
    for _ in range(20):
        shape.learn_verify_cost(4, before, plain)
        unbounded = average(unbounded, before)
    assert shape.verify_seconds[4] == pytest.approx(before, rel=0.05)
    assert unbounded > 1.8 * before
    for _ in range(3):  # depth 2's few steps were dear: 3 plain steps over the rest
        shape.learn_verify_cost(2, 3.0 * plain, plain)
    costs = shape.plan_costs(plain, RowsCurve(), shape.draft_costs(1.0), [0.0] * 7)
    assert costs[2] == pytest.approx(costs[3]) and costs[3] < plain + 0.2 + shape.verify_seconds[2]
    assert all(costs[d] <= costs[d + 1] for d in range(1, 6)), costs


def test_a_chain_s_depths_may_be_left_implicit_and_nodes_below_the_planned_depth_are_not_counted():
    """``depths=None`` (a chain: one node per depth) counts as the chain's own depths; a tree's nodes below the planned
    depth add no rows, and its accepted length counts up to the planned depth."""
    explicit, implicit, tree = ShapeEstimates(1, 5), ShapeEstimates(1, 5), ShapeEstimates(None, 5)
    for now, accepted in enumerate([0, 3, 2, 4, 1, 3], start=1):
        explicit.learn_depths(4, [1, 2, 3, 4], accepted, 0.95, now)
        implicit.learn_depths(4, None, accepted, 0.95, now)
    assert [explicit.reached, explicit.accepted, explicit.rows, explicit.stamp] == [
        implicit.reached, implicit.accepted, implicit.rows, implicit.stamp]  # fmt: skip
    tree.learn_depths(2, [1, 1, 2, 3, 3], 3, 0.95, 1)
    assert tree.rows[1:4] == [2.0, 3.0, 0.0] and tree.accepted[1:4] == [1.0, 1.0, 0.0]


def test_the_rows_curve_follows_a_concave_cost_and_more_rows_never_cost_less():
    """Rows costing 0.8 ms * sqrt(n) (this CPU's shape), +-15% noise (seed 0), drafts of 1-4 nodes mostly and a few of 16:
    the curve is within 10% of the truth at 1-16 nodes and 15% at 8 (between points), non-decreasing, and its floor
    under every marginal cost. Negative control: a least-squares line through the same steps (the model used before)
    prices one node 20% high, and each row from 4 to 16 nodes above the curve."""
    rng, truth = random.Random(0), lambda n: 0.8e-3 * math.sqrt(n)
    sizes, curve, seen = [1] * 5 + [2] * 10 + [3] * 10 + [4] * 5 + [16] * 3, RowsCurve(), []
    for _ in range(4):
        rng.shuffle(sizes)
        for n in sizes:
            extra = truth(n) * rng.uniform(0.85, 1.15)
            curve.update(n, extra)
            seen.append((n, extra))
    assert curve.ready
    for n, bound in ((1, 0.1), (2, 0.1), (3, 0.1), (4, 0.1), (8, 0.15), (16, 0.1)):
        assert curve.at(n) == pytest.approx(truth(n), rel=bound), n
    extra, floor = curve.table(40)
    assert all(extra[k] <= extra[k + 1] for k in range(40)) and len(extra) > 40
    assert all(floor[k] <= extra[k] - extra[k - 1] + 1e-12 for k in range(1, 41))
    intercept, slope = least_squares(seen, forget=1.0)
    assert intercept + slope * 1 > 1.2 * truth(1)
    assert slope > (curve.at(16) - curve.at(4)) / 12


def test_a_rows_curve_with_one_size_is_flat_and_not_ready_and_a_cheaper_larger_size_is_pooled():
    curve = RowsCurve()
    assert curve.at(3) == 0.0 and not curve.ready
    curve.update(2, 1.0)
    assert curve.at(1) == curve.at(9) == 1.0 and not curve.ready
    curve.update(8, 0.6)  # more rows measured cheaper (noise): pooled into one level (no slope yet), never a falling curve
    assert not curve.ready and curve.at(2) == curve.at(8) == pytest.approx(0.8)
    curve.update(16, 1.5)
    assert curve.points() == [(5.0, pytest.approx(0.8)), (16.0, 1.5)]  # the pooled level sits at its sizes' mean
    assert curve.ready and curve.at(2) == pytest.approx(0.8 - 3 * 0.7 / 11)  # below it, the first segment carried back


def test_a_trimmed_tree_teaches_the_chain_only_the_depths_its_first_children_reach():
    """A tree planned 4 deep, trimmed to first children 2 deep (plus a sibling), both accepted: the chain shape counts
    depths 1-2 as reached and accepted, and depths 3-4 not at all (nothing says what a chain would accept there).
    Negative control: counted to the planned depth, as before, depths 3-4 would read as drafted and rejected."""
    controller = Controller(4, max_width=2)
    controller.plain_seconds = 1.0
    draft = Draft(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, -1]), scores=[0.9, 0.8, 0.1])  # first children 0 -> 1
    result = VerifyResult([0, 1], [5, 6], 9, False)
    controller.observe(Plan(4, shape=1), draft, result, 100, 0.1, 1.5, greedy=True)
    controller._learn_pending()
    chain = controller.shapes[0]
    assert chain.reached[1:] == [1.0, 1.0, 0.0, 0.0] and chain.accepted[1:] == [1.0, 1.0, 0.0, 0.0]
    assert first_children_chain(draft.parent_list, result.accepted_nodes) == (2, 2)
    old = ShapeEstimates(1, 4)
    old.learn_depths(4, None, 2, 0.95, 1)
    assert old.reached[3:] == [1.0, 1.0] and old.accepted[3:] == [0.0, 0.0]


def test_the_rows_table_is_the_curve_read_at_every_count_and_its_floor_the_least_margin_from_there():
    """The trim's table (built in one walk along the segments) equals ``at`` at every whole count, exactly, over 300
    random curves (seed 0; one to a dozen sizes, some pooled), and each floor is the least margin from its count on."""
    rng = random.Random(0)
    for _ in range(300):
        curve = RowsCurve()
        for _ in range(rng.randint(1, 40)):
            curve.update(rng.choice([rng.randint(1, 8), rng.randint(1, 150)]), rng.uniform(-1e-4, 5e-3))
        extra, floor = curve.table(rng.randint(1, 90))
        assert extra == [0.0] + [curve.at(k) for k in range(1, len(extra))]
        margins = [extra[k] - extra[k - 1] for k in range(1, len(extra))]
        assert floor[1:] == [min(margins[k:]) for k in range(len(margins))]
