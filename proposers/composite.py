"""Composite proposers: several proposers behind one, chosen or merged per step.

Model-free lookup is nearly free and, when it matches, drafts long; a learned draft wins
on new text. A composite asks its members in order (``first_confident``: the first member
that drafts at all, each member deciding by its own threshold or match, drafts the step),
or takes the union of their trees under a node budget (``merge``). Every member sees every
``begin`` / ``observe``, so each keeps its own state whether or not it drafted; each draft
names its member (``Draft.source``), which the decoder's stats count per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from .core.errors import InputError
from .core.models import output_vocab_size
from .core.proposer import ProposerBase
from .core.tree import merge_drafts
from .core.types import Draft, ProposeContext, TargetFeatures, VerifyResult
from .registry import load_proposer

POLICIES = ("first_confident", "merge")


class CompositeProposer(ProposerBase):
    """Draft with the first confident member, or with the union of the members' trees.

    Args:
        proposers: the members' configs (``{"type": ..., ...}`` each), asked in this order.
        policy: ``first_confident`` (default): the first member whose draft is not empty
            drafts the step (a lookup that matched, a suffix tree whose score passed its
            ``min_score``, a model draft); ``merge``: the union of every member's tree,
            shared prefixes merged, earlier members first.
        max_nodes: ``merge``'s node budget (default: the sum of the members' trees).
        target, tokenizer: passed on to the members.
    """

    def __init__(
        self,
        proposers: list[dict[str, Any]],
        policy: str = "first_confident",
        max_nodes: int | None = None,
        target=None,
        tokenizer=None,
    ):
        if not isinstance(proposers, list) or not proposers:
            raise InputError("proposers must be a non-empty list of proposer configs ({type: ..., ...} each)")
        if policy not in POLICIES:
            raise InputError(f"unknown composite policy {policy!r}; available: {list(POLICIES)}")
        if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1):
            raise InputError(f"max_nodes must be an integer >= 1 or null, got {max_nodes!r}")
        for i, member in enumerate(proposers):
            if not isinstance(member, Mapping) or "type" not in member:
                raise InputError(f"proposers[{i}] must be a proposer config with a 'type' key, got {member!r}")
        self.members = [load_proposer(dict(member), target=target, tokenizer=tokenizer) for member in proposers]
        kinds = [str(member["type"]) for member in proposers]
        self.names = [kind if kinds.count(kind) == 1 else f"{kind}#{i}" for i, kind in enumerate(kinds)]
        self.vocab_size = _common_vocab_size(self.names, self.members, target)
        self.policy, self.max_nodes = policy, max_nodes
        self.hidden_layers = tuple(sorted({layer for member in self.members for layer in member.hidden_layers}))

    def begin(self, prompt: list[int], features: TargetFeatures | None) -> None:
        for member in self.members:
            member.begin(prompt, features)

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        for member in self.members:
            member.observe(result, features)

    def draft_depth(self) -> int | None:
        depths = [member.draft_depth() for member in self.members]
        return None if None in depths else max(depths)

    def draft_width(self) -> int:
        widths = [member.draft_width() for member in self.members]
        return max(widths) if self.policy == "first_confident" else sum(widths)  # merged drafts: a trie of every member's

    def reset(self) -> None:
        """Reset every member that keeps state across requests."""
        for member in self.members:
            member.reset()

    def propose(self, context: ProposeContext) -> Draft:
        if context.stop is not None:  # a member's draft is calibrated under its name (or merged, unscored): not the rule's
            context = replace(context, stop=None)
        if self.policy == "first_confident":
            for name, member in zip(self.names, self.members, strict=True):
                draft = member.propose(context)
                if draft.num_nodes:
                    return replace(draft, source=name)
            return Draft.empty()
        drafts = [(name, member.propose(context)) for name, member in zip(self.names, self.members, strict=True)]
        drafts = [(name, draft) for name, draft in drafts if draft.num_nodes]
        if not drafts:
            return Draft.empty()
        if len(drafts) == 1:  # one tree as it is, draft distributions kept
            name, draft = drafts[0]
            return replace(draft, source=name)
        budget = self.max_nodes if self.max_nodes is not None else sum(draft.num_nodes for _, draft in drafts)
        return merge_drafts([draft for _, draft in drafts], budget, "+".join(name for name, _ in drafts))


def _common_vocab_size(names: list[str], members: list, target) -> int | None:
    """The members' vocabulary size (the target's when given); InputError when two differ."""
    sizes = {name: member.vocab_size for name, member in zip(names, members, strict=True)}
    if target is not None:
        sizes = {"target": output_vocab_size(target), **sizes}
    known = {name: size for name, size in sizes.items() if size is not None}
    if len(set(known.values())) > 1:
        listing = ", ".join(f"{name}: {size}" for name, size in known.items())
        raise InputError(f"composite members' vocabularies differ ({listing}): every member must use the target's tokenizer")
    return next(iter(known.values()), None)
