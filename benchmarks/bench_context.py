"""Forward cost against context, our plain loop against transformers, and each method against its bound.

    python -m benchmarks.bench_context [--target recipes/models/demo_target] [--threads 1] [--parts forward,growth,plain,bound]
        [--compile] [--json out.json]

1. T(k): one target step scoring k tokens after a context of C tokens (C = 128 / 512 / 1024 /
   2048), through our ``Target`` with the fast paths off (transformers' ``DynamicCache`` and
   the model's forward: "before"), on with the layers' own modules ("modules") and on with
   the fused layers ("after").
   Median of repeated steps, the cache cropped back after each, every path, context and
   width alternating call by call (the machine's speed drifts by 10-20% within seconds). At 2048 the demo target runs past its 1024 trained
   positions: its logits mean nothing there, its cost is what is measured.
   ``growth``: T(1)'s ATen ops profiled at 128 and 1024 tokens of context, and which of them grew.
2. Plain decoding: our loop (fast paths on) against transformers' greedy ``generate``, on
   held-out prompts of 128 and 960 tokens (960 + 64 new tokens fill the demo target's 1024
   positions), interleaved prompt by prompt; outputs checked token-identical. Whole
   requests, and decode only (the shared prefill left out).
3. Bound: for each proposer of the demo (on 128-token held-out prompts), the speedup it
   could reach if a step cost only its target forward and its drafting,
   tau x T(1) / (T(nodes per step) + draft time per step), with T measured in the same
   run, against the speedup measured; the fraction is what our loop keeps of that bound.
   Twice: with T(k) from separate calls between the prompts (alternating widths), and
   with the forwards as each loop itself timed them (``DecodeStats.score_time``: plain
   decoding's own steps for T(1), the method's own tree forwards for T(nodes + 1)); the
   second leaves out only the loop's bookkeeping, and compares the decode-only speedup
   pooled over the prompts (prefill excluded) with tau per decode step.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness import hf_greedy, run_interleaved
from draftsmith.proposers import Draft, load_proposer
from draftsmith.proposers.core.cache import crop_cache
from draftsmith.proposers.core.lean_forward import LeanForward
from draftsmith.training.demo.run import heldout_documents
from draftsmith.verify import SpeculativeDecoder, load_target
from draftsmith.verify.evaluation.demo import trained_drafts
from draftsmith.verify.target import Target

CONTEXTS = (128, 512, 1024, 2048)
WIDTHS = (1, 2, 4, 8, 16)
BOUND_WIDTHS = 17  # T(k) for k = 1..17 (root + up to 16 nodes: the n-gram tree's budget)
BOUND_REPEATS = 5  # per width, after each prompt


@torch.inference_mode()
def step_costs(cases: dict[str, tuple[Target, int]], widths, repeats: int, vocab: int) -> dict[str, dict[int, list[float]]]:
    """Seconds of ``score`` calls of each width (a chain: root + width - 1 nodes), per case ``(target, context)``.

    Each case's target is prefilled with ``context - 1`` tokens (the same prompt for equal
    contexts); then, ``repeats`` times, every case scores every width in turn, its cache
    cropped back after each call. The machine's speed drifts by 10-20% within seconds, so
    the cases alternate call by call and see the same drift. Returns every sample.
    """
    drafts = {w: Draft.chain(torch.arange(3, 3 + w - 1).tolist()) for w in widths}
    for target, context in cases.values():
        prompt = torch.randint(3, vocab, (1, context - 1), generator=torch.Generator().manual_seed(context))
        target.prefill(prompt, capacity=context + max(widths) + 64)
    times: dict[str, dict[int, list[float]]] = {name: {w: [] for w in widths} for name in cases}
    for _ in range(repeats):
        for name, (target, context) in cases.items():
            for w in widths:
                start = time.perf_counter()
                target.score(5, drafts[w])
                times[name][w].append(time.perf_counter() - start)
                crop_cache(target.cache, context - 1)  # back to the context
    return times


def forward_costs(model, repeats: int) -> dict:
    """Median T(k) per path and context: before = transformers' cache and forward, after = the fast paths,
    modules = the fast paths with the layers' own modules instead of the fused layers."""
    lean = LeanForward.probe(model)
    modules = copy.copy(lean)
    modules.fused = None
    cases = {}
    for context in CONTEXTS:
        cases[f"before {context}"] = (Target(model), context)
        cases[f"modules {context}"] = (Target(model, preallocate=True, lean=modules), context)
        cases[f"after {context}"] = (Target(model, preallocate=True, lean=lean), context)
    costs: dict[str, dict[str, float]] = {"before": {}, "modules": {}, "after": {}}
    for name, by_width in step_costs(cases, WIDTHS, repeats, model.config.vocab_size).items():
        path, context = name.split()
        for width, samples in by_width.items():
            costs[path][f"{context}x{width}"] = statistics.median(samples)
    return costs


@torch.inference_mode()
def growth_by_op(model, repeats: int) -> dict:
    """Self CPU time per ATen op of T(1) (fast paths on) at 128 and 1024 tokens of context, and what grew.

    Shows which part of a step grows with the context: for a decode step it is attention's
    read of every cached key and value, the rest of the step does not depend on the context.
    """
    from torch.profiler import profile

    lean = LeanForward.probe(model)
    targets = {}
    for context in (128, 1024):
        targets[context] = Target(model, preallocate=True, lean=lean)
        targets[context].prefill(torch.randint(3, model.config.vocab_size, (1, context - 1)), capacity=context + 64)
    per_op: dict[int, dict[str, float]] = {128: {}, 1024: {}}
    rounds = 10  # the two contexts alternate in short profiled blocks: the machine's speed drifts
    for _ in range(rounds):
        for context, target in targets.items():
            with profile() as prof:
                for _ in range(repeats // rounds):
                    target.score(5, Draft.empty())
                    crop_cache(target.cache, context - 1)
            for e in prof.key_averages():
                per_op[context][e.key] = per_op[context].get(e.key, 0.0) + e.self_cpu_time_total / (repeats // rounds * rounds)
    grew = {op: per_op[1024].get(op, 0.0) - per_op[128].get(op, 0.0) for op in set(per_op[128]) | set(per_op[1024])}
    top = sorted(grew, key=lambda op: -abs(grew[op]))[:6]
    return {
        "total_us": {c: sum(ops.values()) for c, ops in per_op.items()},
        "growth_us": {op: grew[op] for op in top},
    }


def heldout_prompts(tokenizer, target_dir: Path, length: int, count: int) -> list[torch.Tensor]:
    docs = heldout_documents(target_dir)
    prompts = []
    for doc in [d for pair in zip(docs["code"], docs["prose"], strict=False) for d in pair]:
        ids = [tokenizer.bos_token_id] + tokenizer(doc.text, add_special_tokens=False).input_ids
        if len(ids) >= length:
            prompts.append(torch.tensor([ids[:length]]))
        if len(prompts) == count:
            break
    return prompts


def ours(decoder: SpeculativeDecoder, new_tokens: int):
    return lambda ids: lambda: decoder.generate(ids, max_new_tokens=new_tokens).new_tokens


def plain_against_transformers(model, tokenizer, target_dir: Path, args) -> dict:
    """tokens/s of our plain loop and of ``generate``, whole requests and decode only, at 128 and ``1024 - new_tokens`` prompt tokens.

    Decode only leaves the prefill out: each side also runs the same prompts for one new
    token (prefill + first token, interleaved with the rest), and the decode rate is
    ``(n - 1) / (t(n) - t(1))`` from the median times. The prefill is the same model forward
    on both sides, and at 960 prompt tokens it is about a quarter of a 64-token request.
    """
    out = {}
    n = args.new_tokens
    for length in (128, 1024 - n):
        prompts = heldout_prompts(tokenizer, target_dir, length, args.prompts)
        runners = {
            "hf_generate": hf_greedy(model, n),
            "ours_plain": ours(SpeculativeDecoder(model, compile_forward=args.compile), n),
            "hf_generate_first": hf_greedy(model, 1),
            "ours_plain_first": ours(SpeculativeDecoder(model, compile_forward=args.compile), 1),
        }
        speeds, identical = run_interleaved(runners, prompts)
        decode = {name: (n - 1) / (n / speeds[name] - 1 / speeds[f"{name}_first"]) for name in ("hf_generate", "ours_plain")}
        out[str(length)] = {
            "tokens_per_s": speeds,
            "ratio": speeds["ours_plain"] / speeds["hf_generate"],
            "decode_tokens_per_s": decode,
            "decode_ratio": decode["ours_plain"] / decode["hf_generate"],
            "identical": f"{identical['ours_plain']}/{len(prompts)}",
        }
    return out


@torch.inference_mode()
def bounds(model, tokenizer, target_dir: Path, args) -> dict:
    """Each proposer's measured speedup against tau x T(1) / (T(nodes per step + 1) + draft time per step).

    After each prompt's decodes, T(k) is sampled for every k up to ``BOUND_WIDTHS`` at the
    prompts' context, so the forward costs come from the same minutes as the decodes.
    """
    prompts = heldout_prompts(tokenizer, target_dir, 128, args.prompts)
    configs = {"ngram": {"type": "ngram"}, "ngram_tree": {"type": "ngram", "min_n": 1, "branches": 4, "max_nodes": 16}}
    configs.update(trained_drafts(target_dir))
    decoders = {"plain": SpeculativeDecoder(model)}
    decoders.update({name: SpeculativeDecoder(model, load_proposer(c, target=model)) for name, c in configs.items()})
    for decoder in decoders.values():  # warm-up
        decoder.generate(prompts[0], max_new_tokens=8)
    context = 128 + args.new_tokens // 2  # the middle of a request
    probe = {"after": (Target(model, preallocate=True, lean=LeanForward.probe(model)), context)}
    widths = range(1, BOUND_WIDTHS + 1)
    samples: dict[int, list[float]] = {w: [] for w in widths}
    runs = {name: [] for name in decoders}
    for ids in prompts:
        for name, decoder in decoders.items():
            runs[name].append(decoder.generate(ids, max_new_tokens=args.new_tokens).stats)
        for w, times in step_costs(probe, widths, BOUND_REPEATS, model.config.vocab_size)["after"].items():
            samples[w] += times
    cost = {w: statistics.median(times) for w, times in samples.items()}
    plain_speed = [s.tokens_per_second for s in runs["plain"]]
    plain_step = _per_step(runs["plain"], "score_time")  # plain decoding's own target step, timed inside its loop
    out = {
        "T(1)_ms": 1000 * cost[1],
        "T(1)_in_loop_ms": 1000 * plain_step,
        "plain_decode_step_ms": 1000 * _decode_step(runs["plain"]),
        "context": context,
    }
    for name, stats in runs.items():
        if name == "plain":
            continue
        steps = sum(s.steps for s in stats)
        nodes = sum(s.drafted_tokens for s in stats) / steps
        draft_per_step = sum(s.draft_time for s in stats) / steps
        tau = sum(s.new_tokens for s in stats) / sum(s.target_forwards for s in stats)
        t_nodes = cost[min(BOUND_WIDTHS, max(1, round(nodes + 1)))]
        bound = tau * cost[1] / (t_nodes + draft_per_step)
        measured = statistics.median(s.tokens_per_second / p for s, p in zip(stats, plain_speed, strict=True))
        # the bound prices decode steps only: the same ratio without the prefill (the same forward on both sides)
        decode = statistics.median(_decode_rate(s) / _decode_rate(p) for s, p in zip(stats, runs["plain"], strict=True))
        # The same bound from the costs each loop itself timed: its target forwards and its
        # drafting as they ran (between the draft's calls, a forward's weights are no longer
        # in cache), against plain decoding's own forwards. What it leaves out is the loop's
        # bookkeeping alone: acceptance, commit, observe, stats.
        # Pooled over the prompts like the bound itself (per-prompt ratios range 0.65-1.33x for
        # the same method, so their median is not the ratio of the pooled costs).
        decode_tau = sum(s.new_tokens - s.requests for s in stats) / steps
        in_loop = decode_tau * plain_step / (_per_step(stats, "score_time") + draft_per_step)
        pooled = _pooled_decode_rate(stats) / _pooled_decode_rate(runs["plain"])
        out[name] = {
            "in_loop_bound": in_loop,
            "in_loop_T(nodes+1)_ms": 1000 * _per_step(stats, "score_time"),
            "decode_step_ms": 1000 * _decode_step(stats),
            "pooled_decode_speedup": pooled,
            "pooled_decode_fraction_of_in_loop_bound": pooled / in_loop,
            "tau": tau,
            "nodes_per_step": nodes,
            "T(nodes+1)_ms": 1000 * t_nodes,
            "draft_ms_per_step": 1000 * draft_per_step,
            "bound": bound,
            "measured_speedup": measured,
            "fraction_of_bound": measured / bound,
            "measured_decode_speedup": decode,
            "decode_fraction_of_bound": decode / bound,
        }
    return out


def _per_step(stats: list, timing: str) -> float:
    """Seconds of ``timing`` per verification step over several requests' stats."""
    return sum(getattr(s, timing) for s in stats) / sum(s.steps for s in stats)


def _decode_step(stats: list) -> float:
    """Seconds per verification step after the first token (the whole loop: drafting, forward, bookkeeping)."""
    return sum(s.total_time - s.ttft for s in stats) / sum(s.steps for s in stats)


def _pooled_decode_rate(stats: list) -> float:
    """Tokens per second after each request's first, pooled over the requests."""
    return sum(s.new_tokens - 1 for s in stats) / sum(s.total_time - s.ttft for s in stats)


def _decode_rate(stats) -> float:
    """Tokens per second after the first token (the prefill and its token left out)."""
    return (stats.new_tokens - 1) / (stats.total_time - stats.ttft)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="recipes/models/demo_target")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=40, help="T(k) samples per context, width and path")
    parser.add_argument("--parts", default="forward,plain,bound")
    parser.add_argument("--compile", action="store_true", help="part 2: our plain loop with the compiled target forward")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = Path(args.target)
    model, tokenizer = load_target(target_dir)
    result = {"threads": args.threads, "compile": args.compile}
    parts = args.parts.split(",")
    if "forward" in parts:
        costs = forward_costs(model, args.repeats)
        result["forward_ms"] = {name: {k: round(1000 * v, 3) for k, v in c.items()} for name, c in costs.items()}
        for name, c in costs.items():
            growth = c["1024x1"] / c["128x1"] - 1
            print(
                f"T(1) {name}: "
                + "  ".join(f"{ctx}: {1000 * c[f'{ctx}x1']:.2f} ms" for ctx in CONTEXTS)
                + f"   growth 128->1024 {growth:+.0%}"
            )
    if "growth" in parts:
        result["growth_by_op"] = growth_by_op(model, args.repeats * 5)
        totals, grown = result["growth_by_op"]["total_us"], result["growth_by_op"]["growth_us"]
        print(
            f"T(1) ATen self time: {totals[128]:.0f} us at 128, {totals[1024]:.0f} us at 1024; grew by op (us): "
            + ", ".join(f"{op} {us:+.0f}" for op, us in grown.items())
        )
    if "plain" in parts:
        result["plain_vs_generate"] = plain_against_transformers(model, tokenizer, target_dir, args)
        for length, row in result["plain_vs_generate"].items():
            print(
                f"plain loop / generate at {length} prompt tokens: {row['ratio']:.2f}x whole requests, "
                f"{row['decode_ratio']:.2f}x decode only ({row['identical']} identical)"
            )
    if "bound" in parts:
        result["bounds"] = bounds(model, tokenizer, target_dir, args)
        for name, row in result["bounds"].items():
            if isinstance(row, dict):
                speedup, bound, fraction = row["measured_speedup"], row["bound"], row["fraction_of_bound"]
                print(
                    f"{name}: tau {row['tau']:.2f}, speedup {speedup:.2f}x of bound {bound:.2f}x = {fraction:.2f}; "
                    f"decode only {row['measured_decode_speedup']:.2f}x = {row['decode_fraction_of_bound']:.2f} "
                    f"(T(nodes+1) {row['T(nodes+1)_ms']:.2f} ms, draft {row['draft_ms_per_step']:.2f} ms / step); "
                    f"in-loop bound {row['in_loop_bound']:.2f}x, pooled decode speedup {row['pooled_decode_speedup']:.2f}x = "
                    f"{row['pooled_decode_fraction_of_in_loop_bound']:.2f} "
                    f"(T(nodes+1) in the loop {row['in_loop_T(nodes+1)_ms']:.2f} ms)"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
