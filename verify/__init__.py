"""Verification: tree masks, target scoring and KV commit, the rejection sampler, the decode loop."""

from .decoder import DecodeResult, SpeculativeDecoder
from .rejection import greedy_accept, rejection_sample, residual_distribution, speculative_sample
from .stats import DecodeStats
from .target import Target, TargetOutput
from .tree import prune_depth, tree_attention_mask, tree_position_ids, validate_draft

__all__ = [
    "DecodeResult",
    "DecodeStats",
    "SpeculativeDecoder",
    "Target",
    "TargetOutput",
    "greedy_accept",
    "prune_depth",
    "rejection_sample",
    "residual_distribution",
    "speculative_sample",
    "tree_attention_mask",
    "tree_position_ids",
    "validate_draft",
]
