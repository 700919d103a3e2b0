"""What ``engine-bench`` concludes from the engine's own load-test figures; nothing here runs an engine.

- ``parse_result``: one ``vllm bench serve --save-result`` JSON, reduced to the figures the
  sweep reports (throughput, TTFT / TPOT / ITL / end-to-end p50 and p99, failures, and the
  speculative-decoding block: acceptance length, per-position acceptance).
- ``derive_schedule``: per concurrency level the k whose median output throughput is highest
  (k = 0: the export served with k = 0 throughout, or plain decoding where that was not
  measured), as vLLM's ``num_speculative_tokens_per_batch_size``: inclusive
  ``(first batch size, last batch size, k)`` ranges from 1 up, a measured level ``c`` covering
  the batch sizes above the level below it up to ``c``, the last range up to the server's
  ``max_num_seqs``.
- ``stops_paying``: the level from which a proposer never beats plain decoding again.
- ``schedule_config``: the export's ``speculative_config`` serving a schedule.
- ``spread``: the run-to-run noise of one figure, (max - min) / median over repeats.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

LATENCIES = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = ("p50", "p99")


class BenchResultError(ValueError):
    """A benchmark result without a figure the sweep needs."""


def parse_result(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of one ``vllm bench serve`` result (its ``--save-result`` JSON) that the sweep reports.

    Latencies in ms; ``per_position_acceptance``: per depth, the share of drafting steps that accepted it;
    the acceptance figures are None when the server drafted nothing (plain, or k = 0 throughout).
    """
    try:
        figures = {
            "concurrency": int(raw["max_concurrency"]),
            "completed": int(raw["completed"]),
            "failed": int(raw["failed"]),
            "duration_s": float(raw["duration"]),
            "output_tokens": int(raw["total_output_tokens"]),
            "output_throughput": float(raw["output_throughput"]),
            "request_throughput": float(raw["request_throughput"]),
        }
        for name in LATENCIES:
            for p in PERCENTILES:
                figures[f"{p}_{name}_ms"] = float(raw[f"{p}_{name}_ms"])
    except KeyError as missing:
        raise BenchResultError(f"the benchmark result has no {missing.args[0]!r} (run vllm bench serve with --save-result and "
                               "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99)") from None  # fmt: skip
    drafts = int(raw.get("spec_decode_num_drafts") or 0)
    figures["drafts"] = drafts
    figures["acceptance_length"] = float(raw["spec_decode_acceptance_length"]) if drafts else None
    figures["per_position_acceptance"] = (
        [float(rate) for rate in raw.get("spec_decode_per_position_acceptance_rates", [])] if drafts else None
    )
    return figures


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: 0 for one value or equal values."""
    if len(values) < 2 or max(values) == min(values):
        return 0.0
    return (max(values) - min(values)) / max(statistics.median(values), 1e-9)


def best_k(by_k: Mapping[int, Mapping[int, Sequence[float]]], level: int) -> int:
    """The k with the highest median throughput at ``level`` (``by_k[k][level]``: one throughput per repeat); ties go to the smaller k."""
    measured = {k: statistics.median(levels[level]) for k, levels in by_k.items() if levels.get(level)}
    if not measured:
        raise ValueError(f"nothing measured at concurrency {level}")
    return max(sorted(measured), key=lambda k: measured[k])


def derive_schedule(by_k: Mapping[int, Mapping[int, Sequence[float]]], levels: Sequence[int], max_batch: int) -> list[tuple[int, int, int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` from throughputs ``by_k[k][level]`` (one per repeat).

    ``by_k[0]`` is what k = 0 costs in the server the schedule runs in: the export served with
    k = 0 at every batch size (``engine_bench.schedule_candidates`` gives ``<name> off`` where it
    was measured), since vLLM 0.32 still runs a model drafter's forward where the schedule
    says 0. Plain decoding's throughput stands for it only where no such row exists (an old
    summary, ``off_rows: false``); a model drafter's schedule then expects more from k = 0 than
    it gets. Level ``levels[i]`` covers batch sizes ``levels[i - 1] + 1 .. levels[i]`` (from 1
    for the first, up to ``max_batch`` for the last); neighbouring ranges with the same k merge.
    """
    levels = sorted(levels)
    if 0 not in by_k:
        raise ValueError("the schedule needs k = 0 measured (the export served with k = 0 throughout, or plain decoding)")
    if max_batch < levels[-1]:
        raise ValueError(f"max_batch {max_batch} is below the highest level {levels[-1]}")
    schedule: list[tuple[int, int, int]] = []
    for i, level in enumerate(levels):
        start, end = (levels[i - 1] + 1 if i else 1), (level if i < len(levels) - 1 else max_batch)
        k = best_k(by_k, level)
        if schedule and schedule[-1][2] == k:
            schedule[-1] = (schedule[-1][0], end, k)
        else:
            schedule.append((start, end, k))
    return schedule


def check_schedule(schedule: Sequence[Sequence[int]]) -> None:
    """Raise ValueError unless vLLM 0.32 accepts ``schedule``: ``(start, end, k)`` ints, start <= end, from 1, no overlap, k >= 0."""
    previous_end = 0
    for entry in schedule:
        if len(entry) != 3 or not all(isinstance(v, int) for v in entry):
            raise ValueError(f"schedule entry {entry!r} is not (first batch size, last batch size, k)")
        start, end, k = entry
        if start != previous_end + 1 or end < start or k < 0:
            raise ValueError(f"schedule entry {tuple(entry)} must start at {previous_end + 1}, end at or after its start, with k >= 0")
        previous_end = end
    if not schedule:
        raise ValueError("the schedule is empty")


def schedule_config(speculative_config: Mapping[str, Any], schedule: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The export's ``speculative_config`` serving ``schedule``.

    vLLM clamps every scheduled k to ``num_speculative_tokens`` and needs that above 0, so it is
    the schedule's largest k (the export's own when the schedule is 0 throughout).
    """
    check_schedule(schedule)
    largest = max(k for _, _, k in schedule)
    config = dict(speculative_config, num_speculative_tokens_per_batch_size=[list(entry) for entry in schedule])
    if largest:
        config["num_speculative_tokens"] = largest
    return config


def stops_paying(speedups: Mapping[int, float]) -> int | None:
    """The lowest level from which the speedup stays at or below 1 at every higher level; None when it pays at the highest."""
    levels = sorted(speedups)
    if speedups[levels[-1]] > 1.0:
        return None
    stop = levels[-1]
    for level in reversed(levels):
        if speedups[level] > 1.0:
            break
        stop = level
    return stop


def format_schedule(schedule: Sequence[Sequence[int]]) -> str:
    """``1-2: k=5, 3-16: off`` for tables and logs."""
    return ", ".join(f"{start}-{end}: {'off' if k == 0 else f'k={k}'}" for start, end, k in schedule)
