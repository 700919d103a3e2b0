"""Verification: tree masks, target scoring and KV commit, the rejection sampler, the decode loop."""

from .decoder import DecodeResult, SpeculativeDecoder
from .rejection import greedy_accept, rejection_sample, residual_distribution, speculative_sample
from .stats import DecodeStats
from .target import Target, TargetOutput, load_target

__all__ = [
    "DecodeResult",
    "DecodeStats",
    "SpeculativeDecoder",
    "Target",
    "TargetOutput",
    "load_target",
    "greedy_accept",
    "rejection_sample",
    "residual_distribution",
    "speculative_sample",
]
