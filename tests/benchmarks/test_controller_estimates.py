"""``benchmarks/bench_controller_estimates.py``: what a plan expected against what its steps delivered.

The recording controller logs only planned drafted steps (no probe, no exploring step, no plain
one) with the estimates the plan read, and the table averages them per planned depth and shape.
On a synthetic chain drafter whose nodes pass 0.8 at depth 1 and 0.3 below, the controller's
expected tokens at the depths it plans sit within 10% of what those steps delivered. Negative
control: a controller whose shares read every depth as reached (the estimates' bias at its
worst) expects far more than its steps deliver, above that bound.
"""

from __future__ import annotations

from law import simulate

from benchmarks.bench_controller_estimates import recording, table
from draftsmith.verify import controller as current


def test_the_table_averages_each_planned_depth_and_shape_and_drops_the_rare_ones():
    log = [(2, 0, 2.5, 0.002, 2, 0.003), (2, 0, 2.3, 0.004, 3, 0.005), (3, 1, 3.0, 0.004, 2, 0.004)]
    rows = table(log, min_steps=2)
    assert rows == [{"depth": 2, "shape": 0, "steps": 2, "expected_tokens": 2.4, "tokens": 2.5, "expected_ms": 3.0, "ms": 4.0}]


def ratios(controller_class) -> list[float]:
    controller = controller_class(6)
    plans = list(simulate(controller, 600, lambda step, depth: 0.8 if depth == 1 else 0.3, score=0.5))
    assert controller.log and all(entry[0] > 0 for entry in controller.log)
    assert len(controller.log) <= sum(plan.depth > 0 and plan.trims for plan in plans)
    return [row["expected_tokens"] / row["tokens"] for row in table(controller.log, min_steps=30)]


def test_the_plan_expects_about_what_its_steps_deliver():
    assert all(0.9 <= ratio <= 1.1 for ratio in ratios(recording(current))), ratios(recording(current))


def test_negative_control_shares_that_read_every_depth_reached_expect_too_much():
    class Optimistic(recording(current)):
        def plan(self, context, room):
            if self._estimates is not None:
                self._estimates = [([1.0] * len(shares), costs) for shares, costs in self._estimates]
            return super().plan(context, room)

    assert max(ratios(Optimistic)) > 1.1
