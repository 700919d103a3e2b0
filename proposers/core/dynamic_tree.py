"""The dynamic tree builder of EAGLE-2 (Li et al. 2024): a draft grown depth by depth from its best leaves.

Siblings are either the top-k tokens (a deterministic tree, reranked to its node budget at
the end) or sampled without replacement (Jeon et al. 2024; kept in draw order). Every
proposer that drafts node by node grows its chains and trees here (EAGLE-1/2/3, the draft
model, MTP), so a limit on what is drafted (a node budget, a path-probability floor, the
speculation controller's ``StopRule``) works for all of them. The structure, masks and cuts
of drafts are ``core.tree``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .devices import reads_are_free
from .sampling import SamplingParams, sampled_children, sampled_children_at_once, top_k_rows
from .tree import keep_nodes
from .types import Draft, StopRule


@dataclass
class DraftTree:
    """A draft tree under construction: parents before children, scored for expansion.

    ``scores`` is the cumulative draft log-prob from the root; ``confidences`` the draft
    probability of each node's own token; ``rows`` (sampled trees only) the distribution
    each node was drawn from, given its earlier siblings.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add_children(self, parent: int, tokens: list[int], probs: list[float], rows: list[torch.Tensor] | None) -> list[int]:
        """Append children of ``parent`` (-1: the root) with their draft probabilities; return their indices."""
        score = self.scores[parent] if parent >= 0 else 0.0
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        first = len(self.tokens)
        self.tokens += tokens
        self.parents += [parent] * len(tokens)
        self.depths += [depth] * len(tokens)
        self.confidences += probs
        self.scores += [score + (math.log(p) if p > 0 else -math.inf) for p in probs]
        if rows is not None:
            self.rows += rows
        return list(range(first, len(self.tokens)))

    def to_draft(self, keep: list[int] | None = None) -> Draft:
        """The tree as a Draft (only the nodes ``keep``, renumbered, when given); sampled trees carry their rows."""
        draft = Draft(
            torch.tensor(self.tokens, dtype=torch.long),
            torch.tensor(self.parents, dtype=torch.long),
            torch.stack(self.rows) if self.rows else None,
            scores=list(self.confidences),
        )
        return draft if keep is None else keep_nodes(draft, keep)


@dataclass(frozen=True)
class GrownTree:
    """What ``grow_dynamic_tree`` returns.

    Args:
        draft: the finished tree.
        depth: the depth of its deepest node.
        tree_nodes: the ``DraftTree`` index of each draft node (the numbering the score
            callback saw); they differ only where the budget dropped nodes.
    """

    draft: Draft
    depth: int
    tree_nodes: list[int]


#: score(tree, nodes) -> logits [len(nodes), vocab] after each of ``nodes`` (one draft forward).
ScoreNodes = Callable[[DraftTree, list[int]], torch.Tensor]


def grow_dynamic_tree(
    root_logits: torch.Tensor,  # [vocab]
    score: ScoreNodes,
    depth: int,
    width: int,
    sampling: SamplingParams,
    sampled: bool,
    max_nodes: int | None = None,
    confidence_threshold: float | None = None,
    generator: torch.Generator | None = None,
    min_path_prob: float | None = None,
    stop: StopRule | None = None,
) -> GrownTree:
    """Grow a draft tree depth by depth (EAGLE-2, Li et al. 2024); ``width=1`` grows a chain.

    The root gets ``width`` children; then, for up to ``depth - 1`` more depths, the
    ``width`` newest leaves with the highest cumulative draft log-prob are scored in one
    call of ``score`` and each gets ``width`` children.

    Args:
        root_logits: ``[vocab]`` draft logits after the last committed token.
        score: ``score(tree, nodes)`` returns the draft logits ``[len(nodes), vocab]``
            after each node; every ancestor of ``nodes`` was scored by an earlier call.
        depth: the deepest level to grow.
        width: children per expanded node, and leaves expanded per depth.
        sampling: the processing of sampled children's distributions.
        sampled: True draws siblings without replacement from the processed draft
            distribution (``draft_probs`` = the row each was drawn from); False takes the
            top-``width`` tokens of the raw softmax as point masses (``draft_probs=None``),
            at any temperature (EAGLE uses deterministic trees when sampling too).
        max_nodes: node budget (None: no limit beyond width and depth).
        confidence_threshold: a leaf whose own draft probability is below this stays in
            the tree but is not expanded (None: no threshold).
        generator: the request's generator, for sampled children.
        min_path_prob: a node whose path probability (the product of the draft
            probabilities from the root to it, EAGLE-2's estimate of its chance to be
            accepted) is below this is not expanded, and a deterministic tree drops it. A
            node costs the verifier a row of the target's forward whatever its chance, so
            on hardware where rows are not free this trades the unlikely nodes (and the
            draft forwards of depths that hold only such nodes) for time. Children never
            score above their parent, so the kept tree stays closed under ancestors. A
            sampled tree keeps every drawn node (dropping a node for its own drawn value
            would bias the verifier) and only stops expanding. None: no limit.
        stop: the speculation controller's ``StopRule`` (``ProposeContext.stop``): a leaf worth
            less than ``stop.least`` is not expanded (it stays in the tree: the controller's
            trim cuts it, and would cut all it could grow), and no depth is drafted whose
            expandable leaves together are worth less than ``stop.level`` (its forward costs
            more than it could add). Deterministic trees only; a sampled tree ignores it, as
            the trim leaves a sampled tree whole.
    """
    assert root_logits.dim() == 1 and depth >= 1 and width >= 1, f"root_logits {tuple(root_logits.shape)}, depth {depth}, width {width}"
    assert max_nodes is None or max_nodes >= 1, f"max_nodes must be >= 1 or None, got {max_nodes}"
    # A sampled tree enforces its budget in draw order while it grows: whether a node is
    # in the draft must never depend on its own sampled value (or on anything drawn after
    # it). The verifier's law is exact only when each kept sibling was drawn from its
    # stated row given the earlier siblings, and its presence is decided before its draw;
    # dropping low-scoring sampled nodes afterwards would bias the accepted tokens.
    # A deterministic tree has no such constraint: it is reranked to the budget at the end.
    draw_budget = max_nodes if sampled else None
    floor = math.log(min_path_prob) if min_path_prob else -math.inf  # the scores are log path probabilities
    tree = DraftTree()

    def add_children(parents: list[int], logits: torch.Tensor) -> list[int]:
        """Children of each of ``parents`` from its row of ``logits`` ``[len(parents), vocab]``; their indices."""
        if not sampled:  # top-k of every row at once: one softmax, one topk, one copy to Python
            tokens, probs = top_k_rows(logits, width)
            return [child for parent, t, p in zip(parents, tokens, probs, strict=True) for child in tree.add_children(parent, t, p, None)]
        added = []
        if not reads_are_free(logits.device):  # every parent's siblings drawn at once: one read per depth
            drawn = sampled_children_at_once(logits, width, sampling, generator)
            for i, parent in enumerate(parents):
                count = min(width, draw_budget - len(tree)) if draw_budget is not None else width
                if count < 1:
                    break
                added += tree.add_children(parent, *drawn.take(i, count))
            return added
        for parent, row in zip(parents, logits, strict=True):
            count = min(width, draw_budget - len(tree)) if draw_budget is not None else width
            if count < 1:
                break
            added += tree.add_children(parent, *sampled_children(row, count, sampling, generator))
        return added

    frontier = add_children([-1], root_logits[None])
    reached = 1
    values: list[float] = []  # each node's value under ``stop``
    stop = None if sampled else stop
    while reached < depth:
        leaves = [n for n in expandable_leaves(tree, frontier, width, confidence_threshold) if tree.scores[n] >= floor]
        if stop is not None:
            stop.values(tree.parents, tree.depths, tree.confidences, values)
            leaves = [n for n in leaves if values[n] >= stop.least]
            if leaves and sum(values[n] for n in leaves) < stop.level:
                break  # the depth's forward would cost more than all it could add
        if not leaves or (draw_budget is not None and len(tree) >= draw_budget):
            break
        if not sampled and max_nodes is not None and _budget_is_settled(tree, leaves, max_nodes):
            break
        frontier = add_children(leaves, score(tree, leaves))  # [len(leaves), vocab]: one draft forward
        reached += 1
    if sampled or (floor == -math.inf and (max_nodes is None or len(tree) <= max_nodes)):
        return GrownTree(tree.to_draft(), reached, list(range(len(tree))))
    keep = [n for n in best_nodes(tree.scores, max_nodes or len(tree)) if tree.scores[n] >= floor]
    return GrownTree(tree.to_draft(keep), max((tree.depths[i] for i in keep), default=0), keep)


def expandable_leaves(tree: DraftTree, frontier: list[int], width: int, confidence_threshold: float | None) -> list[int]:
    """The ``width`` leaves of ``frontier`` with the best cumulative log-prob, confident ones only."""
    # A low-confidence token stays in the draft and only loses its children: dropping it
    # because of its own value would bias a sampled draft away from draft_probs.
    if confidence_threshold is not None:
        frontier = [n for n in frontier if tree.confidences[n] >= confidence_threshold]
    return sorted(frontier, key=lambda n: -tree.scores[n])[:width]


def best_nodes(scores: list[float], max_nodes: int) -> list[int]:
    """The ``max_nodes`` best nodes by cumulative log-prob (EAGLE-2's rerank), in tree order.

    Closed under ancestors: a child's score is its parent's plus a log-prob <= 0, so never
    higher, and the stable sort ranks the earlier node (the parent) first on a tie.
    """
    ranked = sorted(range(len(scores)), key=scores.__getitem__, reverse=True)  # stable, also reversed
    return sorted(ranked[:max_nodes])


def _budget_is_settled(tree: DraftTree, leaves: list[int], max_nodes: int) -> bool:
    """Whether no descendant of ``leaves`` can enter the best ``max_nodes``: growing further cannot change the rerank.

    A descendant scores at most its leaf's score and loses ties to every earlier node.
    """
    if len(tree) < max_nodes:
        return False
    return sorted(tree.scores, reverse=True)[max_nodes - 1] >= max(tree.scores[n] for n in leaves)
