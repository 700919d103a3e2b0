"""How likely a draft node is to be accepted, from its own confidence and depth: the speculation controller's calibration.

Drafts are often under- or over-confident (the demo's EAGLE-3 head is under-confident), so a
node's own draft probability is not its chance. Each source of drafts (a proposer, or a
composite's member) keeps, per depth bucket (1, 2, 3, 4+) and confidence bin, decayed counts
of the nodes verified there that were accepted given their parent was; a bin's chance is its
counts over its confidence's prior (worth two nodes). A node without a score has its own bin.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

from draftsmith.proposers.core.types import StopRule

if TYPE_CHECKING:
    from draftsmith.proposers.core.types import Draft

CONFIDENCE_EDGES = (0.05, 0.15, 0.3, 0.5, 0.7, 0.85, 0.95)  # calibration bins of a node's own draft probability
CONFIDENCE_MIDS = (0.025, 0.1, 0.225, 0.4, 0.6, 0.775, 0.9, 0.975)  # each bin's prior acceptance
DEPTH_BUCKETS = 4  # calibration by depth 1, 2, 3 and 4+
SLOTS = len(CONFIDENCE_MIDS) + 1  # a bin per confidence range, and one for a node without a score
PRIORS = (0.5, *CONFIDENCE_MIDS) * DEPTH_BUCKETS  # each calibration bin's prior chance, bin = (depth bucket - 1) * SLOTS + slot
KEEP = 0.98  # what a bin's counts keep per node counted in it


def bin_of(depth: int, score: float | None) -> int:
    """The calibration bin of a node at ``depth`` (>= 1) with its own confidence ``score`` (None: unscored)."""
    index = (depth - 1 if depth < DEPTH_BUCKETS else DEPTH_BUCKETS - 1) * SLOTS
    return index if score is None else index + 1 + bisect_right(CONFIDENCE_EDGES, score)


class Calibration:
    """Per source of drafts, each bin's decayed [accepted, rejected] counts, and its chance (kept up to date bin by bin)."""

    def __init__(self) -> None:
        self.bins: dict[str, list[list[float]]] = {}  # source -> per calibration bin [accepted, rejected], decayed
        self._chances: dict[str, list[float]] = {}  # source -> each bin's chance

    def chances(self, source: str) -> list[float]:
        """Each bin's chance that its node is accepted given its parent was, for ``source`` (the priors until it has counts)."""
        table = self._chances.get(source)
        if table is None:
            bins = self.bins.get(source)
            table = list(PRIORS) if bins is None else [(a + 2.0 * p) / (a + b + 2.0) for (a, b), p in zip(bins, PRIORS, strict=True)]
            self._chances[source] = table
        return table

    def stop_rule(self, least: float, level: float) -> StopRule:
        """A ``StopRule`` over the chances of the proposer's own drafts (source ""), read as the trim reads them (they live)."""
        chances = self.chances("")

        def chance(depth: int, score: float | None) -> float:
            return chances[bin_of(depth, score)]

        return StopRule(chance, least, level)

    def count(self, source: str, tested: list[tuple[int, float | None, bool]]) -> None:
        """Count nodes tested outside a verification: (depth, own confidence, accepted) each (``cut_children``)."""
        for depth, score, hit in tested:
            self.learn([-1], None if score is None else [score], [depth], source, [0] if hit else [], True)

    def learn(self, parents: list[int], scores, depths: list[int], source: str, accepted_nodes: list[int], greedy: bool) -> None:
        """Count a verified draft's tested nodes: at temperature 0 (``greedy``) every child of an accepted node was tested
        at once; else the children of a node were tested in order up to the accepted one."""
        bins = self.bins.get(source) or self.bins.setdefault(source, [[0.0, 0.0] for _ in PRIORS])
        table = self.chances(source)
        accepted = set(accepted_nodes)
        chosen = {} if greedy else {parents[node]: node for node in accepted_nodes}  # parent -> its accepted child (in order)
        for node, parent in enumerate(parents):
            if parent != -1 and parent not in accepted:
                continue  # never tested: its parent was rejected
            if parent in chosen and node > chosen[parent]:
                continue  # tested in order: a later sibling of the accepted child was not reached
            index = bin_of(depths[node], None if scores is None else scores[node])
            counts = bins[index]
            hit = node in accepted
            counts[0] = KEEP * counts[0] + hit
            counts[1] = KEEP * counts[1] + (not hit)
            table[index] = (counts[0] + 2.0 * PRIORS[index]) / (counts[0] + counts[1] + 2.0)


def cut_children(draft: Draft, kept: list[int], token: int, accepted: list[int]) -> list[tuple[int, float | None, bool]]:
    """(depth, own confidence, whether it is ``token``) of each node of ``draft`` a trim cut (it kept ``kept``) whose parent
    ends the accepted path (``accepted``: indices in the trimmed draft; the root where none).

    ``token`` is the step's next token: at temperature 0 the target's choice after the path; at
    temperature > 0, where the path ended with no child verified, a draw from the target's
    distribution there, so it equals a cut node (a deterministic one: only those are trimmed
    there) as often as that node would have passed its test (exactly so for a chain's, or a
    tree's first cut child; a later sibling's test would have drawn from what the earlier ones
    left, which this reads as the whole distribution). So the nodes a trim cut below the
    path's end are tested for free: the calibration counts them (bins a trim cuts are otherwise
    seen only by whole drafts), so a trim that cuts nodes which would pass learns to keep them.
    The plan's shares count only what the step verified (``ShapeEstimates.learn_depths``).
    """
    end, scores = (kept[accepted[-1]] if accepted else -1), draft.scores  # where the accepted path ends, before the trim
    if draft.is_chain():  # a chain's trim keeps a prefix: its one child is the first node cut, if any
        child = end + 1
        if child < len(kept) or child >= draft.num_nodes:
            return []
        return [(child + 1, None if scores is None else scores[child], draft.token_list[child] == token)]
    kept_set, tokens, depths = set(kept), draft.token_list, draft.depth_list
    return [
        (depths[node], None if scores is None else scores[node], tokens[node] == token)
        for node, parent in enumerate(draft.parent_list)
        if parent == end and node not in kept_set
    ]
