"""What the speculation controller knows of one draft shape, and the running averages it keeps them with.

A shape is a way the proposer drafts: a chain (one child per node), or its own tree. Per
planned depth it has a drafting cost, the rest of a step beyond a plain step's, the rows
it verifies and the share of steps whose accepted path reaches that depth; the shapes of
one proposer share the machine's costs (a plain step, a verified row, the drafting scale),
which ``verify.controller.Controller`` keeps.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from collections import deque
from itertools import accumulate

FIRST_PRIOR = 0.3  # the prior share of steps accepting a first draft token, worth one step of counts
STALE = 0.97  # per drafted step, what a depth's counts keep while that depth is not drafted: its prior takes over again
AVERAGE = 0.1  # the weight of a new measurement in a running cost average (a window of ~10 steps)
_STALE_POWERS = tuple(STALE**gap for gap in range(256))  # STALE ** gap for the usual gaps, looked up rather than raised
DRAFT_AVERAGE = 0.25  # the weight of a drafting measurement in the scale every depth's drafting cost shares
SPEED_AVERAGE = 0.25  # the weight of a step's ratio to its expected cost in the machine's speed (a window of ~4 steps)
SPEED_BOUND = 1.5  # one step moves the speed as if it ran at most this many times faster or slower than expected


ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # node counts: a bucket holds those up to its bound
ROW_WEIGHT = 10  # the most steps one bucket weighs for in the curve's pooling (its average's window)


class RowsCurve:
    """What verifying n draft nodes adds to a step beyond a plain step's: an average per bucket of n, joined into a
    non-decreasing piecewise-linear curve.

    A target's forward is not linear in its rows. On this CPU with the demo target one node adds
    about 0.8 ms to a 3.9 ms step, four 1.8 ms, sixteen 3.2 ms (the matrix kernels change path
    as the rows grow); on a GPU rows are nearly free up to a tile. A line through what the
    steps verified priced the sixteenth node of an EAGLE-3 tree at about twice its cost, and the
    trim cut nodes that paid. Each bucket keeps the mean of its node counts and of what they
    added (equal weights over its first steps, then a running average over ~10); the curve
    joins those points, pooled where a larger count measured less (isotonic regression: more
    rows never cost less), carries its last segment's slope beyond the last point, and its
    first segment's back towards one node (never below the chord from none).
    """

    def __init__(self):
        size = len(ROW_BUCKETS) + 1
        self.count, self.nodes, self.extra = [0] * size, [0.0] * size, [0.0] * size
        self._points: list[tuple[float, float]] | None = None
        self._table: tuple[list[float], list[float]] = ([0.0], [0.0])  # ``table``'s, until the curve moves
        self._size = 0  # the longest table asked for: rebuilt that long when the curve moves

    def update(self, nodes: int, extra: float) -> None:
        """One step that verified ``nodes`` nodes (>= 1) and took ``extra`` seconds beyond a plain step."""
        bucket = bisect_left(ROW_BUCKETS, nodes)
        count = self.count[bucket] = self.count[bucket] + 1
        weight = max(1.0 / count, AVERAGE)
        self.nodes[bucket] += weight * (nodes - self.nodes[bucket])
        self.extra[bucket] += weight * (extra - self.extra[bucket])
        self._points = None

    def points(self) -> list[tuple[float, float]]:
        """The curve's points (mean nodes, mean extra seconds), increasing in both, pooled where a bucket broke the order."""
        if self._points is None:
            sums: list[tuple[float, float, float]] = []  # per pooled level: (weighted nodes, weighted extra, weight)
            for count, nodes, extra in zip(self.count, self.nodes, self.extra, strict=True):
                if not count:
                    continue
                weight = count if count < ROW_WEIGHT else ROW_WEIGHT
                level_nodes, level_extra = weight * nodes, weight * extra
                while sums and sums[-1][1] * weight > level_extra * sums[-1][2]:  # a smaller size measured more: pool them
                    below_nodes, below_extra, below_weight = sums.pop()
                    level_nodes, level_extra, weight = below_nodes + level_nodes, below_extra + level_extra, below_weight + weight
                sums.append((level_nodes, level_extra, weight))
            self._points = [(n / w, max(e / w, 0.0)) for n, e, w in sums]
            self._table = ([0.0], [0.0])
        return self._points

    @property
    def ready(self) -> bool:
        """Whether two sizes are measured (a slope to carry): before, nothing is trimmed by it."""
        return len(self.points()) >= 2

    def at(self, nodes: float) -> float:
        """Seconds ``nodes`` nodes add to a step (0 for none; flat at the one point measured, if one)."""
        points = self.points()
        if nodes <= 0 or not points:
            return 0.0
        if len(points) == 1:
            return points[0][1]
        index = bisect_left(points, (nodes, -1.0))  # the first point at or beyond ``nodes``
        if index == 0:  # below the first point: its segment carried back, no lower than the chord from none
            (x0, y0), (x1, y1) = points[0], points[1]
            return max(y0 - (y1 - y0) / (x1 - x0) * (x0 - nodes), y0 * nodes / x0)
        index = min(index, len(points) - 1)  # beyond the last point: the last segment carried on
        (x0, y0), (x1, y1) = points[index - 1], points[index]
        return y0 + (y1 - y0) / (x1 - x0) * (nodes - x0)

    def _sweep(self, size: int) -> list[float]:
        """``at`` of 0..size - 1 in one walk along the segments (a search per count rebuilt the table in ~1 us a count).

        The same arithmetic as ``at``, in the same order, so the table and the curve agree exactly.
        """
        points = self.points()
        if len(points) < 2:
            return [0.0] + [points[0][1] if points else 0.0] * (size - 1)
        (x0, y0), (x1, y1) = points[0], points[1]
        slope = (y1 - y0) / (x1 - x0)
        out, k = [0.0], 1
        push = out.append
        while k < size and k <= x0:  # up to the first point: its segment carried back, no lower than the chord from none
            push(max(y0 - slope * (x0 - k), y0 * k / x0))
            k += 1
        last = len(points) - 1
        for j in range(1, last + 1):  # segment j holds the counts in (x[j - 1], x[j]]; the last one every count beyond
            (xa, ya), (xb, yb) = points[j - 1], points[j]
            slope, bound = (yb - ya) / (xb - xa), (math.inf if j == last else xb)
            while k < size and k <= bound:
                push(ya + slope * (k - xa))
                k += 1
        return out

    def table(self, n: int) -> tuple[list[float], list[float]]:
        """(the extra seconds of 0..n nodes, each count's least marginal cost from it on): what the trim reads, kept until the curve moves.

        ``floor[k]`` is the least a k-th or later node adds: a node worth less than that at the
        best rate so far, with none after it likelier, cannot raise the rate. Rebuilt when the
        curve moves, as long as the longest asked for since (one rebuild a move, not one per size).
        """
        if self._points is None:
            self.points()  # the table of the curve as it is now
        extra, floor = self._table
        if len(extra) <= n:
            self._size = size = max(n + 1, self._size)
            extra = self._sweep(size)
            floor, least = [0.0] * size, float("inf")
            for k in range(size - 1, 0, -1):  # a plain loop: ``accumulate(..., min)`` took three times as long here
                margin = extra[k] - extra[k - 1]  # what the k-th node adds
                if margin < least:
                    least = margin
                floor[k] = least
            self._table = (extra, floor)
        return extra, floor

    def least_margin(self) -> float:
        """The least a node adds at any count, tables of any length included (0 until ``ready``).

        The trim's ``floor[k]`` is never below it, so a node worth less than it at a plain
        step's rate is cut whatever the draft (``Controller.stop_rule``). Beyond the last
        point the table rises by the last segment's slope.
        """
        points = self.points()
        if len(points) < 2:
            return 0.0
        (x0, y0), (x1, y1) = points[-2], points[-1]
        return min(self.table(int(x1) + 2)[1][1], (y1 - y0) / (x1 - x0))


class MachineSpeed:
    """How slow the machine runs now against the costs the controller learnt: ``factor`` (1: as learnt).

    On a shared machine the same plain step takes 3.0 ms in one request and 5.7 ms in the next.
    A drafting controller measures a plain step seldom (one per 64 drafted steps) and a drafted
    one seldom while it is off, so each side's cost was measured at another moment than the
    other's, and a drift of the machine read as a change of drafting's cost: measured against
    plain decoding beside it, the price of a plain step a drafting MTP head's controller held
    ran 9-20% above the truth on the requests it drafted, and the requests its accounting said
    drafting won by 4.3 s had won 1.1 s. Every step's rest (the target's part) is compared with
    what it is expected to cost (a plain step and its nodes' rows), the factor follows the
    ratio quickly (a geometric average over ~4 steps, each ratio bounded: a pause is not a
    change of speed), and every cost is learnt divided by it and used multiplied by it; the
    decisions, which compare costs with costs, then compare them at one speed. The rest is
    measured on plain and drafted steps alike, so the factor follows the machine whichever the
    controller plans; what the target's rows truly add, against what it learnt, moves it too,
    until a plain step corrects them.
    Only ratios of costs decide: the factor and the costs learnt under it may drift together.
    """

    def __init__(self) -> None:
        self.factor = 1.0

    def update(self, seconds: float, expected: float | None) -> None:
        """A step's rest took ``seconds`` where its learnt cost is ``expected`` (None: nothing learnt yet)."""
        if expected:
            ratio = min(max(seconds / (self.factor * expected), 1.0 / SPEED_BOUND), SPEED_BOUND)
            self.factor *= ratio**SPEED_AVERAGE


class RobustLine:
    """``y ~ a + b x`` over the last ``keep`` points by Theil-Sen: the median of the pairwise slopes, the median intercept.

    A pause of the machine inside one point moves it not at all (up to about a third of the
    points may be wild), where least squares would let one point set the slope and so
    the price of every larger x. Both coefficients are kept >= 0 (a cost).
    """

    def __init__(self, keep: int = 16):
        self.points: deque[tuple[float, float]] = deque(maxlen=keep)
        self._line: tuple[float, float] | None = None

    @property
    def count(self) -> int:
        return len(self.points)

    def update(self, x: float, y: float) -> None:
        self.points.append((x, y))
        self._line = None

    def line(self) -> tuple[float, float]:
        """(a, b); b is 0 until two points differ in x."""
        if self._line is None:
            points = list(self.points)
            slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1]
            slope = max(statistics.median(slopes), 0.0) if slopes else 0.0
            self._line = max(statistics.median(y - slope * x for x, y in points), 0.0), slope
        return self._line


class ShapeEstimates:
    """Per planned depth (index 0 unused) of one draft shape: costs measured, and acceptance counted with decay.

    Args:
        width: the most children per node this shape drafts (1: a chain; None: as the proposer drafts).
        max_depth: the deepest depth planned.
    """

    def __init__(self, width: int | None, max_depth: int):
        self.width = width
        d = max_depth + 1
        self.draft_base: list[float | None] = [None] * d  # drafting per planned depth in steady state, over the shared scale
        # the rest of a step beyond a plain step's, per planned depth: a plain step's cost grows with the context, and
        # what drafting adds to it much less, so the difference stays right as the context moves between measurements
        self.verify_seconds: list[float | None] = [None] * d
        self.reached, self.accepted, self.rows = [0.0] * d, [0.0] * d, [0.0] * d  # decayed counts
        self.stamp = [0] * d  # the drafted step at which each depth's counts were last updated
        self.planned = [0] * d  # steps planned at each depth over the controller's life (index 0 unused)
        self._near: tuple[list[int], list[int]] | None = None  # per depth, the nearest measured (drafting, verifying) depth

    @property
    def measured(self) -> bool:
        return any(s is not None for s in self.verify_seconds)

    def draft_costs(self, scale: float) -> list[float]:
        """Seconds of drafting per planned depth: measured where drafted, else scaled from the nearest measured depth.

        A sequential drafter's cost grows with depth, one forward per level (and one to catch
        up): an unmeasured depth D costs the nearest measured depth k's times (D + 1) / (k + 1).
        """
        base, near = self.draft_base, self._nearest()[0]
        return [_drafting(base, k, depth, scale) for depth, k in enumerate(near)]

    def level_cost(self, scale: float) -> float:
        """Seconds one more depth of drafting adds: the growth per depth between the shallowest and the deepest measured
        depths (0 until two are: an extrapolated price assumes a growth that a drafter of a whole block does not have)."""
        base = self.draft_base
        measured = [depth for depth in range(1, len(base)) if base[depth] is not None]
        if len(measured) < 2:
            return 0.0
        low, high = measured[0], measured[-1]
        return max(base[high] - base[low], 0.0) * scale / (high - low)

    def plan_costs(self, plain: float | None, curve: RowsCurve, drafting: list[float], mean_rows: list[float]) -> list[float | None]:
        """Seconds of a step planned at each depth (index 0: ``plain``); None where nothing says yet.

        A depth not measured yet costs the nearest measured one's, plus what its extra rows
        add on the rows ``curve``, plus its ``drafting`` (``draft_costs``: scaled by depth). No depth costs
        more than a deeper one: each depth's average is its own few steps (a depth planned
        seldom keeps a dear average long), and a shallower draft is a prefix of a deeper one.
        """
        verify = self.verify_seconds
        near = self._nearest()[1]
        if plain is None or near[0] < 0:
            return [plain] + [None] * (len(verify) - 1)
        costs: list[float | None] = [plain]
        extra: list[float] | None = None  # the rows curve's table, read when a depth's cost is carried from another's
        for depth in range(1, len(verify)):  # one loop (no list of rows): this runs at every refresh
            k = near[depth]
            step = plain + drafting[depth] + verify[k]
            if k != depth:  # what its mean rows add on the curve beyond the measured depth's
                if extra is None:
                    extra = curve.table(int(max(mean_rows)) + 1)[0]
                step += _between(extra, mean_rows[depth]) - _between(extra, mean_rows[k])
            costs.append(step)
        deeper = costs[-1]
        for depth in range(len(costs) - 2, 0, -1):  # a draft cut at a depth is a prefix of a deeper one: it costs no more
            if costs[depth] > deeper:
                costs[depth] = deeper
            else:
                deeper = costs[depth]
        return costs

    def _nearest(self) -> tuple[list[int], list[int]]:
        """Per depth, the nearest depth whose drafting, and whose verifying, was measured (-1: none yet); kept until one more is."""
        if self._near is None:
            self._near = (
                _nearest([b is not None for b in self.draft_base]),
                _nearest([d > 0 and s is not None for d, s in enumerate(self.verify_seconds)]),
            )
        return self._near

    def estimate(self, now: int, plain: float | None, curve: RowsCurve, drafting: list[float]) -> tuple[list[float], list[float | None]]:
        """Per depth (index 0: a plain step): the share of steps whose accepted path reaches it, and a step's seconds
        (``drafting``: each depth's drafting price, ``draft_costs``).

        Each depth's share has one pseudo-step of a prior extrapolated from the depth above
        (its share times its conditional acceptance, kept in [0.3, 0.95]); counts of a depth
        not drafted lately (``now`` is the drafted step) weigh less.
        """
        shares, mean_rows = [1.0], [0.0]
        prior, prior_rows, above = FIRST_PRIOR, 0.0, 1.0
        reached, accepted, rows, stamp = self.reached, self.accepted, self.rows, self.stamp  # locals: this runs every few steps
        for depth in range(1, len(reached)):
            gap = now - stamp[depth]
            kept = _STALE_POWERS[gap] if gap < len(_STALE_POWERS) else STALE**gap
            seen = kept * reached[depth] + 1.0
            share = (kept * accepted[depth] + prior) / seen
            shares.append(share)
            prior_rows = (kept * rows[depth] + prior_rows + 1.0) / seen
            mean_rows.append(prior_rows)
            ratio = share / above
            prior, above = share * (0.3 if ratio < 0.3 else 0.95 if ratio > 0.95 else ratio), share
        return shares, self.plan_costs(plain, curve, drafting, mean_rows)

    def learn_depths(self, planned: int, depths: list[int] | None, accepted: int, decay: float, now: int) -> None:
        """Count one drafted step planned at ``planned``: its nodes' ``depths`` (None: a chain, one per depth), its ``accepted``
        length (what it verified and accepted: a depth a trim or a stop left out counts as not reached), its rows counted
        to ``planned``."""
        if depths is None:
            rows_to = range(1, planned + 1)  # the nodes at depths 1..d
        else:
            counts = [0] * (planned + 2)  # the last slot gathers nodes below the planned depth
            for d in depths:
                counts[d if d <= planned else planned + 1] += 1
            rows_to = accumulate(counts[1 : planned + 1])
        reached, accepted_counts, row_counts, stamp = self.reached, self.accepted, self.rows, self.stamp
        hit = min(accepted, planned) + 1  # the depths the accepted path reached, and one
        for d, rows in enumerate(rows_to, start=1):
            gap = now - stamp[d] - 1  # drafted steps since this depth's last count that did not draft it (this one does)
            kept = decay if gap <= 0 else decay * (_STALE_POWERS[gap] if gap < len(_STALE_POWERS) else STALE**gap)
            reached[d] = kept * reached[d] + 1.0
            accepted_counts[d] = kept * accepted_counts[d] + (d < hit)
            row_counts[d] = kept * row_counts[d] + rows
            stamp[d] = now

    def learn_draft_cost(self, depth: int, seconds: float, scale: float) -> float:
        """Learn the drafting cost of ``depth``: a slow average per depth, times the shared scale; return the new scale.

        The scale follows each measurement's ratio to its depth's estimate quickly (a
        geometric average, weight 0.25, or 0.5 for a ratio beyond 4x), so a slower drafter or
        a loaded machine moves every depth's cost within a few steps, and a lone spike only briefly;
        in the depth's own average one measurement counts for at most twice it.
        """
        base, seconds = self.draft_base[depth], max(seconds, 1e-7)  # a drafter that takes no time still takes a tick
        expected = base * scale if base is not None else self.draft_costs(scale)[depth]  # a new depth: as extrapolated
        if expected > 0:
            ratio = seconds / expected
            scale *= ratio ** (DRAFT_AVERAGE if 0.25 < ratio < 4.0 else 2 * DRAFT_AVERAGE)  # a 4x change is rarely noise
        fresh = seconds / scale
        if base is None:
            self._near = None
        else:  # at most twice the estimate: a pause moves a depth's cost by a tenth, the scale follows a real change
            fresh = min(fresh, 2.0 * base)
        self.draft_base[depth] = fresh if base is None else (1.0 - AVERAGE) * base + AVERAGE * fresh
        return scale

    def learn_verify_cost(self, depth: int, extra: float, plain: float) -> None:
        """Learn the rest of a step planned at ``depth`` beyond a plain step's (``plain`` seconds).

        One measurement counts for at most the estimate plus the larger of it and a plain step:
        a pause of the machine inside a step (tens of plain steps) then moves that depth's cost
        by a tenth of a plain step, not by a tenth of the pause. Unbounded, a depth planned
        seldom (the one above the planned depth is explored every few dozen drafted steps) kept
        such a cost for hundreds of steps, and the plan stayed a depth too shallow.
        """
        known = self.verify_seconds[depth]
        if known is None:
            self._near = None
        else:
            extra = min(extra, known + max(known, plain))
        self.verify_seconds[depth] = average(known, extra)

    def snapshot(self, plain: float | None, curve: RowsCurve, scale: float, speed: float = 1.0) -> dict:
        """This shape's estimates in ms (learnt costs times the machine's ``speed`` now), and its acceptance per depth."""
        drafting = self.draft_costs(scale)
        costs = self.plan_costs(plain, curve, drafting, [0.0] * len(self.reached))
        return {
            "width": self.width,
            "step_ms_by_depth": [None if s is None else round(1000 * speed * s, 3) for s in costs[1:]],
            "draft_ms_by_depth": [round(1000 * speed * s, 3) for s in drafting[1:]],
            "accept_share_by_depth": [round(a / r, 3) if r else None for a, r in zip(self.accepted[1:], self.reached[1:], strict=True)],
            "planned_by_depth": self.planned[1:],
        }


def _drafting(base: list[float | None], k: int, depth: int, scale: float) -> float:
    """Drafting seconds of ``depth`` from the nearest measured depth ``k`` (-1: none yet, 0.0): scaled by (depth + 1) / (k + 1)."""
    if k < 0:
        return 0.0
    return base[depth] * scale if k == depth else base[k] * scale * (depth + 1) / (k + 1)


def _between(extra: list[float], nodes: float) -> float:
    """The table ``extra`` (seconds at whole node counts) read linearly at ``nodes``."""
    whole = int(nodes)
    return extra[whole] + (nodes - whole) * (extra[whole + 1] - extra[whole])


def _nearest(known: list[bool]) -> list[int]:
    """For each index, the nearest index where ``known`` holds, the lower one on a tie (-1 everywhere when none does)."""
    n, last, below = len(known), -1, []
    for i in range(n):
        last = i if known[i] else last
        below.append(last)
    out, last = [0] * n, -1
    for i in range(n - 1, -1, -1):
        last = i if known[i] else last
        low = below[i]
        out[i] = low if last < 0 or (low >= 0 and i - low <= last - i) else last
    return out


def first_children_chain(parents: list[int], accepted_nodes: list[int]) -> tuple[int, int]:
    """(how deep the chain of first children (in draft order) runs, how far the accepted path runs through it).

    The verifier tests a node's children in draft order (all at once at temperature 0, where
    only one can match), so the first child's test is the same whether siblings follow or not:
    the chain of first children accepts what a chain of that depth would have. Depths it does
    not reach (a trimmed tree's) say nothing of what a chain would accept there.
    """
    chain, last = [], -1
    for node, parent in enumerate(parents):  # parents come first: the first node after ``last`` under it is its first child
        if parent == last:
            chain.append(node)
            last = node
    reach = 0
    for node, first in zip(accepted_nodes, chain, strict=False):  # the accepted path may leave the chain, or outrun it
        if node != first:
            break
        reach += 1
    return len(chain), reach


def average(known: float | None, new: float) -> float:
    """A running average with weight ``AVERAGE`` for ``new`` (``new`` itself when nothing is known)."""
    return new if known is None else (1.0 - AVERAGE) * known + AVERAGE * new
