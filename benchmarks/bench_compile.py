"""Does ``torch.compile`` pay for the target's or the draft's decode forward on this CPU?

    python -m benchmarks.bench_compile [--target recipes/models/demo_target] [--draft recipes/models/demo_draft]
        [--context 128] [--tokens 300] [--threads 1] [--json out.json]

For each model: the lean forward (``proposers.core.lean_forward``) of one token after
``--context`` cached tokens in a preallocated cache, eager (in inference mode, as decoding
runs by default) and compiled (``LeanForward.compiled``: inductor, dynamic shapes, in
no-grad mode as ``forward_mode(compiled=True)`` runs it), measured after the compiled one
has warmed up. Positions move along (the cache is cropped back every 50 tokens), so the
dynamic-shape graph is what runs. Reports the median per-token time of each, the warm-up
seconds, how many graphs dynamo made of one call (graph breaks + 1) and the largest logit
difference between the two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch._dynamo

from draftsmith.proposers.core.cache import crop_cache, make_cache
from draftsmith.proposers.core.lean_forward import LeanForward, forward_mode
from draftsmith.proposers.core.models import load_causal_lm

CYCLE = 50  # tokens before the cache is cropped back to the context


def per_token(forward, model, context: int, tokens: int, compiled: bool) -> float:
    """Median seconds of one ``forward`` of a single token, positions running over ``CYCLE`` steps."""
    with forward_mode(compiled):
        return _per_token(forward, model, context, tokens)


def _per_token(forward, model, context: int, tokens: int) -> float:
    vocab = model.config.vocab_size
    cache = make_cache(model, context + CYCLE + 8)
    model(torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(0)), cache=cache, use_cache=True)
    times = []
    for i in range(tokens):
        if i % CYCLE == 0:
            crop_cache(cache, context)
        ids, positions = torch.tensor([[3 + (i * 31) % (vocab - 3)]]), torch.tensor([[context + i % CYCLE]])
        start = time.perf_counter()
        forward(ids, cache, positions)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(path: str, context: int, tokens: int) -> dict:
    model = load_causal_lm(Path(path), "model", dtype=torch.float32)
    lean = LeanForward.probe(model)
    assert lean is not None, f"{path}: the lean forward does not reproduce the model here"
    torch._dynamo.reset()
    compiled = lean.compiled()
    start = time.perf_counter()
    per_token(compiled, model, context, 2 * CYCLE, compiled=True)  # compiles, then every guard it needs
    warmup = time.perf_counter() - start
    eager_s, compiled_s = [], []
    for _ in range(3):  # alternated, so load drift hits both
        eager_s.append(per_token(lean, model, context, tokens, compiled=False))
        compiled_s.append(per_token(compiled, model, context, tokens, compiled=True))
    with forward_mode(compiled=True):
        explained = torch._dynamo.explain(lean.__call__)(torch.tensor([[5]]), _filled_cache(model, context), torch.tensor([[context]]))
        ids = torch.tensor([[7]])
        reference = lean(ids, _filled_cache(model, context), torch.tensor([[context]]))
        other = compiled(ids, _filled_cache(model, context), torch.tensor([[context]]))
    return {
        "model": path,
        "eager_us_per_token": 1e6 * statistics.median(eager_s),
        "compiled_us_per_token": 1e6 * statistics.median(compiled_s),
        "compiled_over_eager": statistics.median(compiled_s) / statistics.median(eager_s),
        "warmup_s": warmup,
        "graphs": explained.graph_count,
        "graph_break_reasons": sorted({str(r.reason).splitlines()[0] for r in explained.break_reasons}),
        "max_logit_difference": float((reference - other).abs().max()),
    }


def _filled_cache(model, context: int):
    cache = make_cache(model, context + 8)
    vocab = model.config.vocab_size
    model(torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(0)), cache=cache, use_cache=True)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="recipes/models/demo_target")
    parser.add_argument("--draft", default="recipes/models/demo_draft")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {name: measure(path, args.context, args.tokens) for name, path in (("target", args.target), ("draft", args.draft))}
    for name, r in results.items():
        print(
            f"{name}: eager {r['eager_us_per_token']:.0f} us/token, compiled {r['compiled_us_per_token']:.0f} us/token "
            f"({r['compiled_over_eager']:.2f}x the time), warm-up {r['warmup_s']:.1f} s, {r['graphs']} graphs, "
            f"max logit difference {r['max_logit_difference']:.1e}"
        )
        for reason in r["graph_break_reasons"]:
            print(f"  graph break: {reason}")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "context": args.context, **results}, indent=1))


if __name__ == "__main__":
    main()
