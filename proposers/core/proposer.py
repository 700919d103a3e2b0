"""The proposer contract: three verbs every proposer implements, and the optional capabilities with their defaults.

A decode calls ``begin`` once per request, then ``observe`` after every verification step,
each usually preceded by ``propose``. Everything else a caller may ask of a proposer is
declared here too, with a default on ``ProposerBase``, so that the verifier, the evaluator
and the engine check call it directly and never probe for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from .engine import EngineExport, ExportControl
from .errors import InputError
from .types import Draft, ProposeContext, TargetFeatures, TransformersPeer, VerifyResult


@runtime_checkable
class Proposer(Protocol):
    """Guesses the next tokens cheaply; the verifier keeps what the target agrees with.

    Proposers keep their own per-request state. ``ProposerBase`` gives every member below
    the three verbs a default.
    """

    #: Target hidden layers the proposer needs (``output_hidden_states`` ids; empty for lookup proposers).
    hidden_layers: tuple[int, ...]
    #: The vocabulary its tokens range over (checked against the target's), or None when it proposes any id it has seen.
    vocab_size: int | None

    def begin(self, prompt: list[int], features: TargetFeatures | None) -> None:
        """Start a request; ``features`` covers every prompt position."""

    def propose(self, context: ProposeContext) -> Draft:
        """Return a draft tree that continues ``context.tokens``."""

    def observe(self, result: VerifyResult, features: TargetFeatures | None) -> None:
        """Learn what was committed; ``features`` covers the scored root + accepted nodes."""

    def reset(self) -> None:
        """Forget what was learned across requests (evaluation calls it after its warm-up)."""

    def draft_depth(self) -> int | None:
        """The deepest it drafts (its ``k``; the speculation controller plans depths up to it); None: no fixed limit."""

    def draft_width(self) -> int:
        """The most children it gives a node (its tree's width; 1: it drafts chains). Above 1 the controller chooses chain or tree."""

    def transformers_peer(self) -> TransformersPeer | None:
        """transformers' own version of this method, for side-by-side evaluation (None: it has none)."""

    def export(self, out_dir: str | Path, format: str = "vllm") -> EngineExport:
        """Write the proposer in a serving engine's layout into ``out_dir`` (new or empty), checked; InputError where it has none."""

    def export_controls(self, export: EngineExport, work: Path) -> list[ExportControl]:
        """Hand-made incomplete copies of ``export`` (under ``work``) that an engine loads silently: the engine check's controls."""


class ProposerBase:
    """The defaults of the optional capabilities: nothing kept across requests, no peer, no engine export, no controls."""

    hidden_layers: tuple[int, ...] = ()
    vocab_size: int | None = None

    def reset(self) -> None:
        return None

    def draft_depth(self) -> int | None:
        return None

    def draft_width(self) -> int:
        return 1

    def transformers_peer(self) -> TransformersPeer | None:
        return None

    def export(self, out_dir: str | Path, format: str = "vllm") -> EngineExport:
        raise InputError(f"{type(self).__name__} has no engine export")

    def export_controls(self, export: EngineExport, work: Path) -> list[ExportControl]:
        return []


def check_proposer(proposer: object) -> Proposer:
    """``proposer`` when it has every member of the contract; else one InputError naming what it lacks."""
    if isinstance(proposer, Proposer):
        return proposer
    contract = [*Proposer.__annotations__, *(name for name in vars(Proposer) if not name.startswith("_"))]
    members = [name for name in contract if not hasattr(proposer, name)]
    raise InputError(
        f"{type(proposer).__name__} is not a Proposer: it lacks {sorted(members)} "
        "(subclass draftsmith.proposers.ProposerBase for the defaults of the optional members)"
    )
