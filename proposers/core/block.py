"""Drafts from per-position distributions: what a drafter that fills every depth in one forward proposes.

A block drafter (DFlash) or a parallel head (P-EAGLE) gives one distribution per depth,
none of which depends on the tokens drafted at the depths before it. From them:

- a chain: each depth's top token (a point mass), or, sampling, a token drawn from the
  depth's processed distribution, which is then the node's ``draft_probs`` row. The draws
  are independent of each other, so each node was drawn from its stated row given its
  ancestors, and the verifier's law is exact;
- a tree of point masses: each depth's top-``width`` tokens, combined best first by the
  product of their draft probabilities along the path (the expected acceptance under
  independence, ``core.static_tree.grow_tree_by_accuracy``) up to ``max_nodes`` nodes.
  Which deterministic nodes are proposed never changes what is lossless.
"""

from __future__ import annotations

import torch

from .devices import host_lists, reads_are_free
from .sampling import logits_to_probs
from .static_tree import grow_tree_by_accuracy
from .types import Draft, ProposeContext


def position_draft(
    logits: torch.Tensor,  # [depth, vocab] row d - 1: the distribution at depth d
    context: ProposeContext,
    width: int = 1,
    max_nodes: int | None = None,
    sample: bool = True,
) -> Draft:
    """The draft of per-depth ``logits``: a chain (``width`` 1, or the controller's ``max_width`` 1) or a top-``width`` tree.

    Args:
        logits: ``[depth, vocab]`` draft logits per depth (``-inf``: tokens it never drafts); cut to ``context.max_depth``.
        context: the step's limits, sampling and generator.
        width: tokens per depth a tree combines (1: a chain).
        max_nodes: a tree's node budget (None: ``depth * width``).
        sample: at temperature > 0, draw a chain's tokens (with ``draft_probs``); False: top tokens as point masses.
    """
    assert logits.dim() == 2, f"logits must be [depth, vocab], got {tuple(logits.shape)}"
    depth = min(logits.shape[0], context.max_depth)
    width = min(width, context.max_width or width)
    if depth < 1:
        return Draft.empty()
    logits = logits[:depth].float()
    if width == 1 and sample and not context.sampling.greedy:
        probs = logits_to_probs(logits, context.sampling, check=reads_are_free(logits.device))  # [depth, vocab]
        drawn = torch.multinomial(probs, 1, generator=context.generator_for(probs.device)).squeeze(1)  # each depth's, independently
        tokens, scores = host_lists(drawn, probs.gather(1, drawn[:, None]).squeeze(1))  # one read
        return Draft.chain(tokens, probs, scores=scores)
    top = torch.softmax(logits, dim=-1).topk(width, dim=-1)  # raw softmax: deterministic nodes' confidence, as in EAGLE-2
    indices, values = host_lists(top.indices, top.values)  # one read
    if width == 1:
        return Draft.chain([row[0] for row in indices], scores=[row[0] for row in values])
    paths = grow_tree_by_accuracy(values, max_nodes or depth * width)
    index = {path: node for node, path in enumerate(paths)}  # best first: every parent comes before its children
    draft = Draft(
        torch.tensor([indices[len(p) - 1][p[-1]] for p in paths], dtype=torch.long),
        torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=torch.long),
        scores=[values[len(p) - 1][p[-1]] for p in paths],
    )
    return draft
