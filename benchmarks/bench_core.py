"""Core benchmark: our decode loop and n-gram proposer against transformers' generate.

Greedy, same model, same prompts, one run; median tokens/s over prompts of
  (a) transformers generate                      (b) our loop, empty draft
  (c) transformers generate(prompt_lookup_num_tokens=k)   (d) our n-gram proposer
on prompts whose continuation repeats the context (the model's own greedy output is
put in the prompt, so a faithful copy is what the model does next). Prints b/a and d/c
and checks that every output is token-identical to (a).

    python -m benchmarks.bench_core [--target DIR [--domain FILE.jsonl]] [--prompts 8] [--new-tokens 128]

Without --target a random Llama (8 layers, hidden 256) is used. With --domain the
prompts come from a domain file (e.g. the demo's copy domain, written by
``draftsmith demo`` to outputs/demo/domains/copy.jsonl) instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.harness import hf_greedy, run_interleaved
from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.models import load_tokenizer
from draftsmith.verify import SpeculativeDecoder, load_target
from draftsmith.verify.evaluation.domains import load_domain


def build_model(args) -> torch.nn.Module:
    if args.target:
        return load_target(args.target)[0]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def copy_prompts(model, n: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    """Prompts that end by restarting a passage they already contain: seed, its continuation, seed again."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = []
    for _ in range(n):
        head = torch.randint(10, vocab, (1, length // 2), generator=g)
        body = model.generate(head, max_new_tokens=length, do_sample=False, pad_token_id=0)
        prompts.append(torch.cat([body, head], dim=1))
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="a save_pretrained model directory (default: random 8-layer Llama)")
    parser.add_argument("--domain", help="JSONL domain file of prompts (needs --target for its tokenizer)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="draft tokens per step, both lookups")
    parser.add_argument("--max-n", type=int, default=3, help="longest n-gram matched, both lookups")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = build_model(args)
    model.generation_config.eos_token_id = None
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = 0
    if args.domain:
        tokenizer = load_tokenizer(Path(args.target), "target")
        name = Path(args.domain).stem
        prompts = [p.input_ids for p in load_domain(name, args.domain, tokenizer, args.prompts, args.prompt_length)]
    else:
        prompts = copy_prompts(model, args.prompts, args.prompt_length)
    n = args.new_tokens
    plain = SpeculativeDecoder(model)
    ngram = SpeculativeDecoder(model, load_proposer({"type": "ngram", "min_n": 1, "max_n": args.max_n, "k": args.k}))

    hf = hf_greedy(model, n)

    runners = {
        "a_hf_generate": lambda ids: hf(ids),
        "b_ours_plain": lambda ids: lambda: plain.generate(ids, max_new_tokens=n).new_tokens,
        "c_hf_prompt_lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=args.k, max_matching_ngram_size=args.max_n),
        "d_ours_ngram": lambda ids: lambda: ngram.generate(ids, max_new_tokens=n).new_tokens,
    }
    med, identical = run_interleaved(runners, prompts)
    tau = statistics.median(ngram.generate(ids, max_new_tokens=n).stats.tau for ids in prompts)
    result = {
        "model": args.target or "random-llama-8x256",
        "domain": args.domain,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "threads": args.threads,
        "prompts": args.prompts,
        "new_tokens": n,
        "median_tokens_per_s": med,
        "identical_to_hf_greedy": identical,
        "ngram_tau_median": tau,
        "b_over_a": med["b_ours_plain"] / med["a_hf_generate"],
        "d_over_c": med["d_ours_ngram"] / med["c_hf_prompt_lookup"],
    }
    for name, value in med.items():
        print(f"{name:20s} {value:8.1f} tok/s  identical {identical[name]}/{len(prompts)}")
    print(f"n-gram tau (median) {tau:.2f}")
    print(f"b/a = {result['b_over_a']:.2f}   (d/a)/(c/a) = d/c = {result['d_over_c']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
