"""How the speculation controller learns from the steps it observed: in one pass, after them, in warm caches.

``verify.controller.Controller`` keeps a drafted step's outcome (a few Python lists) until
its estimates are next recomputed, and the plain steps a plain decision held until the hold
ends; then it learns from them here, in order, as it would have one step at a time. Between
two target forwards the Python runs in caches the forward has just emptied, at about twice
its cost in a pass over several steps.
"""

from __future__ import annotations

import math

from .calibration import cut_children
from .estimates import average, first_children_chain
from .probes import AFTERMATH

PLAIN_DRIFT = 0.02  # how far (relative) a plain step's cost moves before the estimates are recomputed for it, at least
PAUSE_BOUND = 2.0  # a step's rest beyond this many plain steps per verified row is counted as this many (a pause, not a cost)
COLD_STEPS = 2  # a request's first steps run in its prefill's aftermath (on this CPU ~22% and ~7% dearer): they price nothing
COLD_ROOM = 16  # ... in a request with this many depths of room at its first plan (in a shorter one they are its typical steps)


class StepLearning:
    """The learning half of ``Controller`` (its state is the controller's: see its ``__init__``)."""

    def _observe_plain(self, seconds: float, tokens: int, cold: bool = False) -> None:
        """Learn from a plain step that took ``seconds`` (the plan's recomputation left out) and committed ``tokens``.

        A ``cold`` step (one of a long request's first ``COLD_STEPS``) pays for the prefill
        before it, as a drafted step there would: not a plain step's price, nor a change of
        speed. Only where no price is known does it set one, provisionally: the first plain
        step out of a prefill's aftermath replaces it (``_explore`` plans one there).
        """
        speed, plain = self.speed.factor, self.plain_seconds
        rest = max(seconds / speed, 1e-6)  # at the speed the costs were learnt at
        if cold and plain is not None:
            if self.missed is not None:
                self.missed += tokens
            self.probes.plain_step(plain)  # no excess for a probe's aftermath either
            return
        if plain is not None:
            if self.missed is None or self.missed >= AFTERMATH:  # what a draft slows after it is drafting's cost
                self.speed.update(rest * speed, plain)
            rest = min(rest, PAUSE_BOUND * plain)  # a pause of the machine is not a cost
        self.plain_seconds, self._stop = average(None if self.provisional else plain, rest), None
        if self._estimates is not None and (  # the estimates follow a plain step's cost only when it has moved
            not self._estimated_plain or abs(math.log(self.plain_seconds / self._estimated_plain)) > max(PLAIN_DRIFT, self._headroom)
        ):
            self._estimates = None
        if self.missed is not None:
            self.missed += tokens
        self.probes.plain_step(rest)
        self.provisional = cold
        if not cold:
            self.since_plain = 0

    def _learn_held(self) -> None:
        """Learn from the steps a plain decision held, in order, as their plans and ``observe`` would have one by one.

        One pass after the hold runs in warm caches; a plan and an observation between every two
        target forwards ran in cold ones (some 15 us a plain step, a percent of the demo target's step).
        """
        steps, self._held_steps = self._held_steps, []
        for seconds, tokens, cold in steps:
            self.plain_steps, self.plain_run = self.plain_steps + 1, self.plain_run + 1
            self.probes.accrue(self.plain_seconds)
            self._observe_plain(seconds, tokens, cold)

    def _learn_pending(self) -> None:
        """Learn from the drafted steps observed since the last time, in order: their costs, depths and calibration.

        A drafted step's outcome is kept (a few Python lists) and learnt from when the estimates
        are next recomputed (every ``REFRESH_EVERY`` drafted steps, and sooner: ``observe``), since only
        they read what it teaches (the trim's rows curve and calibration lag by as many steps).
        One pass over eight steps runs in warm caches; eight passes, one after each target
        forward, ran in cold ones at about twice the cost.
        """
        pending, self._pending, self._stop = self._pending, [], None  # the rows curve moves
        for plan, parents, depths, scores, source, accepted, missed, draft_seconds, rest, plain, now, greedy, calibrate, cut in pending:
            shape = self.shapes[plan.shape]
            if missed <= 1:  # steady state (one plain step's token is fed as a drafted step's bonus token is)
                self.draft_scale = shape.learn_draft_cost(plan.depth, draft_seconds, self.draft_scale)
            elif shape.draft_base[plan.depth] is not None:  # a catch-up: what it cost beyond the drafting
                self.catch_up.update(float(missed), max(draft_seconds - shape.draft_base[plan.depth] * self.draft_scale, 0.0))
            if plain is not None:  # what the step added beyond a plain step: its depth's cost, and its size's on the rows curve
                shape.learn_verify_cost(plan.depth, rest - plain, plain)
                if depths:
                    self.rows.update(len(depths), rest - plain)
            if calibrate and cut is not None:  # what the trim cut below the path's end, tested by the next token
                self.calibration.count(source, cut_children(*cut, accepted))
            # what the step verified and accepted, trim and stop included: the plan prices what a step planned there delivers
            shape.learn_depths(plan.depth, depths, len(accepted), self.decay, now)
            if shape is not self.shapes[0]:  # a tree holds the chain of first children: what that chain would have accepted
                length, reach = first_children_chain(parents, accepted)  # to the depth it held (a trim may cut it short) ...
                told = plan.depth if reach < length else min(length, plan.depth)  # ... and below, where the path left it: a miss
                self.shapes[0].learn_depths(told, list(range(1, min(length, told) + 1)), reach, self.decay, now)
            if calibrate:
                self.calibration.learn(parents, scores, depths, source, accepted, greedy)
