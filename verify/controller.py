"""The speculation controller: how much to draft each step, from costs and acceptance it measures on this machine.

A draft pays when the tokens it is expected to add outrun what it costs: the drafting,
and the extra rows of the target's forward. Both sides depend on the machine (a verified
row is nearly free on a GPU; on this CPU the first costs a fifth of a step and the
sixteenth a thirtieth), on the proposer and on the text, so the controller measures them
itself while it decodes and decides per step:

0. plan (before the proposer drafts, from the past only): the depth to draft, 0 being a
   plain step, and the shape: a chain, or the proposer's own tree where it drafts trees
   (``Proposer.draft_width`` > 1; ``ProposeContext.max_width`` tells it). For each shape
   and depth D it expects ``1 + sum_{d <= D} u_d`` tokens, u_d the recent share of that
   shape's steps planned at least d deep whose verified path reached depth d (a depth their trim
   or stop left out counts as not reached: the plan prices what its steps deliver), against the
   seconds its steps planned at D took (drafting, and the rest of the step: the target's
   forward of their rows, the sampler, the commit), measured per depth and carried to the
   depths not yet measured by what their rows add and the cost of a level (``verify.estimates``);
   the best rate wins, plain decoding (one token per plain step) included.
1. trim (after, with the draft's own values): each node's chance to be accepted is its
   calibrated confidence (``Draft.scores``, binned per source and depth, learned from
   every verification) times its parent's; the nodes are kept best first as far as the best
   rate of tokens per second reaches, k nodes costing what k nodes add on the rows curve, the
   step's drafting (as priced) spent. Only where it keeps the target's law exactly: at
   temperature 0, or for deterministic drafts (point masses, whose verification is exact
   however they were chosen). A sampled tree is never cut by its own drawn values. The step's
   next token tests what a trim cut below the accepted path's end (``cut_children``): the
   calibration counts it. While drafting, a proposer of such drafts may leave unexpanded a
   node the trim would cut, and a depth that cannot pay its drafting (``stop_rule``).
2. observe: the step's seconds update the running costs of its planned depth (or of a
   plain step) and what its rows added beyond a plain step (``RowsCurve``: an average per
   size of draft, joined into a non-decreasing curve); the outcome updates u_d, the rows
   per depth and the calibration bins (in one pass when the estimates are next recomputed:
   every ``REFRESH_EVERY`` drafted steps, and at once after a probe or a surprising step;
   ``verify.learning``). A plain decision holds the next ``HOLD`` plain steps (fewer where a
   probe could come due): they are not planned, and are learnt from in one pass after.
   The averages follow the context as it grows. A pause of the machine is not a cost: what one
   step or one probe may count of it is bounded (``PAUSE_BOUND``; ``verify.probes``), so probes
   of a drafter that is off follow each other at most some 400 plain steps apart whatever the
   pauses. Costs are learnt at one speed of the machine (``MachineSpeed``); a plain step's
   price leaves out the estimates recomputed in its plan, and no price comes from a long
   request's first two steps (its prefill's aftermath: ``COLD_STEPS``).

A proposer that stopped paying is asked again now and then (a probe: two drafted steps in a
row, as often as a credit of 1% of the plain steps' time covers what probes lose, so they
follow each other quickly when they win; a new request may open with one:
``verify.probes``), and one that pays is now and then tried one depth deeper or in its
other shape, so the controller follows the text. A draft after plain steps first feeds the
proposer what they committed: that catching up is priced (a robust line in the positions)
and must pay back over the request's rest (a probe's is charged after it, unless what it won
repays it); after ``PROBE_CEILING`` plain steps in a row a probe comes whatever the credit
holds. Its state lives across requests, the acceptance side forgetting old steps (~20).

Exactness: the plan uses committed outcomes and timings only, and a trim only where any choice
of nodes is exact: greedy output is token-identical to plain decoding, sampled keeps its law.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from dataclasses import dataclass

from draftsmith.proposers.core.tree import keep_nodes
from draftsmith.proposers.core.types import Draft, StopRule, VerifyResult

from .calibration import CONFIDENCE_EDGES, DEPTH_BUCKETS, SLOTS, Calibration
from .estimates import MachineSpeed, RobustLine, RowsCurve, ShapeEstimates
from .learning import COLD_ROOM, COLD_STEPS, PAUSE_BOUND, StepLearning
from .probes import ProbeLedger

DEFAULT_DEPTH = 8  # planned depths for a proposer that states no limit
REFRESH_EVERY = 8  # drafted steps between recomputations of the plan's estimates (they move slowly)
SURPRISE = 3.0  # a drafted step dearer than this many times its estimate has the estimates recomputed at once
PLAIN_EVERY = 64  # drafted steps between plain steps that keep the plain cost measured (the first step past the cold ones is one)
HOLD = 8  # plain steps a plain decision holds without planning, learnt from in one pass after (fewer where a probe may come)
PROBE_CEILING = 1000  # plain steps in a row after which a proposer is probed whatever its estimated catching up costs
MARGIN = 0.05  # drafting must promise this much more than plain decoding: a tie is noise, and drafting's variance is not free


@dataclass(frozen=True)
class Plan:
    """One step's plan: the depth to draft (0: a plain step), the shape, and whether it probes what the estimates do not favour.

    ``shape``: the index of the draft shape (``Controller.shapes``); ``width`` its most
    children per node (1: a chain; None: as the proposer drafts). ``whole``: verify the
    whole draft, untrimmed, so that the calibration sees what a trim hides.
    """

    depth: int
    probe: bool = False
    whole: bool = False
    shape: int = 0
    width: int | None = None

    @property
    def trims(self) -> bool:
        """Whether the draft is trimmed before it is verified: not for a probe, which is there to see what a trim would hide."""
        return not (self.probe or self.whole)


class Controller(StepLearning):
    """Plans, trims and learns for one decoder's proposer (see the module docstring).

    Args:
        max_depth: the deepest the proposer drafts (``Proposer.draft_depth``; None: ``DEFAULT_DEPTH``).
        max_width: the most children it gives a node (``Proposer.draft_width``); above 1 a
            chain is one more shape to choose from, next to the proposer's tree.
        decay: how much the acceptance side forgets per drafted step (0.95: a window of ~20 steps; a
            shorter one dips below the bar by chance, and a drafter that is off is asked again by probes only).
        probe_every: the fewest plain steps between probes (what they may lose sets the rest: ``verify.probes``).
        explore_every: drafted steps between probes of the planned depth's neighbourhood (one depth deeper, or the
            other shape, the whole draft verified: the calibration sees what a trim hides; 16 ran 0.6% slower on the demo's heads).
    """

    PLAIN = Plan(0)  # a plain step's plan, one instance
    HELD = Plan(0)  # a plain step's planned by the hold of the one before: equal to ``PLAIN``, told apart by identity

    def __init__(self, max_depth: int | None, max_width: int = 1, decay: float = 0.95, probe_every: int = 4, explore_every: int = 32):
        self.max_depth = max_depth or DEFAULT_DEPTH
        self.decay, self.probe_every, self.explore_every = decay, probe_every, explore_every
        # a proposer that drafts trees may also draft a chain: the shapes to choose from, the chain first
        self.shapes = (
            [ShapeEstimates(1, self.max_depth), ShapeEstimates(None, self.max_depth)]
            if max_width > 1
            else [ShapeEstimates(None, self.max_depth)]
        )
        self.plain_seconds: float | None = None  # a plain step, running average (every cost at the learnt speed: ``speed``)
        self.speed, self._refreshed = MachineSpeed(), 0.0  # how slow the machine runs now; this step's recomputation (``plan``)
        self.draft_scale = 1.0  # what every shape's and depth's drafting cost is multiplied by (``learn_draft_cost``)
        self.rows = RowsCurve()  # what a drafted step's verifying adds to a plain step's cost, against the nodes verified
        self.calibration = Calibration()  # per source, depth and confidence: a node's chance (``verify.calibration``)
        self.plain_run, self.drafted_steps, self.probe_pending = 0, 0, False
        self.probes = ProbeLedger()  # what probes may lose, and what they lost
        self.since_plain = PLAIN_EVERY  # drafted steps since the last plain step: the first step is a plain one
        self.missed: int | None = None  # positions committed by plain steps since the last draft (None: the whole context)
        self.catch_up = RobustLine()  # what a draft costs beyond its drafting against the positions it catches up
        self.plain_steps = 0  # steps planned plain, over the controller's life
        self.seconds = 0.0  # the controller's own work
        self._estimates: list[tuple[list[float], list[float | None]]] | None = None  # per shape (shares, plan costs), now and then
        self._decisions: dict[int, tuple[int, int, int]] = {}  # room -> (plan depth, shape, best drafting depth), with the estimates
        self._planned, self._draft_prices = self.PLAIN, []  # the last plan; per shape, each depth's drafting price, with the estimates
        self.observed = 0  # drafted steps observed
        self._pending: list[tuple] = []  # drafted steps observed and not learnt from yet (``_learn_pending``)
        self._estimated_plain = 0.0  # the plain step's cost the estimates were computed with
        self._stop: dict[int, StopRule] | None = None  # ``stop_rule``'s per shape, until a plain step's cost or the rows curve moves
        self._cut: tuple[Draft, Draft, list[int]] | None = None  # the last trim's (trimmed, whole draft, kept nodes) where it cut
        self._plans: dict[tuple[int, int, bool, bool], Plan] = {}  # (depth, shape, probe, whole) -> its plan (``_plan``)
        self._headroom = float("inf")  # how far (log) that cost may move before a plain decision of theirs could turn (``_decide``)
        self._held, self._held_steps = 0, []  # plain steps the last plain decision still holds; the held ones' (seconds, tokens, cold)
        self.cold: int | None = 0  # this request's steps in its prefill's aftermath (None: its first plan decides)
        self.provisional = False  # whether the plain step's price is a cold step's (the first warm one replaces it)

    # -- costs ---------------------------------------------------------------------------

    def start(self) -> None:
        """A new request: its proposer has fed none of its context yet (the first draft catches up the prompt).

        A probe cut short by the last request's end is settled on its first step (a second would catch up a new prompt).
        """
        self._learn_held()  # the last request's steps
        self.missed, self._held, self.cold = None, 0, None
        self.probes.request_end(self.plain_seconds)
        if self.probe_pending:
            self.probe_pending, self._estimates = False, None
            self.probes.cut(self.plain_seconds)

    # -- 0. plan -------------------------------------------------------------------------

    def plan(self, context: int, room: int) -> Plan:
        """The depth and shape to draft with ``room`` depths left (depth 0: a plain step); ``context`` is the committed length."""
        tick = time.perf_counter()
        if self._held:  # a plain decision holds: its steps are learnt from when it ends (``_learn_held``)
            self._held -= 1
            self.seconds += time.perf_counter() - tick
            return self.HELD
        if self._held_steps:
            self._learn_held()
        if self.cold is None:  # a long request's first steps price nothing; a short one's are its typical steps
            self.cold = COLD_STEPS if room >= COLD_ROOM else 0
        deepest, self._refreshed = min(self.max_depth, room), 0.0
        if self._estimates is None:
            if self._pending:
                self._learn_pending()
            prices = self._draft_prices = [shape.draft_costs(self.draft_scale) for shape in self.shapes]  # read by the trim too
            now, plain = self.drafted_steps, self.plain_seconds
            self._estimates = [shape.estimate(now, plain, self.rows, prices[i]) for i, shape in enumerate(self.shapes)]
            self._estimated_plain = self.plain_seconds or 0.0
            self._decisions, self._headroom = {}, float("inf")
            self._refreshed = time.perf_counter() - tick
        decision = self._decisions.get(deepest)
        if decision is None:
            decision = self._decisions[deepest] = self._decide(deepest)
        depth, shape, drafting = decision
        positions = context if self.missed is None else self.missed  # what the next draft feeds first
        if depth:
            catch_up = self._catch_up_cost(positions)
            if catch_up and not self._pays_back(shape, depth, catch_up, room):
                depth = 0
        plan = self._planned = self._explore(depth, shape, drafting, deepest, positions, room)
        if plan.depth:
            self.shapes[plan.shape].planned[plan.depth] += 1
        else:
            self.plain_steps += 1
        self.seconds += time.perf_counter() - tick
        return plan

    def _catch_up_cost(self, positions: int) -> float:
        """Seconds a draft costs beyond its drafting when it first feeds ``positions`` positions plain steps committed."""
        if positions <= 1 or not self.catch_up.count:
            return 0.0
        fixed, per_position = self.catch_up.line()
        return max(fixed, 0.0) + max(per_position, 0.0) * positions

    def _pays_back(self, shape: int, depth: int, catch_up: float, room: int) -> bool:
        """Whether drafting at ``depth`` still beats a plain step by the margin with ``catch_up`` seconds spread over the request's rest."""
        shares, costs = self._estimates[shape]
        expected = 1.0 + sum(shares[1 : depth + 1])
        steps = max(room / expected, 1.0)
        plain, cost = costs[0], costs[depth]
        return plain is None or cost is None or expected * plain > (1.0 + MARGIN) * (cost + catch_up / steps)

    def _best_depth(self, shape: int, deepest: int) -> tuple[int, float]:
        """(the depth of ``shape`` with the best expected tokens per second, that rate: inf where a cost is unknown)."""
        shares, costs = self._estimates[shape]
        expected, best, best_rate = 1.0, 0, 0.0
        for depth in range(1, deepest + 1):
            expected += shares[depth]
            cost = costs[depth]
            rate = expected / cost if cost is not None else float("inf")  # unmeasured: try it
            if rate > best_rate:
                best, best_rate = depth, rate
        return best, best_rate

    def _decide(self, deepest: int) -> tuple[int, int, int]:
        """(the depth to plan, 0 for a plain step; its shape; the best drafting depth of that shape) from the estimates.

        A decision turns when drafting's best rate times a plain step's cost crosses
        ``1 + MARGIN``. A step planned at D costs a plain step plus what D adds, so a plain step
        dearer by a factor f moves that product by about f at most: the decision's distance from
        the bar (in log) is the headroom a plain step's cost may drift before the estimates are
        worth recomputing (most steps are plain ones where drafting does not pay).
        """
        choices = [(*self._best_depth(shape, deepest), shape) for shape in range(len(self.shapes))]
        drafting, rate, shape = max(choices, key=lambda choice: choice[1])  # the first shape (the chain) on a tie
        plain = self.plain_seconds
        if plain is None:
            return drafting, shape, drafting
        if 0 < rate < float("inf"):
            self._headroom = min(self._headroom, abs(math.log(rate * plain / (1.0 + MARGIN))))
        return (drafting if rate * plain > 1.0 + MARGIN else 0), shape, drafting

    def _plan(self, depth: int, shape: int, probe: bool = False, whole: bool = False) -> Plan:
        key = (depth, shape, probe, whole)  # plans are frozen values: one instance of each (a new one a step cost ~2 us)
        if key not in self._plans:
            self._plans[key] = Plan(depth, probe, whole, shape, self.shapes[shape].width)
        return self._plans[key]

    def _explore(self, best: int, shape: int, drafting: int, deepest: int, positions: int = 0, room: int = 0) -> Plan:
        """Probe a proposer that is off, now and then; probe around the planned depth and shape, and measure a plain step, now and then.

        Probes pay for themselves (``verify.probes``): a probe (at least ``probe_every`` plain
        steps after the last) waits until a credit of 1% of the plain steps' seconds covers
        what the last probes lost beyond their catching up (the plain steps they slowed
        included); what it loses (its catching up too, unless its win repays that over the
        request's rest) comes off the credit, what it wins goes on it. A request not drafted
        in yet may open with a probe that its drafter's recent requests pay for (``opens``).
        Exploring a drafting proposer alternates one depth deeper with the other shape's best depth.
        """
        if self.probe_pending:  # a probe is two drafted steps in a row: the second one's drafting is no catch-up, so it is measured
            self.probe_pending = False
            return self._plan(drafting, shape, probe=True)
        if best and self.since_plain >= PLAIN_EVERY and (not self.cold or self.plain_seconds is None):
            return self.PLAIN  # keep the plain cost measured (by a step out of the prefill's aftermath): the first, then now and then
        if best == 0:
            self.plain_run += 1
            self.probes.accrue(self.plain_seconds)
            if drafting and self.plain_run >= self.probe_every:  # the cheap test first: most plain steps end here
                due = self.probes.due() or self.plain_run >= PROBE_CEILING  # the ceiling: whatever the estimates say
                catch_up = self._catch_up_cost(positions) if due or self.missed is None else 0.0  # priced only when read
                opens = not due and self.missed is None and self.probes.opens(catch_up, room, self.plain_seconds)  # new text
                if due or opens:
                    self.plain_run, self.probe_pending = 0, True
                    self.probes.begin(catch_up, room, opens, self._draft_prices[shape][drafting])
                    return self._plan(drafting, shape, probe=True)
            self._held = self._hold(drafting)
            return self.PLAIN
        self.plain_run = 0
        self.drafted_steps += 1
        if self.drafted_steps % self.explore_every:
            return self._plan(best, shape)
        if len(self.shapes) > 1 and self.drafted_steps // self.explore_every % 2:
            return self._plan(self._best_depth(1 - shape, deepest)[0] or best, 1 - shape, probe=True, whole=True)
        return self._plan(min(best + 1, deepest), shape, probe=True, whole=True)

    def _hold(self, drafting: int) -> int:
        """How many plain steps after this plain one may be planned plain without planning (``HOLD`` at most): none could probe.

        A plan looks for a probe from the ``probe_every``-th plain step in a row on: due when the
        credit covers the last probes' loss (held one step short of it, as a plain step's cost
        moves, and not past the plain step that settles a probe's aftermath, which moves both), at
        the ceiling, or opening a request not drafted in yet (once looked at and refused, a
        refusal the request's shrinking room keeps). A plain cost that moves past the decision's
        headroom re-plans at the hold's end (some ``HOLD`` steps late at most).
        """
        if not drafting:
            return HOLD
        first = self.probe_every - self.plain_run  # the first held step whose plan would look for a probe
        if first > 0 and self.missed is None:  # an opening probe not looked at yet
            return min(HOLD, first - 1)
        quiet = min(self.probes.plain_steps_before_due(self.plain_seconds) - 1, PROBE_CEILING - self.plain_run - 1)
        return int(max(min(HOLD, max(first - 1, quiet)), 0))  # before the first look, or while every look finds nothing due

    # -- 1. trim -------------------------------------------------------------------------

    def trim(self, draft: Draft, context: int, exact_any_subset: bool) -> tuple[Draft, list[int] | None]:
        """The nodes of ``draft`` worth verifying, and their indices in ``draft`` (None: all kept).

        Args:
            exact_any_subset: whether any subset closed under ancestors keeps the target's law
                (temperature 0, or a deterministic draft); else the draft is kept whole.
        """
        n, plain = draft.num_nodes, self.plain_seconds
        self._cut = None
        if not n or not exact_any_subset or plain is None or not self.rows.ready:
            return draft, None
        tick = time.perf_counter()
        extra, floor = self.rows.table(n)  # what k nodes add to a step; the least a k-th or later node adds
        scores, source = draft.scores, draft.source or ""
        chances = self.calibration.chances(source)
        value: list[float] = []
        push = value.append
        for parent, depth, score in zip(draft.parent_list, draft.depth_list, [None] * n if scores is None else scores, strict=True):
            index = (depth - 1 if depth < DEPTH_BUCKETS else DEPTH_BUCKETS - 1) * SLOTS  # ``bin_of``, inline: the trim's hot loop
            chance = chances[index if score is None else index + 1 + bisect_right(CONFIDENCE_EDGES, score)]
            push(chance * value[parent] if parent >= 0 else chance)
        order = range(n) if draft.is_chain() else sorted(range(n), key=value.__getitem__, reverse=True)  # best first, stable
        plan = self._planned  # its drafting is spent (as priced): a row pays where it buys more than the step's rate so far
        spent = plain + (self._draft_prices[plan.shape][plan.depth] if plan.depth else 0.0)
        best_k, best_rate, expected = 0, 1.0 / spent, 1.0
        for k, node in enumerate(order, start=1):  # a parent (no less likely, earlier) first; a chain's values never rise
            if value[node] < floor[k] * best_rate:
                break  # its row, and every later one, buys less than the rate so far, and every later node is no likelier
            expected += value[node]
            rate = expected / (spent + extra[k])
            if rate > best_rate:
                best_k, best_rate = k, rate
        kept = None if best_k == n else sorted(order[:best_k])
        trimmed = draft if kept is None else keep_nodes(draft, kept)
        if kept is not None:  # the nodes cut are tested for free against the step's next token (``cut_children``)
            self._cut = (trimmed, draft, kept)
        self.seconds += time.perf_counter() - tick  # building the trimmed draft included
        return trimmed, kept

    def stop_rule(self) -> StopRule | None:
        """What a drafter needs to stop a path the trim would cut, or a depth whose drafting cannot pay (``StopRule``; None
        until the trim trims). A node worth less than the least any node adds (the rows curve's least margin) at a plain
        step's rate is below every ``floor[k] * best_rate`` the trim compares it with (a hair of slack keeps rounding on
        the trim's side); a depth's forward costs that margin and a level of the planned shape's drafting
        (``ShapeEstimates.level_cost``). For drafts of the proposer's own source ("").
        """
        plain, shape = self.plain_seconds, self._planned.shape
        if plain is None or not self.rows.ready:
            return None
        self._stop = self._stop or {}  # per shape, until a plain step's cost or the rows curve moves (the chances it reads live)
        if shape in self._stop:
            return self._stop[shape]
        tick = time.perf_counter()  # the controller's own work (its values, computed while drafting, are the drafter's)
        least, level, slack = self.rows.least_margin(), self.shapes[shape].level_cost(self.draft_scale), (1.0 - 1e-9) / plain
        rule = self._stop[shape] = self.calibration.stop_rule(slack * least, slack * (least + level))
        self.seconds += time.perf_counter() - tick
        return rule

    # -- 2. observe ----------------------------------------------------------------------

    def observe(self, plan: Plan, draft: Draft, result: VerifyResult, context: int, draft_seconds: float, step_seconds: float,
                greedy: bool) -> None:  # fmt: skip
        """Learn from one step: its costs, and (when it drafted) which nodes were tested and accepted.

        Args:
            draft: the draft as verified (after ``trim``); ``result`` its verification.
            context: the committed positions when the step was planned.
            draft_seconds: the proposer's time this step; step_seconds: the whole step's.
            greedy: temperature 0 (every child of an accepted node was tested at once); at
                temperature > 0 the children of a node are tested in order up to the accepted one.
        """
        tick = time.perf_counter()
        cold, self.cold = bool(self.cold), max((self.cold or 0) - 1, 0)  # the prefill's aftermath: its costs teach nothing
        if plan.depth == 0:  # recomputing the estimates after drafted steps is drafting's work, not a plain step's
            tokens = len(result.accepted_tokens) + 1  # the step's committed tokens (no list built)
            if plan is self.HELD:  # learnt from with the hold's other steps, in order (``_learn_held``)
                self._held_steps.append((step_seconds - draft_seconds, tokens, cold))
            else:
                self._observe_plain(step_seconds - self._refreshed - draft_seconds, tokens, cold)
            self.seconds += time.perf_counter() - tick
            return
        speed, plain = self.speed.factor, self.plain_seconds
        step_seconds, draft_seconds = step_seconds / speed, draft_seconds / speed  # at the speed the costs were learnt at
        rest = max(step_seconds - draft_seconds, 1e-6)
        if plain is not None:  # a pause of the machine is not a cost: n + 1 rows take at most n + 1 plain steps
            nodes = draft.num_nodes  # what its rows add, as learnt (the rows curve's table: an empty draft's step is a plain one)
            rows = 0.0 if not nodes else self.rows.table(nodes)[0][nodes] if self.rows.points() else None  # none add nothing
            self.speed.update(rest * speed, None if rows is None or cold else plain + rows)
            rest, plain = min(rest, PAUSE_BOUND * plain * (nodes + 1)), None if cold else plain  # a cold step prices no rows
        self.observed += 1
        self.since_plain += 1
        missed, self.missed = (context if self.missed is None else self.missed), 0
        calibrate = bool(self.observed % 2 or plan.probe)  # half the steps calibrate (and every probe): a bin moves slowly
        cut, self._cut = self._cut, None  # the trim's, where it cut this very draft; the next token tests what it cut
        cut = (cut[1], cut[2], result.next_token) if cut is not None and cut[0] is draft and (greedy or not result.recovered) else None
        self._pending.append((plan, draft.parent_list, draft.depth_list, draft.scores, draft.source or "", result.accepted_nodes,
                              missed, draft_seconds, rest, plain, self.drafted_steps, greedy, calibrate, cut))  # fmt: skip
        every = REFRESH_EVERY if self.observed > 2 * REFRESH_EVERY else 2  # often while the estimates are young
        priced = self._estimates[plan.shape][1][plan.depth] if self._estimates is not None else None
        dear = priced is not None and step_seconds > SURPRISE * priced
        paired = plan.probe and not plan.whole  # a probe of a proposer that is off (an exploring step waits its turn)
        if self.observed % every == 0 or (paired and not self.probe_pending) or dear:
            self._estimates = None  # the next plan learns the pending steps first (after a probe: whether it is back)
        probe = step_seconds if paired else None  # a probe's step as timed (what one probe loses has its own cap)
        self.probes.drafted(len(result.committed), rest + draft_seconds, self.plain_seconds, missed < 2, probe, not self.probe_pending)
        self.seconds += time.perf_counter() - tick

    # -- what it knows -------------------------------------------------------------------

    @property
    def planned(self) -> list[int]:
        """Steps planned at each depth (index 0: plain) over the controller's life, every shape together."""
        self._learn_held()
        return [self.plain_steps] + [sum(shape.planned[d] for shape in self.shapes) for d in range(1, self.max_depth + 1)]

    def snapshot(self) -> dict:
        """The current estimates, for stats and tables: costs (ms, at the machine's speed now) and acceptance per depth, per shape."""
        tick = time.perf_counter()
        self._learn_held()  # the held steps' costs in it (their learning is the controller's work)
        self.seconds += time.perf_counter() - tick
        speed, ms = self.speed.factor, 1000 * self.speed.factor
        shapes = [shape.snapshot(self.plain_seconds, self.rows, self.draft_scale, speed) for shape in self.shapes]  # as learnt so far
        return {
            "plain_step_ms": None if self.plain_seconds is None else round(ms * self.plain_seconds, 3),
            "rows_ms": [[round(nodes, 2), round(ms * extra, 3)] for nodes, extra in self.rows.points()],  # (nodes, ms they add)
            "planned_by_depth": self.planned,
            "shapes": shapes,
            "speed": round(speed, 3),  # how much slower than the costs were learnt at the machine runs now (``MachineSpeed``)
            "probe_credit_ms": round(ms * self.probes.credit, 3),
            "probe_loss_ms": None if self.probes.loss is None else round(ms * self.probes.loss, 3),
            "requests_suited": round(self.probes.chance(), 3),  # the chance a request suits the drafter (an opening probe's)
            "catch_up_ms_per_100": round(100 * ms * self.catch_up.line()[1], 4) if self.catch_up.count else None,
        }
