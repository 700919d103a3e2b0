"""The rejection sampler: which draft tokens to keep, and the token that follows them.

Vocabulary (from vLLM's sampler): *accepted* draft tokens, a *recovered* token sampled
after a rejection, a *bonus* token sampled when the accepted path has no further child.

Temperature 0 has its own branch (longest path matching the target argmax). Otherwise
this is speculative sampling (Leviathan et al. 2023; Chen et al. 2023) generalised to
trees by recursive rejection over each node's children (SpecInfer, Miao et al. 2024;
Jeon et al. 2024): after a child is rejected the target distribution is replaced by the
residual ``norm(max(target_probs - draft_probs, 0))`` and the next sibling is tested
against that residual. Each sibling carries the distribution it was actually drawn from
(point mass, i.i.d. or without replacement), so one rule covers every proposer and the
emitted tokens follow the target distribution exactly.
"""

from __future__ import annotations

import torch

from draftsmith.proposers.core.sampling import SamplingParams, logits_to_probs
from draftsmith.proposers.core.tree import children_lists
from draftsmith.proposers.core.types import Draft, VerifyResult


def rejection_sample(
    draft: Draft,
    target_logits: torch.Tensor,  # [num_nodes + 1, vocab]: row 0 the root, row i + 1 node i
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Verify ``draft`` against the target's logits at the root and at every node.

    Args:
        draft: the proposed tree (validated by the caller with ``validate_draft``).
        target_logits: ``[n + 1, vocab]`` raw target logits; row 0 scores the children of
            the root, row i + 1 the children of node i.
        sampling: temperature / top-k / top-p, applied to the target exactly as the
            proposer applied them to ``draft.draft_probs``.
        generator: seeded generator for the acceptance tests and the final sample.
    """
    assert target_logits.dim() == 2 and target_logits.shape[0] == draft.num_nodes + 1, (
        f"target_logits must be [num_nodes + 1, vocab], got {tuple(target_logits.shape)} for {draft.num_nodes} nodes"
    )
    if sampling.greedy:
        return greedy_accept(draft, target_logits.argmax(dim=-1).tolist())
    return speculative_sample(draft, logits_to_probs(target_logits, sampling), generator)


def greedy_accept(draft: Draft, target_argmax: list[int]) -> VerifyResult:
    """Temperature 0: follow the children whose token equals the target argmax at their parent.

    Args:
        target_argmax: ``[n + 1]`` argmax at the root and at every node.
    """
    tokens = draft.token_list
    children = children_lists(draft.parent_list)
    path: list[int] = []
    node = -1
    while True:
        want = target_argmax[node + 1]
        match = next((c for c in children[node + 1] if tokens[c] == want), None)
        if match is None:
            return VerifyResult(path, [tokens[i] for i in path], want, recovered=bool(children[node + 1]))
        path.append(match)
        node = match


def speculative_sample(
    draft: Draft,
    target_probs: torch.Tensor,  # [num_nodes + 1, vocab], processed
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Temperature > 0: recursive rejection sampling down the tree (a chain is the 1-child case)."""
    tokens = draft.token_list
    children = children_lists(draft.parent_list)
    draft_probs = draft.draft_probs  # [num_nodes, vocab] or None (point masses)
    path: list[int] = []
    node = -1
    target_row = target_probs[0]
    while True:
        for child in children[node + 1]:
            token = tokens[child]
            child_probs = None if draft_probs is None else draft_probs[child]
            draft_p = 1.0 if child_probs is None else float(child_probs[token])
            # Accept with probability min(1, target(x) / draft(x)).
            if float(torch.rand((), generator=generator)) * draft_p < float(target_row[token]):
                path.append(child)
                node = child
                target_row = target_probs[child + 1]
                break
            target_row = residual_distribution(target_row, child_probs, token)
        else:
            next_token = int(torch.multinomial(target_row, 1, generator=generator))
            return VerifyResult(path, [tokens[i] for i in path], next_token, recovered=bool(children[node + 1]))


def residual_distribution(
    target_probs: torch.Tensor,  # [vocab]
    draft_probs: torch.Tensor | None,  # [vocab], or None for a point mass on token
    token: int,
) -> torch.Tensor:
    """``norm(max(target_probs - draft_probs, 0))``: what to sample from after rejecting ``token``."""
    if draft_probs is None:
        residual = target_probs.clone()
        residual[token] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp_(min=0.0)
    total = residual.sum()
    # A zero residual means target_probs == draft_probs, where a rejection has probability
    # 0; float rounding can still land here, and the target itself is then the right law.
    if total <= 0:
        return target_probs
    return residual / total
