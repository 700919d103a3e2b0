"""A plain decision holds for a few steps without planning, and plans as planning every step would (``Controller._hold``)."""

from __future__ import annotations

from types import SimpleNamespace

from law import requests

from draftsmith.verify import controller as controller_module
from draftsmith.verify.controller import Controller


def drive(controller: Controller, count: int, accept) -> list[tuple[int, int, bool]]:
    """(request, planned depth, probe) per step of ``law.requests`` (prompts of 200 tokens); each request's start learns
    the last one's held steps, and a snapshot those of the last request."""
    steps = [
        (request, plan.depth, plan.probe)
        for request, plan, _, _ in requests(controller, count, accept, catch_up=(0.2, 0.002), prompt=lambda request: 200)
    ]
    controller.snapshot()
    return steps


def text(request: int) -> float:
    """Random text (nothing accepted) for 20 requests, then predictable text (90% a node) for 10, then random again."""
    return 0.9 if 20 <= request < 30 else 0.0


def test_a_held_plain_decision_plans_as_planning_every_step_would(monkeypatch):
    """Over random, then predictable, then random text (about 2500 steps, probes, their credit, a switch on and off), the
    controller plans the same depths and probes at the same steps as one that plans every step (``HOLD`` = 0), and
    ends with the same costs and credit; most of its plain steps were held.

    The controller's own time (left out of a plain step's cost) is stopped: timed, two runs of either differ in the
    last digits, and the synthetic clock's credit can meet a probe's loss exactly. Negative control: a hold blind to
    the probes' credit (always ``HOLD`` steps) delays probes, and plans otherwise."""
    monkeypatch.setattr(controller_module, "time", SimpleNamespace(perf_counter=lambda: 0.0))  # no recomputation's own time
    held = Controller(6)
    steps = drive(held, 40, text)
    assert sum(depth == 0 for _, depth, _ in steps) > 1500 and any(depth and not probe for _, depth, probe in steps)
    monkeypatch.setattr(controller_module, "HOLD", 0)
    every = Controller(6)
    assert drive(every, 40, text) == steps
    assert (held.plain_seconds, held.probes.credit, held.planned) == (every.plain_seconds, every.probes.credit, every.planned)
    monkeypatch.setattr(controller_module, "HOLD", 8)
    monkeypatch.setattr(Controller, "_hold", lambda self, drafting: 8)
    assert drive(Controller(6), 40, text) != steps


def test_most_plain_steps_are_held_where_drafting_does_not_pay(monkeypatch):
    """Random text: at least 3 in 4 plain steps are held (their plan a counter, their observation a list append).
    Negative control: with ``HOLD`` = 0 none is."""

    def held_share() -> float:
        controller, plans = Controller(6), []
        original = controller.plan
        controller.plan = lambda context, room: plans.append(original(context, room)) or plans[-1]
        drive(controller, 10, lambda request: 0.0)
        plain = [plan for plan in plans if plan.depth == 0]
        return sum(plan is Controller.HELD for plan in plain) / len(plain)

    assert held_share() >= 0.75
    monkeypatch.setattr(controller_module, "HOLD", 0)
    assert held_share() == 0.0
