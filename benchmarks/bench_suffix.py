"""Suffix decoding's per-step cost against the context's length (no model: the proposer alone).

A token stream from the demo target's held-out corpus (code and prose documents, tokenized
with the demo tokenizer and concatenated) is replayed as if a target accepted exactly what
the stream holds: for each context length L, ``begin`` takes the L tokens before a fixed
point of the stream as the prompt, then every step proposes, takes the longest draft path
that agrees with the stream, and ``observe``s it plus the next token. Every L replays the
same tokens from the same point; only the context before them grows. The global store first holds
``--earlier`` requests of the stream's other documents, as a serving engine's would. A
step's cost is the median over ``--steps`` steps of propose + observe; the prompt's
insertion (``begin``), once per request, is reported apart. n-gram lookup (an index kept
incrementally) runs the same replay as a reference.

    python -m benchmarks.bench_suffix [--target recipes/models/demo_target] [--contexts 256 512 1024 2048 4096]
        [--steps 300] [--earlier 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from draftsmith.proposers.core.models import load_tokenizer
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.types import ProposeContext, VerifyResult
from draftsmith.proposers.ngram import NgramProposer
from draftsmith.proposers.suffix import SuffixProposer
from draftsmith.training.demo.run import heldout_documents


def accepted_path(draft, truth: list[int]) -> list[int]:
    """The longest root-to-node path of ``draft`` whose tokens equal ``truth``'s first ones."""
    tokens, parents = draft.token_ids.tolist(), draft.parent_list
    path, at = [], -1
    for want in truth:
        nxt = next((i for i, (t, p) in enumerate(zip(tokens, parents, strict=True)) if p == at and t == want), None)
        if nxt is None:
            break
        path.append(want)
        at = nxt
    return path


def replay(proposer, stream: list[int], start: int, context: int, steps: int) -> dict:
    """Prompt: the ``context`` tokens before ``start``; then the steps replay the stream from ``start`` on."""
    sampling = SamplingParams()
    tick = time.perf_counter()
    proposer.begin(stream[start - context : start], None)
    begin_s = time.perf_counter() - tick
    tokens = stream[start - context : start + 1]
    times, accepted = [], []
    for _ in range(steps):
        tick = time.perf_counter()
        draft = proposer.propose(ProposeContext(tokens, 16, sampling))
        at = start - context + len(tokens)  # the stream position of the next token
        path = accepted_path(draft, stream[at : at + 16])
        committed = path + [stream[at + len(path)]]
        proposer.observe(VerifyResult(list(range(len(path))), path, committed[-1], False), None)
        times.append(time.perf_counter() - tick)
        tokens = tokens + committed
        accepted.append(len(path))
    return {
        "step_us": 1e6 * statistics.median(times),
        "step_p90_us": 1e6 * sorted(times)[int(0.9 * len(times))],
        "begin_ms": 1e3 * begin_s,
        "tau": 1 + statistics.mean(accepted),
        "steps": len(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="recipes/models/demo_target")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--earlier", type=int, default=16, help="earlier requests in the global store")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    tokenizer = load_tokenizer(Path(args.target), "target")
    docs = heldout_documents(Path(args.target))
    texts = [d.text for pair in zip(docs["code"], docs["prose"], strict=False) for d in pair]
    encoded = [tokenizer(t, add_special_tokens=False, verbose=False).input_ids for t in texts]
    stream = [t for ids in encoded[args.earlier :] for t in ids]
    need = max(args.contexts) + 16 * args.steps
    if len(stream) < need:
        raise SystemExit(f"the held-out stream has {len(stream)} tokens, the longest replay needs {need}: lower --steps")
    earlier = SuffixProposer()
    for ids in encoded[: args.earlier]:  # earlier requests' outputs
        earlier.begin([], None)
        earlier.observe(VerifyResult([], ids[:-1], ids[-1], False), None)
    with tempfile.TemporaryDirectory() as tmp:
        store = earlier.save_store(Path(tmp) / "store.json")
        print(f"global store: {earlier.cached_tokens} tokens in {len(earlier.cached)} requests, {earlier.cache.num_nodes} trie nodes")
        results = {}
        replay(SuffixProposer(store=str(store)), stream, max(args.contexts), args.contexts[0], 50)  # warm-up, untimed
        for context in args.contexts:
            for name, proposer in (("suffix", SuffixProposer(store=str(store))), ("ngram", NgramProposer())):
                row = replay(proposer, stream, max(args.contexts), context, args.steps)
                results[f"{name}@{context}"] = row
                print(
                    f"{name:7s} context {context:5d}: {row['step_us']:7.1f} us/step (p90 {row['step_p90_us']:7.1f}), "
                    f"begin {row['begin_ms']:7.1f} ms, tau {row['tau']:.2f} over {row['steps']} steps"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
