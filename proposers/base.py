"""What crosses the proposer/verifier boundary: drafts, sampling settings, step results.

Everything here is a frozen dataclass or a Protocol; proposers import only this module
(plus torch / transformers), and ``verify`` builds on it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import torch


class InputError(ValueError):
    """Bad input from a user: an argument, a config key, a file or a command-line value.

    The message is one line that names the offending argument, key or file and says what
    is allowed. The command line prints it without a traceback (exit code 2); every other
    exception is a bug and keeps its traceback.
    """


@dataclass(frozen=True)
class SamplingParams:
    """How next-token distributions are processed, identically for target and draft.

    Args:
        temperature: 0 selects greedy decoding (its own branch); a finite value > 0 divides the logits.
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: keep the smallest set of tokens whose mass reaches top_p; 1.0 keeps all.

    Numpy scalars are accepted and stored as Python numbers; anything else that is not a
    real number (an integer for ``top_k``) is an ``InputError``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        temperature = check_real("temperature", self.temperature)
        top_p = check_real("top_p", self.top_p)
        top_k = check_integer("top_k", self.top_k)
        # ``not x >= 0`` also refuses NaN; inf would sample uniformly, ignoring top-k / top-p.
        if not 0.0 <= temperature < math.inf:
            raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1] (1 = no top-p), got {self.top_p!r}")
        if top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = no top-k), got {self.top_k!r}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_real(name: str, value: Any) -> float:
    """``value`` as a float when it is a real number (int, float, numpy scalar; not bool); else an InputError naming ``name``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int beyond float range: let the range checks refuse it
            return math.inf if value > 0 else -math.inf
    raise InputError(f"{name} must be a real number (int or float), got {value!r} ({type(value).__name__})")


def check_probability(name: str, value: Any) -> float | None:
    """``value`` as a float in [0, 1), or None; else an InputError naming ``name`` (a threshold on draft probabilities)."""
    if value is None:
        return None
    if not 0.0 <= check_real(name, value) < 1.0:
        raise InputError(f"{name} must be in [0, 1) or None, got {value!r}")
    return float(value)


def check_integer(name: str, value: Any) -> int:
    """``value`` as an int when it is an integer (int, numpy integer; not bool, not float); else an InputError naming ``name``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise InputError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")


def logits_to_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Turn logits into the processed sampling distribution (temperature, top-k, top-p).

    The same function serves the target and every proposer, so draft and target
    distributions are processed exactly alike. At temperature 0 the result is the
    point mass on the argmax.

    Args:
        logits: ``[..., vocab]`` raw logits; ``-inf`` marks forbidden tokens.
        sampling: the processing to apply.
    Returns:
        ``[..., vocab]`` float32 probabilities, each row summing to 1.
    """
    logits = logits.float()
    if not torch.isfinite(logits.amax(dim=-1)).all():
        raise ValueError("every token is masked (-inf/NaN logits): there is no distribution to sample from")
    if sampling.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    # Shift by the row maximum before dividing: the top logit becomes 0 and every other one
    # < 0, so a tiny temperature drives them to -inf (the argmax point mass, ties shared)
    # instead of overflowing to inf and a NaN softmax. A temperature below float32's
    # smallest normal number (down to 5e-324) divides in float64, where it is not 0.
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    if sampling.temperature >= torch.finfo(torch.float32).tiny:
        logits = shifted / sampling.temperature
    else:
        logits = (shifted.double() / sampling.temperature).float()
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p; the top
        # token always survives, so the kept set is never empty.
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def output_vocab_size(model: torch.nn.Module) -> int:
    """Rows of a causal LM's output embedding: the token ids its logits range over."""
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


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
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    source: str | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    @staticmethod
    def empty() -> Draft:
        return _EMPTY_DRAFT

    @staticmethod
    def chain(token_ids: list[int] | torch.Tensor, draft_probs: torch.Tensor | None = None, source: str | None = None) -> Draft:
        """A linear draft: node i's parent is node i - 1."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        return Draft(token_ids, torch.arange(-1, token_ids.shape[0] - 1), draft_probs, source)

    def is_chain(self) -> bool:
        """Whether node i's parent is i - 1 for every node (computed once per draft)."""
        return self.parent_list == list(range(-1, self.num_nodes - 1))

    @cached_property
    def parent_list(self) -> list[int]:
        """``parents`` as a Python list, converted once per draft (the verifier walks it)."""
        return self.parents.tolist()


_EMPTY_DRAFT = Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))


@dataclass(frozen=True)
class ProposeContext:
    """What a proposer sees when asked for a draft.

    Args:
        tokens: every committed token so far (prompt + generated), the last one not yet
            scored by the target. The decoder's own list, valid during the call: copy
            what you keep.
        max_depth: the deepest node the verifier will keep (room left in the output
            and in the model's positions); deeper nodes are pruned.
        sampling: the processing to apply to draft distributions.
        generator: the request's seeded generator, for proposers that sample.
    """

    tokens: list[int]
    max_depth: int
    sampling: SamplingParams
    generator: torch.Generator | None = None


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


@runtime_checkable
class Proposer(Protocol):
    """Guesses the next tokens cheaply; the verifier keeps what the target agrees with.

    A decode calls ``begin`` once per request, then ``observe`` after every verification
    step, each usually preceded by ``propose`` (skipped, with an empty draft, when no
    room is left to draft). Proposers keep their own per-request state.
    """

    #: Target hidden layers the proposer needs (empty for lookup proposers).
    hidden_layers: tuple[int, ...]

    def begin(self, prompt: list[int], features: TargetFeatures | None) -> None:
        """Start a request; ``features`` covers every prompt position."""

    def propose(self, context: ProposeContext) -> Draft:
        """Return a draft tree that continues ``context.tokens``."""

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        """Learn what was committed; ``features`` covers the scored root + accepted nodes."""

    def transformers_peer(self) -> TransformersPeer | None:
        """transformers' own version of this method, for side-by-side evaluation (None: it has none)."""
