"""What the speculation controller knows of a draft shape: its acceptance counts and how they forget."""

from __future__ import annotations

import pytest

from draftsmith.verify.estimates import STALE, ShapeEstimates, average


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
    costs = shape.plan_costs(plain, 0.0, 1.0, [0.0] * 7)
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
