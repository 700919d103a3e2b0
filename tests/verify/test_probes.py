"""Probes pay for what they cost, the plain steps they slow included (``verify.probes``)."""

from __future__ import annotations

from law import linear_costs

from draftsmith.proposers.core.types import Draft, VerifyResult
from draftsmith.verify.controller import Controller
from draftsmith.verify.probes import PROBE_BUDGET, ProbeLedger


def share_lost(charge_aftermath: bool, steps: int = 4000, slower: float = 0.1) -> float:
    """Random text (nothing accepted) where the 20 plain steps after a drafted step are ``slower``: the share of the
    time lost against plain decoding (a plain step costs 1)."""
    controller, costs = Controller(6), linear_costs()
    if not charge_aftermath:
        controller.probes.plain_step = lambda seconds: None
    since, total = 99, 0.0
    for _ in range(steps):
        plan = controller.plan(context=100, room=8)
        draft = Draft.chain(list(range(plan.depth)), scores=[0.5] * plan.depth) if plan.depth else Draft.empty()
        if plan.depth and plan.trims:
            draft, _ = controller.trim(draft, 100, True)
        drafting, rest = costs(plan, draft)
        since = 0 if plan.depth else since + 1
        rest *= 1.0 + slower if 0 < since <= 20 else 1.0
        controller.observe(plan, draft, VerifyResult([], [], 0, draft.num_nodes > 0), 100, drafting, drafting + rest, True)
        total += drafting + rest
    return (total - steps) / total


def test_probes_are_charged_for_the_plain_steps_they_slow():
    """Probes of a useless proposer, where each slows the next 20 plain steps by 10%, lose at most 1.5x the budget (1%)
    of the time. Negative control: charged for their own two steps only, they come ~5x as often and lose >= 3%."""
    assert share_lost(True) <= 1.5 * PROBE_BUDGET
    assert share_lost(False) >= 3 * PROBE_BUDGET


def test_a_probe_s_aftermath_is_capped_and_ended_by_a_drafted_step():
    """What the plain steps after a probe lose counts toward its loss with the probe's own, at most ``PROBE_LOSS_CAP``
    plain steps in all (a pause among them is not a cost); a drafted step ends the window."""
    ledger = ProbeLedger()
    ledger.begin(0.0)
    ledger.step(1, 1.0, plain=1.0, last=False)
    ledger.step(1, 1.5, plain=1.0, last=True)  # the pair lost half a plain step
    assert ledger.loss == 0.5
    for _ in range(5):
        ledger.plain_step(1.1)
    ledger.drafted_step()
    assert abs(ledger.loss - 1.0) < 1e-9  # five plain steps, each a tenth slower: half a plain step more
    ledger.begin(0.0)
    ledger.step(1, 1.0, plain=1.0, last=False)
    ledger.step(1, 1.0, plain=1.0, last=True)
    for _ in range(20):
        ledger.plain_step(3.0)  # a pause: 40 plain steps of excess
    assert ledger._losses[-1] == 2.0  # the cap
    ledger.plain_step(9.0)  # outside the window
    assert ledger._losses[-1] == 2.0
