"""Probes pay for what they cost, the plain steps they slow included (``verify.probes``)."""

from __future__ import annotations

import random

from law import linear_costs, simulate

from draftsmith.proposers.core.types import Draft, VerifyResult
from draftsmith.verify import controller as controller_module
from draftsmith.verify.controller import Controller
from draftsmith.verify.probes import PROBE_BUDGET, ProbeLedger

PROMPT, TOKENS = 960, 63  # the demo's long domain: each request feeds a drafter 960 positions before its first draft


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
    ledger.begin(0.0, 60)
    ledger.step(1, 1.0, plain=1.0, last=False)
    ledger.step(1, 1.5, plain=1.0, last=True)  # the pair lost half a plain step
    assert ledger.loss == 0.5
    for _ in range(5):
        ledger.plain_step(1.1)
    ledger.drafted_step()
    assert abs(ledger.loss - 1.0) < 1e-9  # five plain steps, each a tenth slower: half a plain step more
    ledger.begin(0.0, 60)
    ledger.step(1, 1.0, plain=1.0, last=False)
    ledger.step(1, 1.0, plain=1.0, last=True)
    for _ in range(20):
        ledger.plain_step(3.0)  # a pause: 40 plain steps of excess
    assert ledger._losses[-1] == 2.0  # the cap
    ledger.plain_step(9.0)  # outside the window
    assert ledger._losses[-1] == 2.0


def requests(controller: Controller, count: int, accept, catch_up=(0.5, 0.005), seed: int = 0):
    """Drive ``controller`` over ``count`` requests of ``TOKENS`` tokens after a ``PROMPT``-token prompt, on the
    ``linear_costs`` clock (a plain step costs 1): a drafted step first feeds its drafter the positions it has not
    seen, at ``catch_up[0] + catch_up[1]`` per position (960: 5.3 plain steps). Each node of a chain is accepted with
    ``accept(request)``. Yields (request, plan, seconds, tokens committed) per step."""
    rng, costs = random.Random(seed), linear_costs()
    for request in range(count):
        controller.start()
        context, fed = PROMPT, 0
        while context < PROMPT + TOKENS:
            plan = controller.plan(context=context, room=PROMPT + TOKENS - context)
            draft = Draft.chain(list(range(plan.depth)), scores=[0.5] * plan.depth) if plan.depth else Draft.empty()
            if plan.depth and plan.trims:
                draft, _ = controller.trim(draft, context, True)
            n = 0
            while n < draft.num_nodes and rng.random() < accept(request):
                n += 1
            drafting, rest = costs(plan, draft)
            if plan.depth and context - fed > 1:
                drafting += catch_up[0] + catch_up[1] * (context - fed)
            result = VerifyResult(list(range(n)), list(range(n)), 0, n < draft.num_nodes)
            controller.observe(plan, draft, result, context, drafting, drafting + rest, True)
            context += n + 1
            fed = context if plan.depth else fed
            yield request, plan, drafting + rest, n + 1


def back_on_after(controller: Controller, off: int = 16, on: int = 16) -> int | None:
    """Random text for ``off`` requests, then text the drafter predicts (90% a node): the plain steps from the switch
    to the first drafted step that is no probe (None: still off after ``on`` requests)."""
    plain = 0
    for request, plan, _, _ in requests(controller, off + on, lambda request: 0.0 if request < off else 0.9):
        if request >= off:
            if plan.depth and not plan.probe:
                return plain
            plain += plan.depth == 0
    return None


def test_a_long_prompt_s_catching_up_does_not_keep_a_drafter_that_pays_off():
    """A drafter turned off by random text, over requests whose first draft feeds it 960 positions (5.3 plain steps),
    is on again within 150 plain steps of the text turning predictable: the catching up is charged after a probe, not
    saved for before it, and not at all when what the probe won repays it over the request's rest (37 here). Negative
    control: a probe that waits for the credit to cover its catching up too, and is always charged it (the rule
    before), is still off after 400 plain steps (914 here)."""
    assert back_on_after(Controller(6)) <= 150
    before = Controller(6)
    before.probes.due = lambda: before.probes.credit >= before._catch_up_cost(PROMPT) + max(before.probes.loss or 0.0, 0.0)
    before.probes.begin = lambda catch_up, room: ProbeLedger.begin(before.probes, catch_up, 0)  # no room: always charged
    waited = back_on_after(before)
    assert waited is None or waited >= 400, waited


def share_lost_to_long_prompts(charge_catch_up: bool, count: int = 160) -> float:
    """Random text over ``count`` long-prompt requests: the share of the time lost against plain decoding."""
    controller = Controller(6)
    if not charge_catch_up:
        controller.probes.begin = lambda catch_up, room: ProbeLedger.begin(controller.probes, 0.0, room)
    total = tokens = 0.0
    for request, _, seconds, committed in requests(controller, count, lambda request: 0.0):
        if request >= 8:  # the first requests learn that drafting does not pay
            total, tokens = total + seconds, tokens + committed
    return (total - tokens) / total


def test_probes_of_long_prompts_cost_the_budget_with_their_catching_up():
    """Where drafting never pays and every probe first feeds its drafter 960 positions, probing loses at most 1.5x the
    budget (1%) of the time. Negative control: probes charged for their two steps but not their catching up lose >= 2x."""
    assert share_lost_to_long_prompts(True) <= 1.5 * PROBE_BUDGET
    assert share_lost_to_long_prompts(False) >= 2 * PROBE_BUDGET


def test_a_probe_s_catching_up_is_charged_unless_its_win_repays_it_over_the_request_s_rest():
    """A probe whose catching up is priced at 2 plain steps and whose two steps commit 5 tokens in the time of 4 beyond it
    wins 0.2 plain steps a token: with 55 tokens left after it that repays the catching up (11 > 2) and only what its
    steps won counts; with 5 left (1 < 2) the catching up is charged too."""
    for room, credit in ((60, 1.0), (10, -1.0)):
        ledger = ProbeLedger()
        ledger.begin(2.0, room)
        ledger.step(2, 4.0, plain=1.0, last=False)  # the catching up (2), and 2 tokens in the time of 2 plain steps
        ledger.step(3, 2.0, plain=1.0, last=True)  # 3 tokens in the time of 2
        assert ledger.loss == -1.0
        assert ledger.credit == credit  # a win is kept to a plain step (it buys the next probe, not a hoard)


def test_a_proposer_is_probed_after_the_ceiling_however_much_its_last_probe_lost(monkeypatch):
    """Random text throughout, and a probe's catching up costs 10^4 plain steps: after a probe the credit is far
    below zero, and still the next comes within PROBE_CEILING + 10 plain steps. Negative control: without the ceiling,
    none comes in 3000 steps."""
    dear = linear_costs()

    def costs(plan, draft):
        drafting, rest = dear(plan, draft)
        return drafting + (1e4 if plan.probe and not plan.whole and previous[0] == 0 else 0.0), rest

    def probes(ceiling: float) -> list[int]:
        monkeypatch.setattr(controller_module, "PROBE_CEILING", ceiling)
        previous[0] = -1
        found = []
        for i, plan in enumerate(simulate(Controller(6), 3000, lambda step, depth: 0.0, costs=costs)):
            if plan.probe and not plan.whole and previous[0] == 0:
                found.append(i)
            previous[0] = plan.depth
        return found

    previous = [-1]
    found = probes(controller_module.PROBE_CEILING)
    # the first probe's catching up is not priced yet, so its loss counts for at most 2 plain steps; the second's is
    assert len(found) >= 3 and found[2] - found[1] <= controller_module.PROBE_CEILING + 10, found[:4]
    assert len(probes(float("inf"))) == 2
