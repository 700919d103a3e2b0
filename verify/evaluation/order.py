"""The order the methods of an evaluation run in, prompt by prompt, and plain decoding's repeats."""

from __future__ import annotations

import statistics
from typing import TypeVar

T = TypeVar("T")  # a method's name, or (name, repeat)


def balanced_order(names: list[T], index: int) -> list[T]:
    """The methods in the order prompt ``index`` runs them: a row of a Williams design (a balanced Latin square).

    What runs just before a method (which weights are warm in the cache, what the allocator
    holds) shifts its time by a few percent on a small CPU. Turning one order by a prompt
    each would move every method through every position but keep its predecessor: the
    method after a large draft model would always pay for it. Over ``n`` consecutive prompts
    (``2n`` for an odd number of methods) this design runs every method in every position
    equally often and right after every other method equally often.
    """
    n = len(names)
    base, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: every difference between neighbours once
    while low <= high:
        base.append(low)
        if low != high:
            base.append(high)
        low, high = low + 1, high - 1
    row = index % (n if n % 2 == 0 else 2 * n)
    order = [names[(b + row) % n] for b in base]
    return order if row < n else order[::-1]  # odd n: the mirrored square balances what the first one cannot


def median_speed(records: list) -> float:
    """Plain decoding's tokens per second for one prompt (or turn) run several times: the median of its runs.

    Every method of a prompt is compared with the same plain run, so one plain run slowed or
    sped up by the machine moves every row of that prompt alike; the median of a few, spread
    over the prompt's order like any method, takes that shared noise out.
    """
    return statistics.median(record.tokens_per_s for record in records)
