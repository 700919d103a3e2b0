"""Draft trees: the one layer that every proposer and the verifier share.

- structure: validation, depths, paths, children, pruning;
- attention: the verifier's 4D mask for root + tree, the incremental mask that feeds some
  nodes of a growing tree into a draft model's own cache, position ids; both masks come
  from one ancestor computation (``node_paths``);
- (the dynamic tree builder of EAGLE-2 is in ``core.dynamic_tree``; static trees of rank
  paths, Medusa's ``medusa_choices``, in ``core.static_tree``; the KV-cache helpers that
  roll a cache back to an accepted path, in ``core.cache``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .types import Draft, long_tensor, node_depths

# -- structure -------------------------------------------------------------------------


def validate_draft(draft: Draft, vocab_size: int, check_probs: bool = True) -> None:
    """Raise ValueError unless ``draft`` is a well-formed tree over ``vocab_size`` tokens.

    Checks shapes and dtypes, that every parent comes before its child (which rules out
    cycles), that token ids are in the vocabulary, and that draft probabilities are
    finite, non-negative and sum to 1 with positive mass on each proposed token.

    Args:
        check_probs: check the values of ``draft_probs`` here (a read by the host); False leaves
            that to the caller (on a GPU the verifier folds it into its own read:
            ``draft_probs_valid``, then ``check_draft_probs`` to name the fault).
    """
    tokens, parents = draft.token_ids, draft.parents
    if tokens.dim() != 1 or parents.shape != tokens.shape:
        raise ValueError(f"draft token_ids and parents must both be [n]; got {tuple(tokens.shape)} and {tuple(parents.shape)}")
    if tokens.dtype != torch.long or parents.dtype != torch.long:
        raise ValueError(f"draft token_ids and parents must be torch.long; got {tokens.dtype} and {parents.dtype}")
    depths: list[int] = []  # computed as the parents are checked: the cuts, the controller and the position ids read them
    for i, p in enumerate(draft.parent_list):  # a Python loop: drafts are small, and tensor ops cost more per call
        if not -1 <= p < i:
            raise ValueError(
                f"draft node {i} has parent {p}: a parent must be -1 (the last committed token) or an earlier node in 0..{i - 1}"
            )
        depths.append(1 if p < 0 else depths[p] + 1)
    draft.__dict__.setdefault("depth_list", depths)  # ``Draft.depth_list``'s cache
    token_list = draft.token_list
    if token_list and not (0 <= min(token_list) and max(token_list) < vocab_size):
        i = next(i for i, t in enumerate(token_list) if not 0 <= t < vocab_size)
        raise ValueError(f"draft node {i} has token id {token_list[i]}, outside the vocabulary [0, {vocab_size})")
    if draft.scores is not None and len(draft.scores) != len(token_list):
        raise ValueError(f"draft scores must hold one value per node ({len(token_list)}), got {len(draft.scores)}")
    if draft.draft_probs is not None:
        n = len(token_list)
        if tuple(draft.draft_probs.shape) != (n, vocab_size):
            raise ValueError(f"draft_probs must be [num_nodes, vocab] = [{n}, {vocab_size}], got {tuple(draft.draft_probs.shape)}")
        if check_probs:
            check_draft_probs(draft.draft_probs, tokens)


def draft_probs_valid(draft_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor, not read: whether ``draft_probs`` ``[n, vocab]`` pass ``check_draft_probs`` for ``tokens`` ``[n]``."""
    sums = draft_probs.sum(dim=-1, dtype=torch.float64)
    chosen = draft_probs.gather(1, tokens.to(draft_probs.device)[:, None])
    return torch.isfinite(draft_probs).all() & (draft_probs >= 0).all() & ((sums - 1).abs() <= 1e-3).all() & (chosen > 0).all()


def check_draft_probs(draft_probs: torch.Tensor, tokens: torch.Tensor) -> None:
    """Raise ValueError naming the fault unless each row of ``draft_probs`` is a distribution with mass on its node's token."""
    tokens = tokens.to(draft_probs.device)
    if not torch.isfinite(draft_probs).all():
        raise ValueError("draft_probs contain NaN or inf")
    if (draft_probs < 0).any():
        raise ValueError(f"draft_probs contain negative values (min {float(draft_probs.min()):.3g})")
    sums = draft_probs.sum(dim=-1, dtype=torch.float64)
    worst = int((sums - 1).abs().argmax())
    if abs(float(sums[worst]) - 1) > 1e-3:
        raise ValueError(f"draft_probs row {worst} sums to {float(sums[worst]):.6f}, not 1")
    chosen = draft_probs.gather(1, tokens[:, None]).squeeze(1)
    zero = (chosen <= 0).nonzero()
    if len(zero):
        i = int(zero[0])
        raise ValueError(
            f"draft node {i} proposes token {int(tokens[i])} whose draft probability is 0: it cannot have been drawn from draft_probs[{i}]"
        )


def node_paths(parents: list[int]) -> list[list[int]]:
    """Each node's path: node indices from a child of the root down to the node (inclusive).

    The one ancestor computation of this module: both attention masks derive from it.
    """
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append(paths[p] + [i] if p >= 0 else [i])
    return paths


def children_lists(parents: list[int]) -> list[list[int]]:
    """``children[p + 1]`` lists the children of node p in draft order (index 0 is the root)."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        children[p + 1].append(i)
    return children


def prune_depth(draft: Draft, max_depth: int) -> Draft:
    """Drop the nodes deeper than ``max_depth``, renumbering the parents of those kept."""
    depths = draft.depth_list
    if not depths or max(depths) <= max_depth:
        return draft
    return keep_nodes(draft, [i for i, d in enumerate(depths) if d <= max_depth])


def keep_nodes(draft: Draft, keep: list[int]) -> Draft:
    """The sub-draft of the nodes ``keep`` (ascending, closed under ancestors), parents renumbered."""
    if not keep:
        return Draft.empty()
    parents, tokens = draft.parent_list, draft.token_list  # small lists: cheaper than tensor indexing
    k = len(keep)
    if keep[-1] == k - 1:  # the first k nodes (ascending, distinct): the parents keep their numbers, and slices are views
        probs = draft.draft_probs[:k] if draft.draft_probs is not None else None
        scores = draft.scores[:k] if draft.scores is not None else None
        kept = Draft(draft.token_ids[:k], draft.parents[:k], probs, draft.source, scores)
        kept.__dict__["parent_list"], kept.__dict__["token_list"] = parents[:k], tokens[:k]
        if "depth_list" in draft.__dict__:  # a node kept with its ancestors keeps its depth
            kept.__dict__["depth_list"] = draft.depth_list[:k]
        return kept
    new_index = {old: new for new, old in enumerate(keep)}
    new_parents = [new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep]
    probs = draft.draft_probs
    if probs is not None:
        probs = probs.index_select(0, torch.tensor(keep, dtype=torch.long, device=probs.device))
    scores = [draft.scores[i] for i in keep] if draft.scores is not None else None
    new_tokens = [tokens[i] for i in keep]
    kept = Draft(long_tensor(new_tokens), long_tensor(new_parents), probs, draft.source, scores)
    kept.__dict__["parent_list"] = new_parents  # the cached lists, known already (a frozen dataclass's cached_property slots)
    kept.__dict__["token_list"] = new_tokens
    if "depth_list" in draft.__dict__:
        depths = draft.depth_list
        kept.__dict__["depth_list"] = [depths[i] for i in keep]
    return kept


def limit_width(draft: Draft, max_width: int | None) -> Draft:
    """``draft`` with each node's first ``max_width`` children only (in draft order) and their subtrees; None: as is.

    A node's place among its siblings depends only on the siblings drawn before it, never
    on its own value, and the verifier tests siblings in that order; so the cut, decided
    before the draft was drawn, keeps a sampled tree's law.
    """
    if max_width is None or draft.num_nodes == 0 or draft.is_chain():
        return draft
    parents = draft.parent_list
    children = [0] * (draft.num_nodes + 1)  # children seen so far per parent (index -1: the root's)
    kept = [False] * draft.num_nodes
    keep = []
    for node, parent in enumerate(parents):
        if parent >= 0 and not kept[parent]:
            continue
        children[parent] += 1
        if children[parent] <= max_width:
            kept[node] = True
            keep.append(node)
    return draft if len(keep) == draft.num_nodes else keep_nodes(draft, keep)


def merge_drafts(drafts: list[Draft], max_nodes: int, source: str | None = None) -> Draft:
    """The union of several trees as one trie (equal token paths merged), earlier drafts first, at most ``max_nodes`` nodes.

    Every node becomes a point mass (``draft_probs`` None): a token verified as a point
    mass keeps the target's law however it was chosen, so the union stays exact even
    when a member sampled its tokens (its acceptance is then p(x) instead of min(1, p/q)).
    A node is kept only when its parent was.
    """
    token_ids: list[int] = []
    parents: list[int] = []
    child_of: dict[tuple[int, int], int] = {}
    for draft in drafts:
        where: list[int] = []  # this draft's node -> merged node (-2: dropped)
        for token, parent in zip(draft.token_list, draft.parent_list, strict=True):
            merged_parent = where[parent] if parent >= 0 else -1
            node = child_of.get((merged_parent, token), -2) if merged_parent != -2 else -2
            if node == -2 and merged_parent != -2 and len(token_ids) < max_nodes:
                node = child_of[(merged_parent, token)] = len(token_ids)
                token_ids.append(token)
                parents.append(merged_parent)
            where.append(node)
    return Draft(torch.tensor(token_ids, dtype=torch.long), torch.tensor(parents, dtype=torch.long), None, source)


# -- attention masks and positions -------------------------------------------------------


def tree_attention_mask(
    parents: list[int], past_len: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> torch.Tensor:
    """The verifier's 4D additive mask ``[1, 1, n + 1, past_len + n + 1]`` for scoring root + tree.

    The cache holds ``past_len`` positions; the root (the last committed token) and the
    ``n`` nodes are fed in one forward, the root first. 0 where a position may attend (the
    whole cached prefix, its ancestors and itself), ``-inf`` (the dtype's minimum) elsewhere.
    Built on ``device`` (the model's; None: the CPU).
    """
    columns = [[0]] + [[0] + [j + 1 for j in path] for path in node_paths(parents)]
    return _additive_mask(columns, past_len, len(parents) + 1, dtype, device)


def incremental_tree_mask(
    parents: list[int],
    cached: list[int],
    nodes: list[int],
    prefix_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The 4D additive mask ``[1, 1, m, prefix_len + len(cached) + m]`` for feeding ``nodes`` of a growing tree.

    A draft model's cache holds ``prefix_len`` committed tokens (the root last), then the
    tree nodes ``cached`` in that order; ``nodes`` (m of them) are fed after them. A node
    sees the committed prefix, its ancestors and itself. Feeding the whole tree at once
    (``cached=[]``, ``nodes=range(n)``) gives the node rows of ``tree_attention_mask``,
    with the root counted in the prefix.

    Args:
        parents: ``[n]`` parent of each tree node so far (-1: the root).
        cached: tree nodes already in the cache, in cache order; they must include every
            ancestor of ``nodes`` (a KeyError names a missing one).
        nodes: the tree nodes to feed, in input order.
    """
    column = {node: k for k, node in enumerate(cached + nodes)}
    paths = node_paths(parents)
    columns = [[column[j] for j in paths[node]] for node in nodes]
    return _additive_mask(columns, prefix_len, len(column), dtype, device)


def _additive_mask(columns: list[list[int]], prefix_len: int, width: int, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    """``[1, 1, rows, prefix_len + width]``: 0 on the prefix and at ``prefix_len + c`` for c in ``columns[row]``, else the dtype's min.

    One fill per mask, not one per entry: this runs once per draft depth and per verification. Made on
    ``device``, where only the allowed entries' indices are copied to (not the mask, which grows with the prefix).
    """
    rows, total = len(columns), prefix_len + width
    allowed = [row * total + prefix_len + c for row, cs in enumerate(columns) for c in cs]
    mask = torch.full((rows, total), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[:, :prefix_len] = 0.0
    mask.view(-1).index_fill_(0, torch.tensor(allowed, dtype=torch.long, device=device), 0.0)
    return mask.view(1, 1, rows, total)


def tree_position_ids(parents: list[int], past_len: int, device: torch.device | None = None, depths: list[int] | None = None) -> Tensor:
    """``[1, n + 1]`` position ids on ``device``: the root at ``past_len``, a node at ``past_len + depth`` (``depths``, if known)."""
    return torch.tensor([[past_len] + [past_len + d for d in (depths or node_depths(parents))]], device=device)
