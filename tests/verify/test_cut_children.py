"""The nodes a trim cut, tested for free by the step's next token (``verify.calibration.cut_children``), and what the
controller learns from them: calibration counts, and a reach one deeper than verified with what lay below unknown."""

from __future__ import annotations

import random

import pytest

from draftsmith.proposers.core.types import Draft, VerifyResult
from draftsmith.verify import learning as learning_module
from draftsmith.verify.calibration import cut_children
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


def test_a_step_that_tells_depths_only_to_known_counts_its_rows_to_the_planned_depth():
    decay, shape = 0.95, ShapeEstimates(1, 6)
    shape.learn_depths(6, [1, 2, 3, 4, 5, 6], 6, decay, 1)  # a whole chain accepted
    shape.learn_depths(6, [1, 2, 3], 4, decay, 2, known=4)  # three nodes verified and accepted, a fourth (cut) would have been
    assert shape.reached[1:] == pytest.approx([1 + decay] * 4 + [decay] * 2)  # depths 5-6 aged, nothing added
    assert shape.accepted[1:] == pytest.approx([1 + decay] * 4 + [decay] * 2)
    assert shape.rows[1:] == pytest.approx([decay + 1, 2 * decay + 2, 3 * decay + 3, 4 * decay + 3, 5 * decay + 3, 6 * decay + 3])
    shape.learn_depths(6, [1, 2, 3], 3, decay, 3)  # the cut node tested and missed: every deeper depth is a known miss
    assert shape.reached[6] == pytest.approx(decay**2 + 1) and shape.accepted[6] == pytest.approx(decay**2)


def warm(controller: Controller, seed: int = 0, steps: int = 60) -> None:
    """Decode a chain drafter whose depth 4 and deeper score 0.05 and pass 90% of the time, on a clock where a row costs
    0.15 plain steps: its trims cut the low-scored nodes."""
    rng, context = random.Random(seed), 128
    for _ in range(steps):
        plan = controller.plan(context, 64)
        tokens = [100 + i for i in range(plan.depth)]
        draft = Draft.chain(tokens, scores=[0.9 if i < 3 else 0.05 for i in range(plan.depth)]) if plan.depth else Draft.empty()
        if plan.depth and plan.trims:
            draft, _ = controller.trim(draft, context, True)
        accepted = 0
        while accepted < draft.num_nodes and rng.random() < 0.9:
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
    assert len(calls) == tested
    plan = controller._plan(2, 0)
    draft = Draft.chain([100, 101], scores=[0.9, 0.9])
    controller.trim(draft, 4096, True)  # kept whole: nothing cut
    controller.observe(plan, draft, VerifyResult([0, 1], [100, 101], 7, False), 4096, 0.2, 1.5, greedy)
    controller._learn_pending()
    assert len(calls) == tested


def test_a_cut_node_that_would_have_passed_leaves_the_deeper_depths_unknown_and_one_that_missed_counts_them_missed(monkeypatch):
    """After the same warm-up: a step whose first cut node matches the next token counts its depth reached and accepted,
    and leaves the share of the depths below it as it was (their counts age, nothing is added); a miss counts them missed.
    Negative control: without the test (``cut_children`` finding nothing) the match is counted missed below the cut."""

    def change(match: bool, tested: bool) -> tuple[int, list[float], list[float], list[float]]:
        """(nodes kept, and per depth the change of reached and accepted counts, and of their ratio)."""
        controller = Controller(6)
        warm(controller)
        controller._learn_pending()
        if not tested:
            monkeypatch.setattr(learning_module, "cut_children", lambda *args: [])
        shape = controller.shapes[0]
        reached, accepted = list(shape.reached), list(shape.accepted)
        kept = cut_step(controller, True, False, match)
        monkeypatch.undo()
        moved = [b - a for a, b in zip(reached, shape.reached, strict=True)]
        ratio = [a / r if r else 0.0 for a, r in zip(accepted, reached, strict=True)]
        share = [(a / r if r else 0.0) - before for a, r, before in zip(shape.accepted, shape.reached, ratio, strict=True)]
        return kept, moved, [b - a for a, b in zip(accepted, shape.accepted, strict=True)], share

    kept, reached, accepted, share = change(match=True, tested=True)
    cut = kept + 1  # the depth of the first node cut
    assert accepted[cut] > 0 and all(reached[d] <= 0 and share[d] == pytest.approx(0.0, abs=1e-12) for d in range(cut + 1, 7))
    kept, reached, accepted, _ = change(match=False, tested=True)
    assert all(reached[d] != 0 for d in range(kept + 1, 7)) and all(accepted[d] <= 0 for d in range(kept + 1, 7))
    kept, reached, accepted, _ = change(match=True, tested=False)
    assert all(reached[d] != 0 for d in range(kept + 1, 7)) and all(accepted[d] <= 0 for d in range(kept + 1, 7))
