"""Evaluation, kept apart from the decode core: per-domain prompts, the run, the report."""

from .evaluate import EvalConfig, evaluate

__all__ = ["EvalConfig", "evaluate"]
