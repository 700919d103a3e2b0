"""Draft-tree utilities: validation, depths, attention masks, paths, pruning."""

from __future__ import annotations

import torch

from .base import Draft


def validate_draft(draft: Draft, vocab_size: int) -> None:
    """Raise ValueError unless ``draft`` is a well-formed tree over ``vocab_size`` tokens.

    Checks shapes and dtypes, that every parent comes before its child (which rules out
    cycles), that token ids are in the vocabulary, and that draft probabilities are
    finite, non-negative and sum to 1 with positive mass on each proposed token.
    """
    tokens, parents = draft.token_ids, draft.parents
    if tokens.dim() != 1 or parents.shape != tokens.shape:
        raise ValueError(f"draft token_ids and parents must both be [n]; got {tuple(tokens.shape)} and {tuple(parents.shape)}")
    if tokens.dtype != torch.long or parents.dtype != torch.long:
        raise ValueError(f"draft token_ids and parents must be torch.long; got {tokens.dtype} and {parents.dtype}")
    parent_list = draft.parent_list
    for i, p in enumerate(parent_list):  # a Python loop: drafts are small, and tensor ops cost more per call
        if not -1 <= p < i:
            raise ValueError(
                f"draft node {i} has parent {p}: a parent must be -1 (the last committed token) or an earlier node in 0..{i - 1}"
            )
    token_list = tokens.tolist()
    if token_list and not (0 <= min(token_list) and max(token_list) < vocab_size):
        i = next(i for i, t in enumerate(token_list) if not 0 <= t < vocab_size)
        raise ValueError(f"draft node {i} has token id {token_list[i]}, outside the vocabulary [0, {vocab_size})")
    if draft.draft_probs is not None:
        _validate_probs(draft.draft_probs, tokens, vocab_size)


def _validate_probs(draft_probs: torch.Tensor, tokens: torch.Tensor, vocab_size: int) -> None:
    n = tokens.shape[0]
    if tuple(draft_probs.shape) != (n, vocab_size):
        raise ValueError(f"draft_probs must be [num_nodes, vocab] = [{n}, {vocab_size}], got {tuple(draft_probs.shape)}")
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


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node: children of the root (-1) have depth 1."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """``[n + 1, n + 1]`` bool; entry (i, j) is True when position j is i itself or an ancestor.

    Position 0 is the root (the last committed token, not yet in the cache); position
    i + 1 is draft node i.
    """
    n = len(parents)
    anc = torch.eye(n + 1, dtype=torch.bool)
    anc[1:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i + 1] |= anc[p + 1]
            anc[i + 1, i + 1] = True
    return anc


def tree_attention_mask(parents: list[int], past_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 4D additive mask ``[1, 1, n + 1, past_len + n + 1]`` for scoring root + tree.

    0 where a position may attend (the whole cached prefix, its ancestors and itself),
    ``-inf`` (the dtype's minimum) elsewhere.
    """
    anc = ancestor_matrix(parents)
    rows = anc.shape[0]
    mask = torch.zeros(1, 1, rows, past_len + rows, dtype=dtype)
    mask[0, 0, :, past_len:].masked_fill_(~anc, torch.finfo(dtype).min)
    return mask


def tree_position_ids(parents: list[int], past_len: int) -> torch.Tensor:
    """``[1, n + 1]`` position ids: the root sits at ``past_len``, a node at ``past_len + depth``."""
    return torch.tensor([[past_len] + [past_len + d for d in node_depths(parents)]])


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (inclusive)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def children_lists(parents: list[int]) -> list[list[int]]:
    """``children[p + 1]`` lists the children of node p in draft order (index 0 is the root)."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        children[p + 1].append(i)
    return children


def prune_depth(draft: Draft, max_depth: int) -> Draft:
    """Drop the nodes deeper than ``max_depth``, renumbering the parents of those kept."""
    parents = draft.parent_list
    depths = node_depths(parents)
    if not depths or max(depths) <= max_depth:
        return draft
    keep = [i for i, d in enumerate(depths) if d <= max_depth]
    if not keep:
        return Draft.empty()
    new_index = {old: new for new, old in enumerate(keep)}
    new_parents = torch.tensor([new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep], dtype=torch.long)
    keep_t = torch.tensor(keep, dtype=torch.long)
    probs = draft.draft_probs.index_select(0, keep_t) if draft.draft_probs is not None else None
    return Draft(draft.token_ids.index_select(0, keep_t), new_parents, probs)
