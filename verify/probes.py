"""What the speculation controller's probes cost, and the credit they are paid from.

A probe asks a proposer that is off (its steps planned plain) whether drafting pays again:
two drafted steps. What it costs: its catching up (the positions the proposer has not fed,
at the measured price), what its two steps lose against plain steps beyond that, and what
it slows the plain steps after it: on this CPU a drafted step leaves the next ~20 plain
steps a few percent slower (likely what the drafter's forward took of the caches), a
cost as large as the rest for a probe that nearly pays. Every plain step adds
``PROBE_BUDGET`` of its seconds to a credit; a probe waits until the credit covers what the
last probes lost beyond their catching up (the median); what it loses comes off the credit,
what it wins goes on it. Its catching up comes off too, unless what its second step won (no
catching up in it), per token, repays it over the tokens left in its request (drafting on
would not feed those positions again). The credit never funds a probe below zero, so
probes lose at most ``PROBE_BUDGET`` of the plain steps' time plus one probe, however dear
a catching up is; saving the credit for a long prompt's catching up *before* a probe (as it
once did) kept a drafter that pays off for the whole of a domain of long prompts.
"""

from __future__ import annotations

import statistics
from collections import deque

PROBE_BUDGET = 0.01  # the share of the plain steps' time that probes may lose, over what they win back
PROBE_LOSS_CAP = 2.0  # plain steps one probe's loss beyond its catching up counts for at most (a pause inside it is not a cost)
PROBE_HISTORY = 5  # the probes whose median loss prices the next one
AFTERMATH = 20  # the plain steps after a probe whose excess over a plain step's cost is charged to it


class ProbeLedger:
    """The probes' credit and losses for one controller (see the module docstring); times in seconds."""

    def __init__(self) -> None:
        self.credit = 0.0  # seconds probes may still lose: PROBE_BUDGET of every plain step, less what probes lost
        self.loss: float | None = None  # what a probe loses beyond its catching up (median; None: unknown)
        self._losses: deque[float] = deque(maxlen=PROBE_HISTORY)  # the last probes' losses, each capped
        self._probe = (0.0, 0, 0.0, 0)  # the probe under way: (its catching up as priced, tokens, seconds, room at its start)
        self._last: tuple[int, float] | None = None  # its last step's (tokens, seconds), until it is settled
        self._after: list[float] | None = None  # after a probe: [plain steps seen, their excess seconds, a plain step then]

    def accrue(self, plain: float | None) -> None:
        """A plain step was planned: it adds its share to the credit."""
        if plain is not None:
            self.credit += PROBE_BUDGET * plain

    def due(self) -> bool:
        """Whether the credit covers what the last probes lost beyond their catching up (its cost comes off after)."""
        return self.credit >= max(self.loss or 0.0, 0.0)

    def begin(self, catch_up: float, room: int) -> None:
        """A probe starts, its catching up priced at ``catch_up`` seconds, with ``room`` tokens left in its request."""
        self._settle_aftermath()
        self._probe, self._last = (catch_up, 0, 0.0, room), None

    def step(self, tokens: int, seconds: float, plain: float | None, last: bool) -> None:
        """Count a probe's step (``tokens`` committed in ``seconds``); after its ``last``, settle what the pair lost.

        A pause of the machine inside a probe (tens of ms) is not what drafting costs: one
        probe's loss counts for at most ``PROBE_LOSS_CAP`` plain steps, and the next probe is
        priced at the median of the last few, so neither a pause nor a run of them holds
        probing back for thousands of steps. A proposer that truly loses more is still asked
        at most about ``PROBE_BUDGET`` of the time.

        Its catching up is charged unless what its second step won (it feeds nothing the plain
        steps committed), per token, repays it over the tokens left in the request: drafting
        on would not feed those positions again. Then the probe counts as that step's win. The
        second step judges, not the pair less the catching up as priced: a price above the
        truth (a line through small catch-ups, carried to a whole prompt) would have
        forgiven a probe of a drafter that wins nothing.
        """
        priced, before, spent, room = self._probe
        self._probe, self._last = (priced, before + tokens, spent + seconds, room), (tokens, seconds)
        if last and plain is not None:
            self._settle(plain)

    def cut(self, plain: float | None) -> None:
        """The probe under way was cut short by its request's end: settle it on the step it took."""
        if self._last is not None and plain is not None:
            self._settle(plain)

    def _settle(self, plain: float) -> None:
        priced, total, spent, room = self._probe
        tokens, seconds = self._last
        self._last = None
        won = tokens * plain - seconds  # the last step's win: no catching up in a probe's second step
        beyond = min(spent - total * plain - priced, PROBE_LOSS_CAP * plain)
        lost = -won if won > 0 and won / tokens * (room - total) >= priced else priced + beyond
        self.credit = min(self.credit - lost, max(lost, plain))  # a win buys the next probe, not a hoard
        self._losses.append(beyond)
        self.loss = statistics.median(self._losses)
        self._after = [0, 0.0, plain]

    def plain_step(self, seconds: float) -> None:
        """A plain step took ``seconds`` (pause-bounded): within ``AFTERMATH`` of a probe, its excess is the probe's."""
        after = self._after
        if after is not None:
            after[0] += 1
            after[1] += seconds - after[2]
            if after[0] >= AFTERMATH:
                self._settle_aftermath()

    def drafted_step(self) -> None:
        """A drafted step ends a probe's aftermath: the plain steps after it are its own."""
        self._settle_aftermath()

    def _settle_aftermath(self) -> None:
        """Charge the last probe what the plain steps after it lost (or won: faster steps count too, so noise averages out).

        A probe's loss beyond its catching up, its steps' and its aftermath's together, still
        counts for at most ``PROBE_LOSS_CAP`` plain steps (a pause among those plain steps is
        not a cost either).
        """
        if self._after is None:
            return
        _, excess, plain = self._after
        self._after = None
        before = self._losses[-1]
        after = max(min(before + excess, PROBE_LOSS_CAP * plain), before - PROBE_LOSS_CAP * plain)
        self.credit = min(self.credit - (after - before), max(self.credit, plain))
        self._losses[-1] = after
        self.loss = statistics.median(self._losses)
