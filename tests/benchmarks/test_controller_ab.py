"""``benchmarks/bench_controller_ab.py``: the settings it passes to each controller, and what it refuses."""

from __future__ import annotations

import pytest

from benchmarks.bench_controller_ab import checked, settings
from draftsmith.verify.controller import Controller


def test_settings_are_controller_keyword_arguments():
    kwargs = settings("explore_every=16,decay=0.9")
    assert kwargs == {"explore_every": 16, "decay": 0.9} and isinstance(kwargs["explore_every"], int)
    controller = Controller(6, **kwargs)
    assert (controller.explore_every, controller.decay) == (16, 0.9)
    assert settings("") == {}


@pytest.mark.parametrize("bad", ["explore_every", "explore_every=sixteen", "decay=0.9.1"])
def test_a_setting_that_is_not_a_number_is_refused_by_name(bad):
    with pytest.raises(SystemExit, match=bad.split("=")[0]):
        settings(bad)


def test_a_setting_the_controller_does_not_take_is_refused_before_any_decoding():
    assert checked(Controller, {"explore_every": 16}, "--kwargs") == (Controller, {"explore_every": 16})
    for bad in ({"explore": 16}, {"": 3.0}, {"max_depth": 4}):  # a typo, a bare value, a setting the proposer gives
        with pytest.raises(SystemExit, match="--kwargs"):
            checked(Controller, bad, "--kwargs")
