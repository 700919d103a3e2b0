"""The speculation controller: how much to draft each step, from costs and acceptance it measures on this machine.

A draft pays when the tokens it is expected to add outrun what it costs: the drafting,
and the extra rows of the target's forward. Both sides depend on the machine (a verified
row is nearly free on a GPU, a sixteenth of a step on this CPU), on the proposer and on
the text, so the controller measures them itself while it decodes and decides per step:

0. plan (before the proposer drafts, from the past only): the depth to draft, 0 being a
   plain step. For each depth D it expects ``1 + sum_{d <= D} u_d`` tokens, u_d the
   recent share of steps drafted at least d deep whose accepted path reached depth d,
   against the seconds its steps planned at D took (drafting, and the rest of the step:
   the target's forward of their rows, the sampler, the commit), measured per depth and
   carried to the depths not yet measured by the cost of a row and of a level; the best
   rate wins, plain decoding (one token per plain step) included.
1. trim (after, with the draft's own values): each node's chance to be accepted is its
   calibrated confidence (``Draft.scores``, binned per source and depth, learned from
   every verification) times its parent's; the nodes are kept best first while a row's
   cost buys more than it adds. Only where it keeps the target's law exactly: at
   temperature 0, or for deterministic drafts (point masses, whose verification is exact
   however they were chosen). A sampled tree is never cut by its own drawn values.
2. observe: the step's seconds update the running costs of its planned depth (or of a
   plain step) and the cost of a verified row (a least-squares line with forgetting
   over the rows); the outcome updates u_d, the rows per depth and the calibration bins. The
   running averages follow the context as it grows.

A proposer that stopped paying is asked again now and then (a probe, at intervals that
double while probes lose and reset when one wins), and one that pays is now and then
tried one depth deeper, so the controller follows the text when it turns predictable or
stops being so. Its state lives across requests (costs are the machine's), with the
acceptance side forgetting old steps quickly.

Exactness: the plan uses committed outcomes and timings only, and a trim is applied only
where any choice of nodes is exact, so greedy output stays token-identical to plain
decoding and sampled output keeps the target's distribution.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import dataclass

from draftsmith.proposers.core.tree import keep_nodes
from draftsmith.proposers.core.types import Draft, VerifyResult

CONFIDENCE_EDGES = (0.05, 0.15, 0.3, 0.5, 0.7, 0.85, 0.95)  # calibration bins of a node's own draft probability
CONFIDENCE_MIDS = (0.025, 0.1, 0.225, 0.4, 0.6, 0.775, 0.9, 0.975)  # each bin's prior acceptance
DEPTH_BUCKETS = 4  # calibration by depth 1, 2, 3 and 4+
SLOTS = len(CONFIDENCE_MIDS) + 1  # a bin per confidence range, and one for a node without a score
PRIORS = (0.5, *CONFIDENCE_MIDS) * DEPTH_BUCKETS  # each calibration bin's prior chance, bin = (depth bucket - 1) * SLOTS + slot
DEFAULT_DEPTH = 8  # planned depths for a proposer that states no limit
REFRESH_EVERY = 4  # observed steps between recomputations of the plan's estimates (they move slowly)
PLAIN_EVERY = 64  # drafted steps between plain steps that keep the plain cost measured
PLAIN_SAMPLES = 4  # until a plain step has been measured this often, every fourth step is one
PROBE_SHARE = 0.05  # the most of the plain steps' time since the last probe that a probe's catching up may cost
MARGIN = 0.05  # drafting must promise this much more than plain decoding: a tie is noise, and drafting's variance is not free
FIRST_PRIOR = 0.3  # the prior share of steps accepting a first draft token, worth one step of counts
STALE = 0.97  # per drafted step, what a depth's counts keep while that depth is not drafted: its prior takes over again
AVERAGE = 0.1  # the weight of a new measurement in a running cost average (a window of ~10 steps)
DRAFT_AVERAGE = 0.25  # the weight of a drafting measurement in the scale every depth's drafting cost shares


class RunningLine:
    """``y ~ a + b x`` by weighted least squares with exponential forgetting, kept as running moments (O(1) per point).

    Args:
        forget: each older point weighs this much less (0.98: a window of ~50).
    """

    def __init__(self, forget: float):
        self.forget, self.count = forget, 0
        self.n = self.x = self.y = self.xx = self.xy = 0.0

    def update(self, x: float, y: float) -> None:
        f = self.forget
        self.n, self.x, self.y = f * self.n + 1.0, f * self.x + x, f * self.y + y
        self.xx, self.xy = f * self.xx + x * x, f * self.xy + x * y
        self.count += 1

    def line(self) -> tuple[float, float]:
        """(a, b); b is 0 until the points spread along x."""
        mean_x, mean_y = self.x / self.n, self.y / self.n
        spread = self.xx / self.n - mean_x * mean_x
        slope = (self.xy / self.n - mean_x * mean_y) / spread if spread > 1e-9 else 0.0
        return mean_y - slope * mean_x, slope


@dataclass(frozen=True)
class Plan:
    """One step's plan: the depth to draft (0: a plain step), and whether it is a probe of a depth the estimates do not favour.

    ``whole``: verify the whole draft, untrimmed, so that the calibration sees what a trim hides.
    """

    depth: int
    probe: bool = False
    whole: bool = False


class Controller:
    """Plans, trims and learns for one decoder's proposer (see the module docstring).

    Args:
        max_depth: the deepest the proposer drafts (``Proposer.draft_depth``; None: ``DEFAULT_DEPTH``).
        decay: how much the acceptance side forgets per drafted step (0.9: a window of ~10 steps).
        probe_every: plain steps before the first probe; the interval doubles while probes lose.
        max_probe_every: the longest interval between probes.
        explore_every: drafted steps between probes of the planned depth's neighbourhood (one
            depth deeper, and the whole draft verified so that the calibration sees what a trim hides).
    """

    def __init__(
        self,
        max_depth: int | None,
        decay: float = 0.9,
        probe_every: int = 4,
        max_probe_every: int = 128,
        explore_every: int = 16,
    ):
        self.max_depth = max_depth or DEFAULT_DEPTH
        self.decay, self.probe_base, self.max_probe_every, self.explore_every = decay, probe_every, max_probe_every, explore_every
        d = self.max_depth + 1
        self.plain_seconds: float | None = None  # a plain step, running average
        self.draft_base: list[float | None] = [None] * d  # drafting per planned depth in steady state, over ``draft_scale``
        self.draft_scale = 1.0  # what every depth's drafting cost is multiplied by (``_learn_draft_cost``)
        self.draft_seconds: list[float | None] = [None] * d  # the product: drafting's seconds per planned depth
        # the rest of a step beyond a plain step's, per planned depth: a plain step's cost grows with the context, and
        # what drafting adds to it much less, so the difference stays right as the context moves between measurements
        self.verify_seconds: list[float | None] = [None] * d
        self.rows_model = RunningLine(0.98)  # the rest of a drafted step against its nodes beyond the first
        self.reached, self.accepted, self.rows = [0.0] * d, [0.0] * d, [0.0] * d  # decayed, per depth 1..max (index 0 unused)
        self.stamp = [0] * d  # the drafted step at which each depth's counts were last updated
        self.bins: dict[str, list[list[float]]] = {}  # source -> per calibration bin [accepted, rejected], decayed
        self.probe_every, self.plain_run, self.drafted_steps, self.probe_pending = probe_every, 0, 0, False
        self.since_plain, self.plain_samples = PLAIN_SAMPLES, 0  # the first step is a plain one
        self.last_drafted = 0  # the context length at the last draft: the proposer catches up from there
        self.catch_up = 0.0  # seconds per committed position a proposer feeds when it drafts after plain steps (average)
        self.planned: list[int] = [0] * d  # steps planned at each depth (0: plain), over the controller's life
        self.seconds = 0.0  # the controller's own work
        self._estimates: tuple[list[float], list[float | None]] | None = None  # (shares, plan costs), refreshed now and then
        self._decisions: dict[int, tuple[int, int]] = {}  # room -> (plan, best drafting depth), with the estimates
        self._rows_cost: tuple[float, float] | None = None  # ``_row_costs``, until the rows line is next updated
        self._chances: dict[str, list[float]] = {}  # source -> each bin's chance, until its bins are next updated
        self.observed = 0

    # -- costs ---------------------------------------------------------------------------

    def _row_costs(self) -> tuple[float, float]:
        """(the rest of a step that verifies one node, each further node), from the rows line; (inf, 0) before it has data."""
        if self._rows_cost is None:
            if self.rows_model.count < 2:
                return float("inf"), 0.0
            first, per_row = self.rows_model.line()
            self._rows_cost = max(first, 1e-6), max(per_row, 0.0)
        return self._rows_cost

    def _plan_costs(self, mean_rows: list[float]) -> list[float | None]:
        """Seconds of a step planned at each depth (index 0: a plain step); None where nothing says yet.

        A depth not measured yet costs the nearest measured one's, plus its extra rows at the
        rows model's price, plus its drafting scaled by depth (``_draft_costs``).
        """
        _, per_row = self._row_costs()
        drafting = self._draft_costs()
        measured = [d for d in range(1, len(self.verify_seconds)) if self.verify_seconds[d] is not None]
        plain = self.plain_seconds
        costs: list[float | None] = [plain]
        for depth in range(1, len(self.verify_seconds)):
            if plain is not None and self.verify_seconds[depth] is not None:
                costs.append(plain + drafting[depth] + self.verify_seconds[depth])
            elif plain is not None and measured:
                near = min(measured, key=lambda d: abs(d - depth))
                costs.append(plain + drafting[depth] + self.verify_seconds[near] + per_row * (mean_rows[depth] - mean_rows[near]))
            else:
                costs.append(None)
        return costs

    def _draft_costs(self) -> list[float]:
        """Seconds of drafting per planned depth (index 0 unused): measured where drafted, else scaled from the nearest.

        A sequential drafter's cost grows with depth, one forward per level (and one to catch
        up): an unmeasured depth D costs the nearest measured depth k's times (D + 1) / (k + 1).
        """
        seen = [(d, s) for d, s in enumerate(self.draft_seconds) if s is not None]
        out = []
        for depth, known in enumerate(self.draft_seconds):
            if known is not None or not seen:
                out.append(known or 0.0)
            else:
                near, seconds = min(seen, key=lambda item: abs(item[0] - depth))
                out.append(seconds * (depth + 1) / (near + 1))
        return out

    def start(self) -> None:
        """A new request: its proposer has fed none of its context yet (the first draft catches up the prompt)."""
        self.last_drafted = 0

    # -- 0. plan -------------------------------------------------------------------------

    def plan(self, context: int, room: int) -> Plan:
        """The depth to draft with ``room`` depths left (0: a plain step); ``context`` is the committed length."""
        tick = time.perf_counter()
        deepest = min(self.max_depth, room)
        if self._estimates is None:
            self._estimates, self._decisions = self._estimate(), {}
        decision = self._decisions.get(deepest)
        if decision is None:
            decision = self._decisions[deepest] = self._decide(deepest)
        catch_up = self.catch_up * max(context - self.last_drafted - 1, 0)  # what the next draft feeds before drafting
        if catch_up and decision[0] and not self._pays_back(decision[0], catch_up, room):
            decision = (0, decision[1])
        plan = self._explore(*decision, deepest, catch_up)
        self.planned[plan.depth] += 1
        self.seconds += time.perf_counter() - tick
        return plan

    def _pays_back(self, depth: int, catch_up: float, room: int) -> bool:
        """Whether drafting at ``depth`` still beats a plain step by the margin with ``catch_up`` seconds spread over the request's rest."""
        shares, costs = self._estimates
        expected = 1.0 + sum(shares[1 : depth + 1])
        steps = max(room / expected, 1.0)
        plain = costs[0]
        return plain is None or expected * plain > (1.0 + MARGIN) * (costs[depth] + catch_up / steps)

    def _decide(self, deepest: int) -> tuple[int, int]:
        """(the depth to plan, 0 for a plain step; the best drafting depth) from the current estimates."""
        shares, costs = self._estimates
        expected, drafting, drafting_rate = 1.0, 0, 0.0
        for depth in range(1, deepest + 1):
            expected += shares[depth]
            cost = costs[depth]
            rate = expected / cost if cost is not None else float("inf")  # unmeasured: try it
            if rate > drafting_rate:
                drafting, drafting_rate = depth, rate
        plain = costs[0]
        return (drafting if plain is None or drafting_rate * plain > 1.0 + MARGIN else 0), drafting

    def _estimate(self) -> tuple[list[float], list[float | None]]:
        """Per depth (index 0: a plain step): the share of steps whose accepted path reaches it, and a step's seconds."""
        reached, accepted, rows, stamp, now = self.reached, self.accepted, self.rows, self.stamp, self.drafted_steps
        shares, mean_rows = [1.0], [0.0]
        prior, prior_rows, above = FIRST_PRIOR, 0.0, 1.0
        for depth in range(1, self.max_depth + 1):
            kept = STALE ** (now - stamp[depth])  # counts of a depth not drafted lately weigh less
            seen = kept * reached[depth] + 1.0  # one pseudo-step of the prior extrapolated from the depth above
            share = (kept * accepted[depth] + prior) / seen
            shares.append(share)
            mean_rows.append((kept * rows[depth] + prior_rows + 1.0) / seen)
            # the next depth's prior: this share times this depth's conditional acceptance
            prior, prior_rows, above = share * min(max(share / above, 0.3), 0.95), mean_rows[-1], share
        return shares, self._plan_costs(mean_rows)

    def _explore(self, best: int, drafting: int, deepest: int, catch_up: float = 0.0) -> Plan:
        """Probe a proposer that is off, now and then; probe around the planned depth, and measure a plain step, now and then.

        A probe is due after ``probe_every`` plain steps, and only when the catching up it
        costs (the positions the proposer has not fed, at the measured price) is at most
        ``PROBE_SHARE`` of the plain steps' time since the last one: exploration stays a
        bounded share of the time even where a long prompt makes the first draft dear.
        """
        if best and (self.since_plain >= (PLAIN_EVERY if self.plain_samples >= PLAIN_SAMPLES else PLAIN_SAMPLES)):
            return Plan(0)  # keep the plain cost measured: often until it has a few samples, then now and then
        if best == 0:
            if self.probe_pending:  # a probe is two drafted steps: the second one's drafting is not a catch-up, so it is measured
                self.probe_pending = False
                return Plan(drafting, probe=True)
            self.plain_run += 1
            affordable = self.plain_seconds is None or catch_up <= PROBE_SHARE * self.plain_run * self.plain_seconds
            if drafting and self.plain_run >= self.probe_every and affordable:
                self.plain_run, self.probe_pending = 0, True
                return Plan(drafting, probe=True)
            return Plan(0)
        self.plain_run, self.probe_every = 0, self.probe_base
        self.drafted_steps += 1
        if self.drafted_steps % self.explore_every == 0:
            return Plan(min(best + 1, deepest), probe=True, whole=True)
        return Plan(best)

    # -- 1. trim -------------------------------------------------------------------------

    def trim(self, draft: Draft, context: int, exact_any_subset: bool) -> tuple[Draft, list[int] | None]:
        """The nodes of ``draft`` worth verifying, and their indices in ``draft`` (None: all kept).

        Args:
            exact_any_subset: whether any subset closed under ancestors keeps the target's law
                (temperature 0, or a deterministic draft); else the draft is kept whole.
        """
        n = draft.num_nodes
        first, per_row = self._row_costs()
        if not n or not exact_any_subset or self.plain_seconds is None or first == float("inf"):
            return draft, None
        tick = time.perf_counter()
        parents, scores, depths = draft.parent_list, draft.scores, draft.depth_list
        source = draft.source or ""
        chances = self._chances.get(source) or self._chance_table(source)
        value = [0.0] * n
        for i, parent in enumerate(parents):
            slot = 0 if scores is None else 1 + bisect_right(CONFIDENCE_EDGES, scores[i])
            value[i] = chances[(min(depths[i], DEPTH_BUCKETS) - 1) * SLOTS + slot] * (value[parent] if parent >= 0 else 1.0)
        order = sorted(range(n), key=value.__getitem__, reverse=True)  # stable: a parent (not less likely, earlier) first
        best_k, best_rate, expected = 0, 1.0 / self.plain_seconds, 1.0
        for k, node in enumerate(order, start=1):
            if k > 1 and value[node] < per_row * best_rate:
                break  # a row buys less than the rate so far, and every later node is no likelier
            expected += value[node]
            rate = expected / (first + per_row * (k - 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        self.seconds += time.perf_counter() - tick
        if best_k == n:
            return draft, None
        kept = sorted(order[:best_k])
        return keep_nodes(draft, kept), kept

    def _chance_table(self, source: str) -> list[float]:
        """Each calibration bin's chance that its node is accepted given its parent was: its counts over its confidence's prior."""
        bins = self.bins.get(source)
        table = list(PRIORS) if bins is None else [(a + 2.0 * prior) / (a + b + 2.0) for (a, b), prior in zip(bins, PRIORS, strict=True)]
        self._chances[source] = table
        return table

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
        self.observed += 1
        if self.observed % REFRESH_EVERY == 0 or plan.probe:
            self._estimates = None
        rest = max(step_seconds - draft_seconds, 1e-6)
        if plan.depth == 0:
            self.plain_seconds = _average(self.plain_seconds, rest)
            self.since_plain, self.plain_samples = 0, self.plain_samples + 1
        else:
            self.since_plain += 1
            backlog, self.last_drafted = context - self.last_drafted, context
            if backlog <= 2:  # steady state: the first draft after plain steps also catches them up
                self._learn_draft_cost(plan.depth, draft_seconds)
            elif self.draft_seconds[plan.depth] is not None:  # a catch-up: what it cost per position beyond the drafting
                extra = max(draft_seconds - self.draft_seconds[plan.depth], 0.0) / (backlog - 1)
                self.catch_up = extra if not self.catch_up else (1.0 - AVERAGE) * self.catch_up + AVERAGE * extra
            if self.plain_seconds is not None:
                self.verify_seconds[plan.depth] = _average(self.verify_seconds[plan.depth], rest - self.plain_seconds)
            if draft.num_nodes:
                self.rows_model.update(draft.num_nodes - 1.0, rest)
                self._rows_cost = None
            self._learn_depths(plan.depth, draft.depth_list, result.num_accepted)
            if self.observed % 2 or plan.probe:  # half the steps calibrate (and every probe): a bin moves slowly anyway
                self._learn_bins(draft, result, greedy)
            if plan.probe and self.plain_run == 0 and not self.probe_pending:  # a probe's second step: back off while probes lose
                paid = self._paid(result, step_seconds)
                self.probe_every = self.probe_base if paid else min(2 * self.probe_every, self.max_probe_every)
        self.seconds += time.perf_counter() - tick

    def _learn_draft_cost(self, depth: int, seconds: float) -> None:
        """Learn the drafting cost of ``depth``: a slow average per depth, times one scale that every depth shares.

        The scale follows each measurement's ratio to its depth's estimate quickly (a
        geometric average, weight 0.25, or 0.5 for a ratio beyond 4x), so a slower drafter or
        a loaded machine moves every depth's cost within a few steps, and a lone spike only briefly.
        """
        base, seconds = self.draft_base[depth], max(seconds, 1e-7)  # a drafter that takes no time still takes a tick
        expected = base * self.draft_scale if base is not None else self._draft_costs()[depth]  # a new depth: as extrapolated
        if expected > 0:
            ratio = seconds / expected
            self.draft_scale *= ratio ** (DRAFT_AVERAGE if 0.25 < ratio < 4.0 else 2 * DRAFT_AVERAGE)  # a 4x change is rarely noise
        fresh = seconds / self.draft_scale
        self.draft_base[depth] = fresh if base is None else (1.0 - AVERAGE) * base + AVERAGE * fresh
        self.draft_seconds = [None if b is None else b * self.draft_scale for b in self.draft_base]

    def _paid(self, result: VerifyResult, step_seconds: float) -> bool:
        """Whether a step emitted tokens faster than a plain step is expected to."""
        return self.plain_seconds is None or len(result.committed) * self.plain_seconds > step_seconds

    def _learn_depths(self, planned: int, depths: list[int], accepted: int) -> None:
        counts = [0] * (planned + 1)
        for d in depths:
            if d <= planned:
                counts[d] += 1
        rows, now = 0, self.drafted_steps
        for d in range(1, planned + 1):
            decay = self.decay * STALE ** (now - self.stamp[d])
            rows += counts[d]
            self.reached[d] = decay * self.reached[d] + 1.0
            self.accepted[d] = decay * self.accepted[d] + (1.0 if accepted >= d else 0.0)
            self.rows[d] = decay * self.rows[d] + rows
            self.stamp[d] = now

    def _learn_bins(self, draft: Draft, result: VerifyResult, greedy: bool) -> None:
        parents, scores, depths, source = draft.parent_list, draft.scores, draft.depth_list, draft.source or ""
        self._chances.pop(source, None)
        bins = self.bins.get(source) or self.bins.setdefault(source, [[0.0, 0.0] for _ in PRIORS])
        accepted = set(result.accepted_nodes)
        chosen = {parents[node]: node for node in result.accepted_nodes}  # parent -> its accepted child
        for node, parent in enumerate(parents):
            if parent != -1 and parent not in accepted:
                continue  # never tested: its parent was rejected
            if not greedy and parent in chosen and node > chosen[parent]:
                continue  # tested in order: a later sibling of the accepted child was not reached
            slot = 0 if scores is None else 1 + bisect_right(CONFIDENCE_EDGES, scores[node])
            counts = bins[(min(depths[node], DEPTH_BUCKETS) - 1) * SLOTS + slot]
            hit = node in accepted
            counts[0] = 0.98 * counts[0] + hit
            counts[1] = 0.98 * counts[1] + (not hit)

    # -- what it knows -------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The current estimates, for stats and tables: costs (ms) and acceptance per depth."""
        first, per_row = self._row_costs()
        ms = [None if s is None else round(1000 * s, 3) for s in self._plan_costs([0.0] * len(self.reached))]
        return {
            "plain_step_ms": ms[0],
            "step_ms_by_depth": ms[1:],
            "row_ms": round(1000 * per_row, 4),
            "draft_ms_by_depth": [round(1000 * s, 3) for s in self._draft_costs()[1:]],
            "accept_share_by_depth": [round(a / r, 3) if r else None for a, r in zip(self.accepted[1:], self.reached[1:], strict=True)],
            "planned_by_depth": list(self.planned),
            "probe_every": self.probe_every,
        }


def _average(known: float | None, new: float) -> float:
    return new if known is None else (1.0 - AVERAGE) * known + AVERAGE * new
