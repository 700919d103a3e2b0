"""What crosses the proposer/verifier boundary: drafts, what a proposer is asked and shown, step results.

Everything here is a frozen dataclass; the contract proposers implement is ``core.proposer``.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from .devices import SeededGenerators
from .sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """A proposed token tree for one request; a chain is a tree with ``parents[i] = i - 1``.

    Args:
        token_ids: ``[n]`` long, proposed tokens, parents before children.
        parents: ``[n]`` long, index of each node's parent; -1 is the last committed token.
        draft_probs: ``[n, vocab]`` or None. Row i is the distribution token i was drawn
            from, processed like the target's (``logits_to_probs``), and conditioned on
            the siblings drawn before it: a proposer that samples siblings without
            replacement stores the renormalised remainder. None means a deterministic
            proposal (lookup, top-k children): the verifier treats each node as a point mass.
        source: which proposer drafted it, when one proposer holds several (a composite's
            member); the decoder counts steps and accepted tokens per source.
        scores: ``[n]`` or None: the draft's own confidence in each node, the probability it
            gave the node's token after the node's parent (the raw softmax for a
            deterministic node). The speculation controller calibrates these into
            acceptance estimates (``verify.controller``); None: the proposer has no such value.
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    source: str | None = None
    scores: list[float] | None = None

    @cached_property
    def num_nodes(self) -> int:
        """The nodes drafted (read once per draft: the decoder, the verifier and the controller all ask)."""
        return int(self.token_ids.shape[0])

    @staticmethod
    def empty() -> Draft:
        return _EMPTY_DRAFT

    @staticmethod
    def chain(
        token_ids: list[int] | torch.Tensor,
        draft_probs: torch.Tensor | None = None,
        source: str | None = None,
        scores: list[float] | None = None,
    ) -> Draft:
        """A linear draft: node i's parent is node i - 1."""
        if isinstance(token_ids, list):
            return Draft(long_tensor(token_ids), long_tensor(range(-1, len(token_ids) - 1)), draft_probs, source, scores)
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        return Draft(token_ids, torch.arange(-1, token_ids.shape[0] - 1), draft_probs, source, scores)

    def is_chain(self) -> bool:
        """Whether node i's parent is i - 1 for every node (computed once per draft: the decoder, the target and the cuts ask)."""
        known = self.__dict__.get("_chain")  # a frozen dataclass: cached as ``cached_property`` caches, in the instance's dict
        if known is None:
            known = self.__dict__["_chain"] = self.parent_list == list(range(-1, self.num_nodes - 1))
        return known

    @cached_property
    def parent_list(self) -> list[int]:
        """``parents`` as a Python list, converted once per draft (the verifier walks it)."""
        return self.parents.tolist()

    @cached_property
    def token_list(self) -> list[int]:
        """``token_ids`` as a Python list, converted once per draft (validation, the verifier and the controller read it)."""
        return self.token_ids.tolist()

    @cached_property
    def depth_list(self) -> list[int]:
        """Each node's depth (1 for the root's children), computed once per draft (``validate_draft`` computes it as it checks)."""
        return node_depths(self.parent_list)


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node: children of the root (-1) have depth 1."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def long_tensor(values) -> torch.Tensor:
    """A 1-D ``torch.long`` CPU tensor of the ints ``values``, through an ``array`` (a third of ``torch.tensor``'s time for a draft's few).

    Drafts are built every step, a few times: ``torch.tensor`` on a short list costs ~4 us,
    as much as the rest of the bookkeeping. Values an ``array('q')`` refuses go through ``torch.tensor``.
    """
    try:
        buffer = array("q", values)
    except (TypeError, OverflowError):
        return torch.tensor(list(values), dtype=torch.long)
    return torch.frombuffer(buffer, dtype=torch.long) if buffer else torch.zeros(0, dtype=torch.long)


_EMPTY_DRAFT = Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))


@dataclass(frozen=True)
class StopRule:
    """When a drafter may stop growing a path: the value the speculation controller gives a node, and the least it verifies.

    A node's value is its calibrated chance to be accepted given its parent was (``chance`` of
    its depth and its own draft confidence, ``Draft.scores``'s value) times its parent's
    value. A node worth less than ``least`` does not pay its row at a plain step's rate: the
    trim cuts it whatever else the draft holds (unless the step's drafting, spent by then,
    leaves the step slower than a plain one), and so every descendant (a child is never worth
    more than its parent): not expanding it saves the drafting of nodes the verifier would
    not see. ``level``: the least the leaves a drafter would expand at one depth are worth
    together for that depth's forward to pay (its row and its drafting, at a plain step's
    rate): a node's children are worth no more than it together (at most one of them is
    accepted), and so are the deeper levels, each costing as much again. Given only for
    drafts any subset of which keeps the target's law (temperature 0, point masses).
    """

    chance: Callable[[int, float | None], float]
    least: float
    level: float = 0.0

    def values(self, parents: list[int], depths: list[int], confidences: list, into: list[float]) -> None:
        """Append the values of the nodes after ``len(into)`` (parents first) to ``into``."""
        chance = self.chance
        for node in range(len(into), len(parents)):
            parent, value = parents[node], chance(depths[node], confidences[node])
            into.append(value * into[parent] if parent >= 0 else value)


@dataclass(frozen=True)
class ProposeContext:
    """What a proposer sees when asked for a draft.

    Args:
        tokens: every committed token so far (prompt + generated), the last one not yet
            scored by the target. The decoder's own list, valid during the call: copy
            what you keep.
        max_depth: the deepest node the verifier will keep (room left in the output and in
            the model's positions, or the speculation controller's depth for this step);
            deeper nodes are pruned, so a proposer saves work by drafting no deeper.
        max_width: the most children per node the verifier will keep this step (1: a chain;
            None: no limit), the speculation controller's choice of chain or tree. The later
            children of a node, in draft order, are dropped with their subtrees, so a tree
            proposer saves work by drafting no wider.
        sampling: the processing to apply to draft distributions.
        generator: the request's seeded generator on the device of the target's logits, for
            proposers that sample there (None: unseeded).
        generators: the request's generators on every device (``generator_for``).
        stop: the speculation controller's rule for stopping a path early (``StopRule``; None:
            draft as planned). A drafter that grows its draft node by node may leave a node
            worth less than ``stop.least`` unexpanded; ``proposers.core.dynamic_tree.grow_dynamic_tree``
            does, for its deterministic trees and chains.
    """

    tokens: list[int]
    max_depth: int
    sampling: SamplingParams
    generator: torch.Generator | None = None
    max_width: int | None = None
    generators: SeededGenerators | None = None
    stop: StopRule | None = None

    def generator_for(self, device: torch.device) -> torch.Generator | None:
        """The request's generator for draws on ``device`` (``torch.multinomial`` needs one on its rows' device).

        The target's own where the devices agree, else one seeded from the request's seed for that
        device; None for an unseeded request (torch's default generator of that device then draws).
        """
        if self.generators is not None:
            return self.generators.on(device)
        return self.generator


@dataclass(frozen=True)
class TargetFeatures:
    """Hidden states the target computed for some positions.

    Args:
        hidden_states: layer index -> ``[num_positions, hidden]``; the layers a proposer
            asked for through ``Proposer.hidden_layers`` (``-1`` is the final normed state
            that feeds the LM head).
    """

    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of verifying one draft.

    Args:
        accepted_nodes: indices of the accepted draft nodes, root to leaf.
        accepted_tokens: their token ids.
        next_token: the recovered token (sampled after a rejection) or the bonus token
            (when the accepted path ends where the draft had no further child).
        recovered: True when ``next_token`` replaced a rejected draft token.
    """

    accepted_nodes: list[int]
    accepted_tokens: list[int]
    next_token: int
    recovered: bool

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def committed(self) -> list[int]:
        return self.accepted_tokens + [self.next_token]


@dataclass(frozen=True)
class TransformersPeer:
    """transformers' own implementation of a proposer's method, which evaluation runs beside it.

    Args:
        name: the method's name in tables (``hf_assisted``, ``hf_prompt_lookup``); a row is
            named ``name[proposer row]``.
        generate_kwargs: the keyword arguments that select the method in
            ``model.generate`` (``{"assistant_model": draft}``, ``{"prompt_lookup_num_tokens": k, ...}``).
    """

    name: str
    generate_kwargs: dict[str, Any]
