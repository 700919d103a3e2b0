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

Two forms of one sampler: on a CPU (``speculative_sample``) the host reads each test as it
goes and stops at the first accepted child; on a GPU, where every read waits for the
device, ``speculative_sample_on_device`` tests every node at once and the host reads the
outcome once per step.
"""

from __future__ import annotations

import torch

from draftsmith.proposers.core.devices import reads_are_free
from draftsmith.proposers.core.sampling import SamplingParams, draw_rows, logits_to_probs
from draftsmith.proposers.core.tree import check_draft_probs, children_lists, draft_probs_valid
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
        generator: seeded generator for the acceptance tests and the final sample, on
            ``target_logits``' device.
    """
    assert target_logits.dim() == 2 and target_logits.shape[0] == draft.num_nodes + 1, (
        f"target_logits must be [num_nodes + 1, vocab], got {tuple(target_logits.shape)} for {draft.num_nodes} nodes"
    )
    if sampling.greedy:
        return greedy_accept(draft, target_logits.argmax(dim=-1).tolist())
    if reads_are_free(target_logits.device):
        return speculative_sample(draft, logits_to_probs(target_logits, sampling), generator)
    # the rows' check rides on the sampler's one read: a check of its own would be a sync more
    return speculative_sample_on_device(draft, logits_to_probs(target_logits, sampling, check=False), generator)


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
    """Temperature > 0: recursive rejection sampling down the tree (a chain is the 1-child case), read node by node."""
    tokens = draft.token_list
    children = children_lists(draft.parent_list)
    draft_probs = draft.draft_probs  # [num_nodes, vocab] or None (point masses)
    path: list[int] = []
    node = -1
    target_row = target_probs[0]
    while True:
        for child in children[node + 1]:
            token = tokens[child]
            child_probs = None if draft_probs is None else draft_probs[child].to(target_row.device)
            draft_p = 1.0 if child_probs is None else float(child_probs[token])
            # Accept with probability min(1, target(x) / draft(x)).
            if float(torch.rand((), generator=generator, device=target_row.device)) * draft_p < float(target_row[token]):
                path.append(child)
                node = child
                target_row = target_probs[child + 1]
                break
            target_row = residual_distribution(target_row, child_probs, token)
        else:
            next_token = int(torch.multinomial(target_row, 1, generator=generator))
            return VerifyResult(path, [tokens[i] for i in path], next_token, recovered=bool(children[node + 1]))


def speculative_sample_on_device(
    draft: Draft,
    target_probs: torch.Tensor,  # [num_nodes + 1, vocab], processed
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """``speculative_sample``'s law with one read by the host per step (for a GPU, where each read is a sync).

    Every node that could be tested is tested at once, on the probabilities' device: each
    tested node's uniform, each parent's residual after each of its children in turn, a
    recovered token drawn from every parent's last residual and a bonus token from every
    node without children. The host then reads the outcome once (one sync per step) and
    walks the tree. A node's test, and a parent's rows, depend only on that node's parent
    row and its earlier siblings, exactly as if the walk had stopped there, so the law is
    the sequential sampler's; the draws the walk never reaches are discarded.

    Args:
        draft: the tree; ``draft_probs`` (if any) may sit on another device (moved here).
        target_probs: ``[n + 1, vocab]`` processed target rows (``logits_to_probs``).
        generator: on ``target_probs``' device (None: torch's default there).
    """
    tokens, parents = draft.token_list, draft.parent_list
    children = children_lists(parents)
    device = target_probs.device
    heads = [p for p in range(-1, len(tokens)) if children[p + 1]]  # nodes whose children are tested (-1: the root)
    ends = [p for p in range(-1, len(tokens)) if not children[p + 1]]  # where an accepted path gets a bonus token
    accepted = torch.zeros(0, dtype=torch.long, device=device)
    if heads:
        layout = _Layout(children, heads, ends, tokens, device)
        rows = target_probs.index_select(0, layout.rows)  # [heads + ends, vocab]
        accepted, draws = _test_children(draft, layout, rows[: len(heads)], generator)
        rows = torch.cat([draws, rows[len(heads) :]])
    else:
        rows = target_probs[:1]  # a plain step's one row
    # a row that is not a distribution (NaN logits) is drawn from anyway and refused after the read: the draw never fails on a device
    total = rows.sum(-1)
    picks, invalid = draw_rows(torch.where(total[:, None] > 0, rows, 1.0), generator), ~(total.min() > 0)
    # the draft's rows are checked on the same read (the decoder leaves their check to it on a GPU: validate_draft)
    bad_draft = ~draft_probs_valid(draft.draft_probs, draft.token_ids) if draft.draft_probs is not None else torch.zeros_like(invalid)
    outcome = torch.cat([accepted, picks, invalid.view(1), bad_draft.view(1)]).tolist()  # the step's one read by the host
    if outcome[-1]:
        check_draft_probs(draft.draft_probs, draft.token_ids)  # names the fault
    if outcome[-2]:
        raise ValueError("the target's distribution has NaN / inf or no mass (every token masked): there is no distribution to sample from")
    chosen, picks = outcome[: len(heads)], outcome[len(heads) : -2]
    path: list[int] = []
    node = -1
    while children[node + 1]:
        j = chosen[heads.index(node)]
        if j < 0:  # every child rejected: the recovered token from the last residual
            return VerifyResult(path, [tokens[i] for i in path], picks[heads.index(node)], recovered=True)
        node = children[node + 1][j]
        path.append(node)
    return VerifyResult(path, [tokens[i] for i in path], picks[len(heads) + ends.index(node)], recovered=False)


class _Layout:
    """The tree as the device form reads it, copied to the device in one piece: the target rows of the heads and ends
    ``[heads + ends]``, and per head its children's tokens, node ids and presence ``[heads, width]`` (padded)."""

    def __init__(self, children: list[list[int]], heads: list[int], ends: list[int], tokens: list[int], device: torch.device):
        self.width = width = max(len(children[p + 1]) for p in heads)
        nodes = [children[p + 1] + [-1] * (width - len(children[p + 1])) for p in heads]  # -1: padding
        flat = [p + 1 for p in heads + ends]
        for values in ([[tokens[c] if c >= 0 else 0 for c in row] for row in nodes], [[max(c, 0) for c in row] for row in nodes]):
            flat += [v for row in values for v in row]
        flat += [int(c >= 0) for row in nodes for c in row]
        self.full = all(c >= 0 for row in nodes for c in row)  # every head has ``width`` children: no masking
        layout = torch.tensor(flat, dtype=torch.long, device=device)
        count, cells = len(heads) + len(ends), len(heads) * width
        self.rows = layout[:count]
        parts = [layout[count + k * cells : count + (k + 1) * cells].view(len(heads), width) for k in range(3)]
        self.tokens, self.nodes, self.present = parts


def _test_children(draft: Draft, layout: _Layout, rows: torch.Tensor, generator):
    """For each head (a row of ``rows`` ``[heads, vocab]``), its children tested in draft order against the residual left
    by the earlier ones: the first accepted child's rank (-1: none) ``[heads]``, and each head's last residual ``[heads, vocab]``."""
    device, heads = rows.device, rows.shape[0]
    uniforms = torch.rand(heads, layout.width, generator=generator, device=device)
    draft_probs = draft.draft_probs.to(device) if draft.draft_probs is not None else None
    first = torch.full((heads,), -1, dtype=torch.long, device=device)
    for j in range(layout.width):
        token = layout.tokens[:, j]
        child_rows = draft_probs.index_select(0, layout.nodes[:, j]) if draft_probs is not None else None  # [heads, vocab]
        draft_p = child_rows.gather(1, token[:, None]).squeeze(1) if child_rows is not None else 1.0
        # Accept with probability min(1, target(x) / draft(x)), x tested against the residual its earlier siblings left.
        accept = uniforms[:, j] * draft_p < rows.gather(1, token[:, None]).squeeze(1)
        if not layout.full:
            accept &= layout.present[:, j].bool()
        first = torch.where((first < 0) & accept, j, first)
        residual = residual_distribution(rows, child_rows, token)
        rows = residual if layout.full else torch.where(layout.present[:, j, None].bool(), residual, rows)
    return first, rows


def residual_distribution(
    target_probs: torch.Tensor,  # [vocab], or [rows, vocab]
    draft_probs: torch.Tensor | None,  # like target_probs, or None for a point mass on token
    token: int | torch.Tensor,  # or [rows] long: each row's token
) -> torch.Tensor:
    """``norm(max(target_probs - draft_probs, 0))``: what to sample from after rejecting ``token`` (row by row)."""
    if isinstance(token, int):  # one row, read by the host (the CPU's form)
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
    residual = target_probs.scatter(-1, token[:, None], 0.0) if draft_probs is None else (target_probs - draft_probs).clamp_(min=0.0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total, target_probs)  # as above, without a read
