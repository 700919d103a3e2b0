"""What the speculation controller knows of a draft shape: its acceptance counts and how they forget."""

from __future__ import annotations

import pytest

from draftsmith.verify.estimates import STALE, ShapeEstimates


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
