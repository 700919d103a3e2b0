"""One vLLM engine in its own process: greedy outputs, timing and speculation counters as JSON.

Run by ``engine_check`` with the engine venv's Python (``python vllm_worker.py JOB OUT``);
it imports only vLLM and the standard library, because draftsmith is not installed there.
One ``LLM(...)`` per process: several engines in one process are not reliable on the CPU
backend.

JOB (JSON): ``model``, ``prompts`` (lists of token ids), ``max_tokens``, ``max_model_len``,
``speculative_config`` (or null for plain decoding), ``dtype``, ``enforce_eager``,
``kv_cache_gib``.
OUT (JSON): ``requests``, one per prompt, after an untimed warm-up request: ``tokens``
(the output ids), ``seconds`` (that request's generation), and the engine's spec-decode
counters over it: ``num_drafts`` (steps that drafted), ``num_draft_tokens``,
``num_accepted_tokens``, ``accepted_per_pos``.
"""

from __future__ import annotations

import json
import os
import sys
import time

COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def counters(llm) -> dict:
    """The engine's spec-decode counters (zeros without speculation)."""
    found = {name: 0 for name in COUNTERS.values()}
    found["accepted_per_pos"] = []
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            found[COUNTERS[metric.name]] = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found["accepted_per_pos"] = [int(v) for v in metric.values]
    return found


def minus(after: dict, before: dict) -> dict:
    out = {key: after[key] - before[key] for key in COUNTERS.values()}
    width = max(len(after["accepted_per_pos"]), len(before["accepted_per_pos"]))
    padded = [list(c["accepted_per_pos"]) + [0] * (width - len(c["accepted_per_pos"])) for c in (after, before)]
    out["accepted_per_pos"] = [a - b for a, b in zip(*padded, strict=True)]
    return out


def main(job_path: str, out_path: str) -> int:
    job = json.loads(open(job_path).read())
    # GiB of KV cache: the default asks for more than a small machine spares, and startup refuses
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(job.get("kv_cache_gib", 1))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"],
        speculative_config=job["speculative_config"],
        max_model_len=job["max_model_len"],
        dtype=job.get("dtype", "float32"),
        disable_log_stats=False,
        seed=0,
        enforce_eager=job.get("enforce_eager", True),  # torch.compile costs ~40 s of startup and does not pay on tiny models
        enable_prefix_caching=False,  # the warm-up request must not make the first timed one cheaper
        max_num_seqs=1,
    )
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up, untimed
    requests = []
    for prompt in prompts:  # one request at a time, as draftsmith decodes (batch 1)
        before = counters(llm)
        start = time.perf_counter()
        output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        seconds = time.perf_counter() - start
        requests.append({"tokens": list(output.token_ids), "seconds": seconds, **minus(counters(llm), before)})
    result = {"requests": requests}
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
