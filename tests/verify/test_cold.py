"""A long request's first steps run in its prefill's aftermath: they price nothing (``verify.learning.COLD_STEPS``)."""

from __future__ import annotations

from law import requests

from draftsmith.verify import controller as controller_module
from draftsmith.verify.controller import Controller


def plain_price(count: int, accept: float, tokens: int = 63) -> tuple[float, int]:
    """(the plain step's price, the steps drafted) after ``count`` requests whose first two steps cost 0.3 plain steps more
    (on this CPU a request's first step after its prefill costs ~22% more than the rest, the second ~7%)."""
    controller = Controller(4)
    drafted = sum(
        plan.depth > 0
        for _, plan, _, _ in requests(
            controller, count, lambda request: accept, catch_up=(0.2, 0.0), prompt=lambda r: 100, tokens=tokens, cold=(2, 0.3)
        )  # fmt: skip
    )
    controller.snapshot()
    return controller.plain_seconds, drafted


def test_a_long_request_s_first_two_steps_do_not_price_a_plain_step(monkeypatch):
    """A drafter that pays (80% a node), so that plain steps are rare (one per 64 drafted steps, and the controller's
    first): over 20 requests the plain step's price stays within 2% of its true cost, 1. Negative control: with every
    step pricing (``COLD_STEPS`` = 0) the controller's first step sets it 30% high, still >= 10% high after them."""
    price, drafted = plain_price(20, 0.8)
    assert abs(price - 1.0) <= 0.02 and drafted > 300, (price, drafted)
    monkeypatch.setattr(controller_module, "COLD_STEPS", 0)
    price, _ = plain_price(20, 0.8)
    assert price >= 1.1, price


def test_a_short_request_s_steps_price_as_they_come():
    """In requests of 8 tokens (less room than ``COLD_ROOM``) the first steps are the typical ones: they price a plain step
    (between 1 and 1.3 here) and the controller drafts."""
    price, drafted = plain_price(20, 0.8, tokens=8)
    assert price is not None and 1.0 <= price <= 1.3 and drafted > 20, (price, drafted)
