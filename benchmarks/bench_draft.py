"""Draft-model benchmark: our draft-model proposer against transformers' assisted generation.

Greedy, same target, same draft, same prompts, one run, interleaved prompt by prompt;
median tokens/s over prompts of
  (a) transformers generate                            (b) our loop, plain (empty draft)
  (c) transformers generate(assistant_model=draft)     (d) our loop, DraftModelProposer(draft)
  (e) as (d), with the draft's own forward instead of the lean one (lean_forward=False)
Prints our speedup d/b, transformers' c/a, and the ratio (d/b) / (c/a); checks that
every output is token-identical to (a). Both sides run with their defaults for the
draft length unless --hf-k is given (transformers: up to 20 tokens, cut where the
draft's confidence drops under an adaptive threshold starting at 0.4); ours drafts up to
--k tokens, cut after a token whose draft probability is under --confidence-threshold.

    python -m benchmarks.bench_draft [--target recipes/models/demo_target] [--draft recipes/models/demo_draft]
        [--domains outputs/demo/domains/code.jsonl outputs/demo/domains/prose.jsonl]
        [--prompts 6] [--prompt-tokens 128] [--new-tokens 96] [--k 6] [--confidence-threshold 0.4]
        [--threads 1] [--compile] [--json FILE]

The domain files are written by ``draftsmith demo``; when missing they are built from the
target's held-out files (``training.demo.build_domains``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.harness import hf_greedy, run_interleaved
from draftsmith.proposers import load_proposer
from draftsmith.proposers.draft_model import load_draft_model
from draftsmith.training.demo.run import heldout_documents
from draftsmith.verify import SpeculativeDecoder, load_target
from draftsmith.verify.evaluation.demo import build_domains
from draftsmith.verify.evaluation.domains import load_domain


def load_prompts(args, tokenizer, max_positions: int) -> list[torch.Tensor]:
    """``--prompts`` prompts per domain file, cut to ``--prompt-tokens``, domains interleaved."""
    paths = [Path(p) for p in args.domains]
    if not all(p.is_file() for p in paths):
        built = build_domains(heldout_documents(Path(args.target)), paths[0].parent, args.prompts, prompt_chars=4 * args.prompt_tokens)
        print(f"domain files written: {sorted(built.values())}")
    per_domain = [load_domain(p.stem, p, tokenizer, args.prompts, args.prompt_tokens, max_positions) for p in paths]
    return [prompt.input_ids for group in zip(*per_domain, strict=False) for prompt in group]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="recipes/models/demo_target")
    parser.add_argument("--draft", default="recipes/models/demo_draft")
    parser.add_argument("--domains", nargs="+", default=["outputs/demo/domains/code.jsonl", "outputs/demo/domains/prose.jsonl"])
    parser.add_argument("--prompts", type=int, default=6, help="prompts per domain")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=6, help="our longest draft per step")
    parser.add_argument("--confidence-threshold", type=float, default=0.4, help="ours: stop drafting after a less likely token (0 = never)")
    parser.add_argument("--hf-k", type=int, default=None, help="transformers' num_assistant_tokens (default: its own, 20)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="ours with compiled target and draft forwards (b, d; e: the target only)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tokenizer = load_target(args.target)
    draft = load_draft_model(args.draft)
    for model in (target, draft):  # fixed-length outputs: no early stop on EOS
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if args.hf_k is not None:
        draft.generation_config.num_assistant_tokens = args.hf_k
    prompts = load_prompts(args, tokenizer, target.config.max_position_embeddings)
    n = args.new_tokens
    plain = SpeculativeDecoder(target, compile_forward=args.compile)
    proposer = {"type": "draft_model", "model": args.draft, "k": args.k, "confidence_threshold": args.confidence_threshold or None}
    ours = SpeculativeDecoder(target, load_proposer({**proposer, "compile": args.compile}, target=target), compile_forward=args.compile)
    wrapper = SpeculativeDecoder(target, load_proposer({**proposer, "lean_forward": False}, target=target), compile_forward=args.compile)

    hf = hf_greedy(target, n)

    runners = {
        "a_hf_generate": lambda ids: hf(ids),
        "b_ours_plain": lambda ids: lambda: plain.generate(ids, max_new_tokens=n).new_tokens,
        "c_hf_assisted": lambda ids: hf(ids, assistant_model=draft),
        "d_ours_draft": lambda ids: lambda: ours.generate(ids, max_new_tokens=n).new_tokens,
        "e_ours_wrapper": lambda ids: lambda: wrapper.generate(ids, max_new_tokens=n).new_tokens,
    }
    med, identical = run_interleaved(runners, prompts)
    taus = [ours.generate(ids, max_new_tokens=n).stats.tau for ids in prompts]
    ours_speedup = med["d_ours_draft"] / med["b_ours_plain"]
    hf_speedup = med["c_hf_assisted"] / med["a_hf_generate"]
    result = {
        "target": args.target,
        "draft": args.draft,
        "domains": args.domains,
        "threads": args.threads,
        "compile": args.compile,
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": n,
        "ours_proposer": proposer,
        "hf_num_assistant_tokens": args.hf_k or "transformers default",
        "median_tokens_per_s": med,
        "identical_to_hf_greedy": identical,
        "ours_tau_median": statistics.median(taus),
        "ours_speedup": ours_speedup,
        "ours_speedup_without_lean_forward": med["e_ours_wrapper"] / med["b_ours_plain"],
        "hf_assisted_speedup": hf_speedup,
        "ratio": ours_speedup / hf_speedup,
    }
    for name, value in med.items():
        print(f"{name:16s} {value:8.1f} tok/s  identical {identical[name]}/{len(prompts)}")
    print(f"our draft tau (median) {result['ours_tau_median']:.2f}")
    print(f"ours d/b = {ours_speedup:.2f}x   transformers assisted c/a = {hf_speedup:.2f}x   ratio = {result['ratio']:.2f}")
    print(f"without the lean draft forward: e/b = {result['ours_speedup_without_lean_forward']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
