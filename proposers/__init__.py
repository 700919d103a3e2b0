"""Proposers: cheap guesses of the next tokens, behind one interface.

The families sit one per file beside the shared runtime (``draftsmith.proposers.core``);
``load_proposer`` builds any of them from ``{type: name, ...}``.
"""

from .core.errors import InputError
from .core.proposer import Proposer, ProposerBase
from .core.sampling import SamplingParams, logits_to_probs
from .core.types import Draft, ProposeContext, TargetFeatures, TransformersPeer, VerifyResult
from .registry import REGISTRY, load_proposer

__all__ = [
    "Draft",
    "InputError",
    "ProposeContext",
    "Proposer",
    "ProposerBase",
    "REGISTRY",
    "SamplingParams",
    "TargetFeatures",
    "TransformersPeer",
    "VerifyResult",
    "load_proposer",
    "logits_to_probs",
]
