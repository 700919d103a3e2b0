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

A request is new text: a probe may also open one, whatever the credit holds, where what the
drafter's recent requests won promises twice what the probe risks (``opens``). Such a probe
is not charged to the credit; each one that loses makes the next less likely. Without it, the
debt of one losing probe of a long prompt held a drafter plain over the short predictable
requests after it for as long as the credit took to win that back.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

PROBE_BUDGET = 0.01  # the share of the plain steps' time that probes may lose, over what they win back
PROBE_LOSS_CAP = 2.0  # steps (a plain one and its drafting as priced) one probe's loss beyond its catching up counts for at most
PROBE_HISTORY = 5  # the probes whose median loss prices the next one
AFTERMATH = 20  # the plain steps after a probe whose excess over a plain step's cost is charged to it
OPEN_K = 2.0  # an opening probe must promise this many times what it risks (a request is one sample of its text)
SUITED_WEIGHT = 0.3  # how far one request that drafted moves the chance that a request suits the drafter
SUITED_PRIOR = (0.25, 0.5)  # (requests suited, requests) the chance starts from, and never forgets
SUITED_MARGIN = 0.05  # a request suited its drafter if drafting won at least this share of its tokens' plain steps


class ProbeLedger:
    """The probes' credit and losses for one controller (see the module docstring); times in seconds."""

    def __init__(self) -> None:
        self.credit = 0.0  # seconds probes may still lose: PROBE_BUDGET of every plain step, less what probes lost
        self.loss: float | None = None  # what a probe loses beyond its catching up (median; None: unknown)
        self._losses: deque[float] = deque(maxlen=PROBE_HISTORY)  # the last probes' losses, each capped
        self._probe = (0.0, 0, 0.0, 0)  # the probe under way: (its catching up as priced, tokens, seconds, room at its start)
        self._drafting = 0.0  # one of its steps' drafting as priced (seconds): with a plain step, the cap's unit (``_cap``)
        self._opening = False  # whether it (or the last, until its aftermath is settled) opened a request (``opens``)
        self._last: tuple[int, float] | None = None  # its last step's (tokens, seconds), until it is settled
        self._after: list[float] | None = None  # after a probe: [plain steps seen, their excess seconds, a plain step then]
        self.gain: float | None = None  # seconds a request that suited the drafter won per token, drafting steadily (running average)
        self.suited = [0.0, 0.0]  # requests that drafted and whose drafting won, and requests that drafted (decayed)
        self._request = [0, 0.0, 0.0, 0]  # this request's drafted steps, what they won (seconds), that of the steady ones, its tokens

    def accrue(self, plain: float | None) -> None:
        """A plain step was planned: it adds its share to the credit."""
        if plain is not None:
            self.credit += PROBE_BUDGET * plain

    def _shortfall(self) -> float:
        """What the credit lacks to cover what the last probes lost beyond their catching up (<= 0: a probe is due)."""
        return max(self.loss or 0.0, 0.0) - self.credit

    def due(self) -> bool:
        """Whether the credit covers what the last probes lost beyond their catching up (its cost comes off after)."""
        return self._shortfall() <= 0.0

    def plain_steps_before_due(self, plain: float | None) -> float:
        """How many more plain steps (at ``plain`` seconds each) leave the credit short of ``due``, and its loss as it is:
        none beyond the one whose observation settles a probe's aftermath (it moves both). Inf: nothing moves them."""
        accrued = math.ceil(self._shortfall() / (PROBE_BUDGET * plain)) - 1 if plain else math.inf
        return min(accrued, AFTERMATH - 1 - self._after[0]) if self._after is not None else accrued

    def opens(self, catch_up: float, room: int, plain: float | None) -> bool:
        """Whether a probe at a request's start repays OPEN_K times its risk: ``q * gain * room > OPEN_K * (catch_up + (1 - q) * loss)``.

        A new request is new text: what the drafter did on the last ones is evidence about it, not
        its acceptance. ``q`` is the share of the recent requests that drafted whose drafting won
        ``SUITED_MARGIN`` of their plain time (``SUITED_PRIOR`` keeps it above ~0.07), ``gain``
        what such a request's steady drafted
        steps (no catching up in them) won per token of it, ``room`` the tokens left: the probe
        wins that much if the text suits the drafter, costs its catching up whatever, and its
        loss (the last probes' median; a plain step while unknown) if not. A drafter that never
        won a request has no gain to promise; one that loses the probes of a kind of text soon
        has a ``q`` too small for that text's catching up.
        """
        if not self.gain or plain is None:
            return False
        q = self.chance()
        return q * self.gain * room > OPEN_K * (catch_up + (1.0 - q) * max(self.loss if self.loss is not None else plain, 0.0))

    def chance(self) -> float:
        """``q``: the share of the recent requests that drafted whose drafting won ``SUITED_MARGIN`` of their time, with the prior."""
        (won, drafted), (prior_won, prior) = self.suited, SUITED_PRIOR
        return (won + prior_won) / (drafted + prior)

    def drafted(self, tokens: int, seconds: float, plain: float | None, steady: bool, probe: float | None, last: bool) -> None:
        """A drafted step committed ``tokens`` in ``seconds`` (a pause bounded); ``steady``: it caught nothing up.

        ``probe``: the seconds of a probe's step (None: no probe), and ``last`` whether it is the probe's last.
        """
        if plain is not None:
            request, win = self._request, tokens * plain - seconds
            request[:] = request[0] + 1, request[1] + win, request[2] + steady * win, request[3] + tokens
        if probe is not None:
            self.step(tokens, probe, plain, last)
        else:
            self._settle_aftermath()  # a drafted step ends a probe's aftermath: the plain steps after it are its own

    def request_end(self, plain: float | None) -> None:
        """A request ended: if it drafted (two steps or more: a probe), whether its drafting won moves ``q``, and what it won ``gain``.

        It suited the drafter if drafting won ``SUITED_MARGIN`` of its plain time or more: a
        request that won by the machine's noise, counted, would have a drafter that barely pays
        opening one request after another (the medians of the demo's rows planned plain 90% of
        the time fell from 0.98 to 0.96-0.97x plain), and the gain of such requests alone would
        be the noise's best draws.
        """
        steps, won, steady, tokens = self._request
        if steps >= 2 and plain is not None:
            keep, suits = 1.0 - SUITED_WEIGHT, won >= SUITED_MARGIN * tokens * plain
            self.suited = [keep * self.suited[0] + suits, keep * self.suited[1] + 1.0]
            if suits:
                gain = steady / tokens
                self.gain = gain if self.gain is None else keep * self.gain + SUITED_WEIGHT * gain
        self._request = [0, 0.0, 0.0, 0]

    def begin(self, catch_up: float, room: int, opening: bool = False, drafting: float = 0.0) -> None:
        """A probe starts, its catching up priced at ``catch_up`` seconds, with ``room`` tokens left in its request.

        ``drafting``: what the estimates price one of its steps' drafting at (seconds).
        """
        self._settle_aftermath()
        self._probe, self._last, self._opening, self._drafting = (catch_up, 0, 0.0, room), None, opening, drafting

    def step(self, tokens: int, seconds: float, plain: float | None, last: bool) -> None:
        """Count a probe's step (``tokens`` committed in ``seconds``); after its ``last``, settle what the pair lost.

        A pause of the machine inside a probe (tens of ms) is not what drafting costs: one
        probe's loss counts for at most ``PROBE_LOSS_CAP`` steps, and the next probe is
        priced at the median of the last few, so neither a pause nor a run of them holds
        probing back for thousands of steps. The cap's step is a plain one with the probe's
        drafting as priced: a drafter whose draft costs 1.5 plain steps loses some 4 plain
        steps a probe (its aftermath included), and a cap of 2 plain steps had it probed
        twice as often as the budget pays for (2.0% of the time lost where drafting never
        pays, in simulation; 1.5% for a draft of 0.75 plain steps, as the demo's DFlash is
        priced). A proposer that truly loses more is still asked at most about
        ``PROBE_BUDGET`` of the time.

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
        beyond = min(spent - total * plain - priced, self._cap(plain))
        lost = -won if won > 0 and won / tokens * (room - total) >= priced else priced + beyond
        if not self._opening:  # an opening probe paid its way by its own chances (``opens``), not from the credit
            self.credit = min(self.credit - lost, max(lost, plain))  # a win buys the next probe, not a hoard
        self._losses.append(beyond)
        self.loss = statistics.median(self._losses)
        self._after = [0, 0.0, plain]

    def _cap(self, plain: float) -> float:
        """What the last probe's loss beyond its catching up counts for at most, its aftermath included (``step``).

        ``begin`` settles an aftermath before it sets the next probe's drafting, so this is the
        probe's own until then.
        """
        return PROBE_LOSS_CAP * (plain + self._drafting)

    def plain_step(self, seconds: float) -> None:
        """A plain step took ``seconds`` (pause-bounded): within ``AFTERMATH`` of a probe, its excess is the probe's."""
        self._request[3] += 1
        after = self._after
        if after is not None:
            after[0] += 1
            after[1] += seconds - after[2]
            if after[0] >= AFTERMATH:
                self._settle_aftermath()

    def _settle_aftermath(self) -> None:
        """Charge the last probe what the plain steps after it lost (or won: faster steps count too, so noise averages out).

        A probe's loss beyond its catching up, its steps' and its aftermath's together, still
        counts for at most the cap (``_cap``; a pause among those plain steps is not a cost either).
        """
        if self._after is None:
            return
        _, excess, plain = self._after
        self._after = None
        before = self._losses[-1]
        after = max(min(before + excess, self._cap(plain)), before - PROBE_LOSS_CAP * plain)
        if not self._opening:
            self.credit = min(self.credit - (after - before), max(self.credit, plain))
        self._losses[-1] = after
        self.loss = statistics.median(self._losses)
