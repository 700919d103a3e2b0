"""Static draft trees of rank paths (Medusa's ``medusa_choices``): checked, laid out, grown to a budget.

A rank path ``(0, 2)`` is the top-1 guess at depth 1 followed by the top-3 guess at depth 2.
A tree is grown to a node budget from measured acceptance (per-depth accuracies, or the
frequency of whole paths), or taken Cartesian; the dynamic trees of EAGLE-2 are in
``proposers.core.tree``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import InputError

#: A tree as rank paths: ``(0, 2)`` is the top-1 guess at depth 1 followed by the top-3 at depth 2.
RankPath = tuple[int, ...]


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree of rank paths, laid out parents first (``static_tree``).

    Args:
        paths: the paths, sorted by depth, then by ranks.
        parents: ``[n]`` the parent of each node (-1: the root).
        depths: ``[n]`` 1 for the root's children.
        ranks: ``[n]`` the rank of each node's token among its depth's guesses (``path[-1]``).
    """

    paths: tuple[RankPath, ...]
    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return int(self.depths.max()) if self.paths else 0

    @property
    def width(self) -> int:
        """One more than the highest rank used: how many guesses each depth must offer."""
        return int(self.ranks.max()) + 1 if self.paths else 0


def static_tree(paths: Sequence[Sequence[int]], max_depth: int | None = None, what: str = "tree") -> StaticTree:
    """Check ``paths`` (every prefix present, ranks >= 0, no repeats, at most ``max_depth`` deep) and lay them out.

    Raises InputError naming ``what`` and the first bad path.
    """
    checked: list[RankPath] = []
    for path in paths:
        if isinstance(path, (str, bytes)) or not isinstance(path, Sequence) or not path:
            raise InputError(f"{what}: every path is a non-empty list of ranks, got {path!r}")
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path):
            raise InputError(f"{what}: ranks are integers >= 0, got path {list(path)}")
        checked.append(tuple(path))
    if not checked:
        raise InputError(f"{what} has no paths: give at least one, e.g. [[0]]")
    if len(set(checked)) != len(checked):
        repeated = next(p for p in checked if checked.count(p) > 1)
        raise InputError(f"{what}: path {list(repeated)} appears twice")
    present = set(checked)
    for path in checked:
        if max_depth is not None and len(path) > max_depth:
            raise InputError(f"{what}: path {list(path)} is {len(path)} deep, more than the {max_depth} heads that draft it")
        if len(path) > 1 and path[:-1] not in present:
            raise InputError(f"{what}: path {list(path)} has no parent path {list(path[:-1])}")
    ordered = sorted(checked, key=lambda p: (len(p), p))
    index = {path: i for i, path in enumerate(ordered)}
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in ordered]
    return StaticTree(
        tuple(ordered),
        torch.tensor(parents, dtype=torch.long),
        torch.tensor([len(p) for p in ordered], dtype=torch.long),
        torch.tensor([p[-1] for p in ordered], dtype=torch.long),
    )


#: children(path) -> (child path, value) pairs: the candidates below ``path`` (``()``: the root) and their acceptance.
Children = Callable[[RankPath], Iterable[tuple[RankPath, float]]]


def grow_tree(children: Children, max_nodes: int) -> list[RankPath]:
    """The rank-path tree of at most ``max_nodes`` nodes with the largest expected accepted length.

    A node's value is the probability that its whole path is accepted, so the expected
    accepted length is the sum of the values. A child never scores above its parent
    (its event is contained in the parent's), so adding the best candidate below the
    tree so far, node by node, gives the best tree for the budget (the calibrated trees
    of Medusa, Cai et al. 2024, and Sequoia, Chen et al. 2024). Nodes that are never
    accepted (value 0) are left out.
    """
    if max_nodes < 1:
        raise InputError(f"max_nodes must be >= 1, got {max_nodes}")
    frontier: list[tuple[float, int, RankPath]] = []

    def offer(parent: RankPath) -> None:
        for path, value in children(parent):
            if value > 0:
                heapq.heappush(frontier, (-value, len(path), path))

    offer(())
    chosen: list[RankPath] = []
    while frontier and len(chosen) < max_nodes:
        _, _, path = heapq.heappop(frontier)
        chosen.append(path)
        offer(path)
    return chosen


def grow_tree_by_accuracy(rank_accuracy: Sequence[Sequence[float]], max_nodes: int) -> list[RankPath]:
    """``grow_tree`` with depths taken as independent: a path's value is the product of ``rank_accuracy[d][r]`` along it.

    ``rank_accuracy[d][r]`` is how often the guess of rank r at depth d + 1 is the target's
    token (the Medusa paper's calibration).
    """

    def children(parent: RankPath) -> Iterable[tuple[RankPath, float]]:
        if len(parent) >= len(rank_accuracy):
            return []
        value = math.prod(rank_accuracy[d][r] for d, r in enumerate(parent))
        return [(parent + (r,), value * a) for r, a in enumerate(rank_accuracy[len(parent)])]

    return grow_tree(children, max_nodes)


def grow_tree_by_frequency(path_counts: Mapping[RankPath, int], max_nodes: int) -> list[RankPath]:
    """``grow_tree`` with each path's value its measured frequency: how often every guess along it was right together.

    Exact where the independence of ``grow_tree_by_accuracy`` is not: when a head's
    first guess is right, the next head's usually is too.
    """
    below: dict[RankPath, list[RankPath]] = {}
    for path in path_counts:
        below.setdefault(path[:-1], []).append(path)
    return grow_tree(lambda parent: [(p, path_counts[p]) for p in below.get(parent, [])], max_nodes)


def expected_accepted_length(paths: Sequence[RankPath], rank_accuracy: Sequence[Sequence[float]]) -> float:
    """The expected accepted draft tokens of a rank-path tree with independent depths (``grow_tree_by_accuracy``)."""
    return sum(math.prod(rank_accuracy[d][r] if r < len(rank_accuracy[d]) else 0.0 for d, r in enumerate(p)) for p in paths)


def cartesian_paths(width: int, depth: int, max_nodes: int) -> list[RankPath]:
    """The top-``width`` Cartesian tree ``depth`` deep, cut to its first ``max_nodes`` nodes in breadth-first order."""
    paths: list[RankPath] = []
    level: list[RankPath] = [()]
    for _ in range(depth):
        level = [p + (r,) for p in level for r in range(width)]
        paths += level
    return paths[:max_nodes]
