"""Shared timing harness of the benchmark scripts: interleaved runs, medians, identity checks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def hf_greedy(model, max_new_tokens: int) -> Callable:
    """fn(ids, **generate_kwargs) -> a thunk running transformers' greedy ``generate`` that returns the new ids."""

    def make(ids: torch.Tensor, **kwargs) -> Callable[[], list[int]]:
        # an explicit mask: without one, transformers masks every prompt token equal to pad_token_id
        mask = torch.ones_like(ids)
        return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)[
            0, ids.shape[1] :
        ].tolist()

    return make


def run_interleaved(runners: dict[str, Callable], prompts: list[torch.Tensor]) -> tuple[dict[str, float], dict[str, int]]:
    """Median tokens/s per runner and how many outputs equal the first runner's, prompt by prompt.

    Args:
        runners: name -> fn(ids) returning a thunk that generates and returns the new ids.
        prompts: ``[1, T]`` prompts; every runner runs on each before the next prompt, so
            drift in machine load hits all alike.
    """
    for make in runners.values():  # warm-up
        make(prompts[0])()
    speeds: dict[str, list[float]] = {name: [] for name in runners}
    identical = {name: 0 for name in runners}
    for ids in prompts:
        reference = None
        for name, make in runners.items():
            run = make(ids)
            start = time.perf_counter()
            tokens = run()
            speeds[name].append(len(tokens) / (time.perf_counter() - start))
            reference = tokens if reference is None else reference
            identical[name] += tokens == reference
    return {name: statistics.median(v) for name, v in speeds.items()}, identical
