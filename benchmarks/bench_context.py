"""Forward cost against context, our plain loop against transformers, and each method against its bound.

    python benchmarks/bench_context.py [--target recipes/demo_target] [--threads 1] [--json out.json]

1. T(k): one target step scoring k tokens after a context of C tokens (C = 128 / 512 / 1024 /
   2048), through our ``Target`` with the fast paths off (transformers' ``DynamicCache`` and
   the model's forward: "before") and on (preallocated cache and lean forward: "after").
   Median of repeated steps, the cache cropped back after each.
2. Plain decoding: our loop (fast paths on) against transformers' greedy ``generate``, on
   held-out prompts of 128 and 960 tokens (960 + 64 new tokens fill the demo target's 1024
   positions), interleaved prompt by prompt; outputs checked token-identical.
3. Bound: for each proposer of the demo (on 128-token held-out prompts), the speedup it
   could reach if a step cost only its target forward and its drafting,
   tau x T(1) / (T(nodes per step) + draft time per step), with T measured in the same
   run, against the speedup measured; the fraction is what our loop keeps of that bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from harness import hf_greedy, run_interleaved  # noqa: E402 (benchmarks/ is the script directory)
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.proposers import Draft, load_proposer
from draftsmith.proposers.lean_forward import LeanForward
from draftsmith.proposers.tree import crop_cache
from draftsmith.training.demo.run import heldout_documents, trained_drafts
from draftsmith.verify import SpeculativeDecoder
from draftsmith.verify.target import Target

CONTEXTS = (128, 512, 1024, 2048)
WIDTHS = (1, 2, 4, 8, 16)


@torch.inference_mode()
def step_cost(target: Target, context: int, width: int, repeats: int, vocab: int) -> float:
    """Median seconds of one ``score`` of ``width`` tokens (a chain: root + width - 1 nodes) after ``context`` tokens."""
    g = torch.Generator().manual_seed(context)
    target.prefill(torch.randint(3, vocab, (1, context - 1), generator=g), capacity=context + 64)
    draft = Draft.chain(torch.randint(3, vocab, (width - 1,), generator=g).tolist())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.score(5, draft)
        times.append(time.perf_counter() - start)
        crop_cache(target.cache, context - 1)  # back to the context
    return statistics.median(times)


def forward_costs(model, repeats: int) -> dict:
    vocab = model.config.vocab_size
    paths = {
        "before": Target(model),
        "after": Target(model, preallocate=True, lean=LeanForward.probe(model)),
    }
    costs = {name: {} for name in paths}
    for context in CONTEXTS:
        for width in WIDTHS:
            for name, target in paths.items():  # interleaved: load drift hits both
                costs[name][f"{context}x{width}"] = step_cost(target, context, width, repeats, vocab)
    return costs


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
    out = {}
    for length in (128, 1024 - args.new_tokens):
        prompts = heldout_prompts(tokenizer, target_dir, length, args.prompts)
        runners = {"hf_generate": hf_greedy(model, args.new_tokens), "ours_plain": ours(SpeculativeDecoder(model), args.new_tokens)}
        speeds, identical = run_interleaved(runners, prompts)
        out[str(length)] = {
            "tokens_per_s": speeds,
            "ratio": speeds["ours_plain"] / speeds["hf_generate"],
            "identical": f"{identical['ours_plain']}/{len(prompts)}",
        }
    return out


@torch.inference_mode()
def bounds(model, tokenizer, target_dir: Path, args) -> dict:
    prompts = heldout_prompts(tokenizer, target_dir, 128, args.prompts)
    configs = {"ngram": {"type": "ngram"}, "ngram_tree": {"type": "ngram", "min_n": 1, "branches": 4, "max_nodes": 16}}
    configs.update(trained_drafts(target_dir))
    decoders = {"plain": SpeculativeDecoder(model)}
    decoders.update({name: SpeculativeDecoder(model, load_proposer(c, target=model)) for name, c in configs.items()})
    for decoder in decoders.values():  # warm-up
        decoder.generate(prompts[0], max_new_tokens=8)
    runs = {name: [] for name in decoders}
    for ids in prompts:
        for name, decoder in decoders.items():
            runs[name].append(decoder.generate(ids, max_new_tokens=args.new_tokens).stats)
    probe = Target(model, preallocate=True, lean=LeanForward.probe(model))
    vocab = model.config.vocab_size
    t1 = step_cost(probe, 160, 1, 30, vocab)
    plain_speed = [s.tokens_per_second for s in runs["plain"]]
    out = {"T(1)_ms": 1000 * t1}
    for name, stats in runs.items():
        if name == "plain":
            continue
        steps = sum(s.steps for s in stats)
        nodes = sum(s.drafted_tokens for s in stats) / steps
        draft_per_step = sum(s.draft_time for s in stats) / steps
        tau = sum(s.new_tokens for s in stats) / sum(s.target_forwards for s in stats)
        t_nodes = step_cost(probe, 160, max(1, round(nodes + 1)), 30, vocab)
        bound = tau * t1 / (t_nodes + draft_per_step)
        measured = statistics.median(s.tokens_per_second / p for s, p in zip(stats, plain_speed, strict=True))
        out[name] = {
            "tau": tau,
            "nodes_per_step": nodes,
            "T(nodes+1)_ms": 1000 * t_nodes,
            "draft_ms_per_step": 1000 * draft_per_step,
            "bound": bound,
            "measured_speedup": measured,
            "fraction_of_bound": measured / bound,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="recipes/demo_target")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--parts", default="forward,plain,bound")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = Path(args.target)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    result = {"threads": args.threads}
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
    if "plain" in parts:
        result["plain_vs_generate"] = plain_against_transformers(model, tokenizer, target_dir, args)
        for length, row in result["plain_vs_generate"].items():
            print(f"plain loop / generate at {length} prompt tokens: {row['ratio']:.2f}x ({row['identical']} identical)")
    if "bound" in parts:
        result["bounds"] = bounds(model, tokenizer, target_dir, args)
        for name, row in result["bounds"].items():
            if isinstance(row, dict):
                speedup, bound, fraction = row["measured_speedup"], row["bound"], row["fraction_of_bound"]
                print(f"{name}: tau {row['tau']:.2f}, speedup {speedup:.2f}x of bound {bound:.2f}x = {fraction:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
