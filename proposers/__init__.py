"""Proposers: cheap guesses of the next tokens, behind one interface."""

from .base import (
    Draft,
    InputError,
    ProposeContext,
    Proposer,
    SamplingParams,
    TargetFeatures,
    TransformersPeer,
    VerifyResult,
    logits_to_probs,
)
from .config import REGISTRY, load_proposer

__all__ = [
    "Draft",
    "InputError",
    "ProposeContext",
    "Proposer",
    "REGISTRY",
    "SamplingParams",
    "TargetFeatures",
    "TransformersPeer",
    "VerifyResult",
    "load_proposer",
    "logits_to_probs",
]
