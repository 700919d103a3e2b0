"""What ``engine-bench`` concludes per proposer from its rows (one per server and level); nothing here runs an engine.

- ``proposer_verdict``: where the export at its own k stops paying; plain decoding against
  every server with the proposer's drafter loaded (``against_plain``); and its served schedule
  against the best and the worst static config a speculative server can be (the static
  k >= 1 rows and ``<name> off``), within the run-to-run noise.

A schedule's k = 0 turns drafting off, not the drafter: vLLM 0.32 still runs a model
drafter's forward (draft model, EAGLE, MTP, ...) at the batch sizes it schedules 0 for
(``vllm/v1/spec_decode/llm_base_proposer.py``), so ``<name> off`` (the export served with
k = 0 at every batch size) is what k = 0 costs there, and where plain decoding beats every
speculative config the recommendation is a server without the drafter, not a schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .bench_schedule import format_schedule, stops_paying

K0_NOTE = (
    "A schedule's k = 0 turns drafting off, not the drafter: vLLM 0.32 still runs a model drafter's forward (draft model, "
    "EAGLE, MTP, ...) at every step, so '<name> off' (the export served with k = 0 at every batch size) is what k = 0 costs "
    "in a speculative server, and the schedules pick k = 0 from it (from plain decoding only where it was not served). Where "
    "plain decoding beats every speculative config, serve without the drafter."
)


def proposer_verdict(name: str, rows: list[dict], levels: Sequence[int], schedule: list | None, noise: float | None) -> dict[str, Any]:
    """Where ``name`` stops paying; plain decoding against its speculative configs; its schedule against its static ones.

    Args:
        name: the proposer's row (its export at its own k).
        rows: the summary's rows (``method``, ``proposer``, ``k``, ``concurrency``, ``output_throughput``, ``speedup``).
        levels: the concurrency levels.
        schedule: the schedule served for it, ``(first batch size, last batch size, k)`` ranges, or None.
        noise: the run-to-run spread the schedule may fall short of the best static config by (None: 0).
    """
    cell = {(r["method"], r["concurrency"]): r for r in rows}
    own = {c: cell[(name, c)]["speedup"] for c in levels}
    tolerance = noise or 0.0
    verdict: dict[str, Any] = {"speedup": own, "stops_paying_at": stops_paying(own), "pays_at": [c for c, v in own.items() if v > 1.0],
                               "against_plain": against_plain(name, rows, levels, tolerance)}  # fmt: skip
    if schedule is None:
        return verdict
    verdict |= {"schedule": [list(entry) for entry in schedule], "schedule_text": format_schedule(schedule)}
    if (f"{name} schedule", levels[0]) not in cell:
        return verdict  # the engine failed to serve it (summary["not_served"])
    statics = [r for r in rows if r["proposer"] == name and r["k"] is not None]  # k >= 1 and k = 0 with the drafter loaded
    at_level = {}
    for c in levels:
        at = {r["method"]: r["output_throughput"] for r in statics if r["concurrency"] == c}
        best, worst = max(at, key=at.get), min(at, key=at.get)
        mine = cell[(f"{name} schedule", c)]["output_throughput"]
        at_level[c] = {"schedule": mine, "best_static": best, "best": at[best], "worst_static": worst, "worst": at[worst],
                       "of_best": mine / at[best], "of_worst": mine / at[worst]}  # fmt: skip
    return verdict | {
        "compared_with": list(dict.fromkeys(r["method"] for r in statics)),
        "schedule_levels": at_level,
        "tolerance": tolerance,
        "at_least_best_within_noise": all(v["of_best"] >= 1.0 - tolerance for v in at_level.values()),
        "faster_than_worst_everywhere": all(v["of_worst"] > 1.0 for v in at_level.values()),
        "faster_than_worst_overall": sum(v["schedule"] for v in at_level.values()) > sum(v["worst"] for v in at_level.values()),
    }


def against_plain(name: str, rows: list[dict], levels: Sequence[int], tolerance: float = 0.0) -> dict[str, Any]:
    """Per level, plain decoding (no drafter loaded) against the fastest server with ``name``'s drafter loaded (any k, off, schedule).

    ``plain_wins`` at a level: plain decoding's median throughput is at least the fastest
    speculative config's (a tie goes to the server without a drafter). ``plain_wins_from``: the
    lowest level from which it wins there and at every higher level (None: a speculative config
    beats it at the highest level); ``recommendation`` says it in words, and says so where every
    win from there is by no more than ``tolerance`` (the run-to-run noise): a tie.
    """
    plain = {r["concurrency"]: r["output_throughput"] for r in rows if r["proposer"] is None}
    at_level = {}
    for c in levels:
        at = {r["method"]: r["output_throughput"] for r in rows if r["proposer"] == name and r["concurrency"] == c}
        best = max(at, key=at.get)
        at_level[c] = {"plain": plain[c], "best_speculative": best, "best": at[best], "plain_over_best": plain[c] / at[best],
                       "plain_wins": at[best] / plain[c] <= 1.0, "within_noise": abs(plain[c] / at[best] - 1.0) <= tolerance}  # fmt: skip
    wins_from = stops_paying({c: v["best"] / v["plain"] for c, v in at_level.items()})  # where the drafter stops paying in any config
    if wins_from is None:
        text = f"keep the drafter: at concurrency {levels[-1]} a server with it beats plain decoding"
    elif wins_from == levels[0]:
        text = "serve without the drafter: plain decoding is at least as fast as every speculative config at every level"
    else:
        text = (
            f"serve without the drafter from concurrency {wins_from} on: plain decoding is at least as fast as any speculative config there"
        )
    if wins_from is not None and all(v["within_noise"] for c, v in at_level.items() if c >= wins_from):
        text += f" (by no more than the run-to-run noise, {tolerance:.0%}: a tie)"
    return {"levels": at_level, "plain_wins_from": wins_from, "tolerance": tolerance, "recommendation": text}
