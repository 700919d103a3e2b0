"""The nodes a trim cut, tested for free by the step's next token (``verify.calibration.cut_children``), and what the
controller learns from a trimmed step: the calibration counts the cut nodes' tests, the plan's shares what was verified."""

from __future__ import annotations

import random

import pytest

from draftsmith.proposers.core.types import Draft, VerifyResult, long_tensor
from draftsmith.verify import learning as learning_module
from draftsmith.verify.calibration import bin_of, cut_children
from draftsmith.verify.controller import Controller
from draftsmith.verify.estimates import ShapeEstimates


def test_the_cut_children_of_the_accepted_path_s_end_are_tested_against_the_next_token():
    chain = Draft.chain([10, 11, 12, 13, 14], scores=[0.9, 0.9, 0.9, 0.2, 0.1])
    kept = [0, 1, 2]  # the trim kept depths 1-3
    assert cut_children(chain, kept, 13, [0, 1, 2]) == [(4, 0.2, True)]  # all kept accepted: depth 4 would have been too
    assert cut_children(chain, kept, 99, [0, 1, 2]) == [(4, 0.2, False)]
    assert cut_children(chain, kept, 12, [0, 1]) == []  # the path ended at depth 2, whose child was kept (and rejected)
    # a tree: the root's children 0 (kept) and 1 (cut); node 0's children 2 (kept) and 3 (cut)
    tree = Draft(Draft.chain([5, 6, 7, 8]).token_ids, Draft.chain([0, 0, 0, 0]).token_ids.new_tensor([-1, -1, 0, 0]), None, None,
                 [0.8, 0.3, 0.7, 0.4])  # fmt: skip
    assert cut_children(tree, [0, 2], 6, []) == [(1, 0.3, True)]  # nothing accepted: the root's cut child is tested
    assert cut_children(tree, [0, 2], 9, [0]) == [(2, 0.4, False)]  # the path ends at node 0: its cut child, not the root's


def test_a_step_counts_its_rows_to_the_planned_depth_and_its_reach_as_verified():
    decay, shape = 0.95, ShapeEstimates(1, 6)
    shape.learn_depths(6, [1, 2, 3, 4, 5, 6], 6, decay, 1)  # a whole chain accepted
    shape.learn_depths(6, [1, 2, 3], 3, decay, 2)  # trimmed to three nodes, all accepted: depths 4-6 not reached
    assert shape.reached[1:] == pytest.approx([1 + decay] * 6)
    assert shape.accepted[1:] == pytest.approx([1 + decay] * 3 + [decay] * 3)
    assert shape.rows[1:] == pytest.approx([decay + 1, 2 * decay + 2, 3 * decay + 3, 4 * decay + 3, 5 * decay + 3, 6 * decay + 3])


def warm(controller: Controller, seed: int = 0, steps: int = 60) -> None:
    """Decode a chain drafter whose depths 1-3 score 0.9 and pass 90% of the time and whose depth 4 and deeper score 0.05
    and pass 20%, on a clock where a row costs 0.15 plain steps: its trims cut the low-scored nodes."""
    rng, context = random.Random(seed), 128
    for _ in range(steps):
        plan = controller.plan(context, 64)
        tokens = [100 + i for i in range(plan.depth)]
        draft = Draft.chain(tokens, scores=[0.9 if i < 3 else 0.05 for i in range(plan.depth)]) if plan.depth else Draft.empty()
        if plan.depth and plan.trims:
            draft, _ = controller.trim(draft, context, True)
        accepted = 0
        while accepted < draft.num_nodes and rng.random() < (0.9 if accepted < 3 else 0.2):
            accepted += 1
        result = VerifyResult(list(range(accepted)), tokens[:accepted], 1, accepted < draft.num_nodes)
        seconds = 1.0 + 0.15 * draft.num_nodes + (0.1 + 0.05 * plan.depth if plan.depth else 0.0)
        controller.observe(plan, draft, result, context, 0.1 + 0.05 * plan.depth if plan.depth else 0.0, seconds, True)
        context += accepted + 1


def cut_step(controller: Controller, greedy: bool, recovered: bool, match: bool) -> int:
    """One drafted step of 6 whose trim cuts the low-scored nodes, all kept nodes accepted (or the last rejected); the next
    token is the first cut node's (``match``) or another. Returns how many nodes the trim kept."""
    plan = controller._plan(6, 0)
    tokens = [100 + i for i in range(6)]
    draft, kept = controller.trim(Draft.chain(tokens, scores=[0.9, 0.9, 0.9, 0.05, 0.05, 0.05]), 4096, True)
    assert kept is not None and len(kept) < 6  # the trim cut
    accepted = list(range(len(kept) - 1 if recovered else len(kept)))
    next_token = tokens[len(kept)] if match else 1
    controller.observe(plan, draft, VerifyResult(accepted, tokens[: len(accepted)], next_token, recovered), 4096, 0.4, 2.0, greedy)
    controller._learn_pending()
    return len(kept)


@pytest.mark.parametrize("greedy, recovered, tested", [(True, False, True), (True, True, True), (False, False, True), (False, True, False)])
def test_what_a_trim_cut_is_tested_where_the_next_token_is_the_target_s_own_choice(monkeypatch, greedy, recovered, tested):
    """At temperature 0 the next token is the target's choice after the path (a cut sibling of a rejected node is tested
    too); at temperature > 0 only where the path ended with no child verified is it a draw from the target's
    distribution. A step the trim did not cut tests nothing."""
    controller, calls = Controller(6), []
    warm(controller)
    controller._learn_pending()
    monkeypatch.setattr(learning_module, "cut_children", lambda *args: calls.append(args) or [])
    cut_step(controller, greedy, recovered, match=True)
    cut_step(controller, greedy, recovered, match=True)  # of two steps in a row one calibrates (and reads the test)
    assert len(calls) == tested
    plan = controller._plan(2, 0)
    draft = Draft.chain([100, 101], scores=[0.9, 0.9])
    for _ in range(2):
        controller.trim(draft, 4096, True)  # kept whole: nothing cut
        controller.observe(plan, draft, VerifyResult([0, 1], [100, 101], 7, False), 4096, 0.2, 1.5, greedy)
    controller._learn_pending()
    assert len(calls) == tested


def test_what_a_trim_cut_counts_as_not_reached_and_its_test_moves_the_calibration(monkeypatch):
    """After the same warm-up: the depths below a trimmed step's kept nodes count as not reached whether or not the first
    cut node matched the next token (the plan prices what a step planned there delivers, its trim included), and the
    match moves the cut node's calibration bin above where a miss leaves it. Negative control: without the test
    (``cut_children`` finding nothing) a match and a miss leave the bin alike."""

    def change(match: bool, tested: bool) -> tuple[int, list[float], float]:
        """(nodes kept, per depth the change of the accepted count, the change of the cut node's chance)."""
        controller = Controller(6)
        warm(controller)
        controller._learn_pending()
        if controller.observed % 2:  # the cut step calibrates (half the steps do: every other one observed)
            warm(controller, steps=1)
            controller._learn_pending()
        if not tested:
            monkeypatch.setattr(learning_module, "cut_children", lambda *args: [])
        shape, chances = controller.shapes[0], controller.calibration.chances("")
        accepted, before = list(shape.accepted), list(chances)
        kept = cut_step(controller, True, False, match)  # learnt from at once
        monkeypatch.undo()
        cut_bin = bin_of(kept + 1, 0.05)
        return kept, [b - a for a, b in zip(accepted, shape.accepted, strict=True)], chances[cut_bin] - before[cut_bin]

    moves = {}
    for match in (True, False):
        kept, accepted, moves[match] = change(match, tested=True)
        assert all(accepted[d] > 0 for d in range(1, kept + 1)) and all(accepted[d] <= 0 for d in range(kept + 1, 7))
    assert moves[True] > moves[False] + 0.01  # the test reached the calibration: a match raises the bin against a miss
    assert change(True, tested=False)[2] == pytest.approx(change(False, tested=False)[2])


def test_a_tree_teaches_the_chain_every_planned_depth_where_its_path_left_the_chain_of_first_children():
    """A trim keeps a tree's first children deep where the drafter is confident, and there the path runs through them:
    the chain learns from a tree what its chain of first children accepted, and where the path left it (a miss), every
    planned depth below is a miss too. Here half the steps are confident (a kept chain of 4, all accepted) and half not
    (one first child kept, the path takes a sibling): depth 3's share is 0.5. Negative control: telling only the depths
    the kept chain held (the rule before) reads it 1.0, from the confident steps alone."""

    def tree_step(controller: Controller, confident: bool) -> None:
        plan = controller._plan(4, 1)
        if confident:  # a chain of first children 0-1-2-3, and a sibling under the root; the path runs through the chain
            parents, accepted = [-1, 0, 1, 2, -1], [0, 1, 2, 3]
        else:  # one first child (0) and its sibling (1); the path takes the sibling, then its child (2)
            parents, accepted = [-1, -1, 1], [1, 2]
        draft = Draft(long_tensor(range(100, 100 + len(parents))), long_tensor(parents), None, None, [0.5] * len(parents))
        result = VerifyResult(accepted, [100 + node for node in accepted], 7, False)
        controller.observe(plan, draft, result, 4096, 0.4, 2.0, True)

    controller = Controller(6, max_width=2)
    for step in range(40):
        tree_step(controller, confident=step % 2 == 0)
    controller._learn_pending()
    chain = controller.shapes[0]
    assert chain.accepted[3] / chain.reached[3] == pytest.approx(0.5, abs=0.05)
    old = ShapeEstimates(1, 6)  # the rule before: told to the chain's kept length (4 confident, 1 not)
    for step in range(40):
        old.learn_depths(4 if step % 2 == 0 else 1, None, 4 if step % 2 == 0 else 0, controller.decay, step + 1)
    assert old.accepted[3] / old.reached[3] == pytest.approx(1.0)
