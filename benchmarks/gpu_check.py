"""One prepared run of everything worth measuring on a GPU, for whenever one is at hand: one JSON file and a summary.

    python benchmarks/gpu_check.py                         # a CUDA device, at most ~8 minutes
    python benchmarks/gpu_check.py --device cpu --quick    # the same sections on tiny shapes, about a minute

Sections (``--sections`` picks some; each records its seconds, and one past the time budget is skipped, not cut):

- ``tests``: the device tests (``tests/verify/test_device.py``: every family token-identical to plain
  decoding, the sampled laws, a broken sampler caught) on this device;
- ``probes``: which fast paths (preallocated cache, lean forward, fused layers) pass their probes here, for fp32, bf16
  and fp16 targets, and why one falls back;
- ``demo``: the shipped demo target and every ``recipes/proposers/*.yaml`` config: tokens/s against plain decoding,
  tau, identity, and the host syncs per step that CUDA reports (``torch.cuda.set_sync_debug_mode``);
- ``cost``: T(n) / T(1) of a verified tree of n rows (n = 1..64) after a 512-token prompt, on random-weight Llama
  targets of 1B and 8B shape in bf16;
- ``overhead``: plain decoding on the same models, our loop against ``model.generate``: ms per step and the loop's host
  overhead over the target's forward;
- ``drafting``: one step's drafting of an EAGLE-3 head (1 and 5 deep), an MTP module, a Medusa head set and the parallel
  drafters (DFlash, parallel EAGLE-3), against the 8B-shape target's step;
- ``compile``: the target's forward with ``torch.compile`` and without, plain decoding on the 1B shape.

Random weights give real costs and no meaningful taus: the drafting and cost sections say so in the output.
Read ``summary`` in the JSON (or the printed lines) first; benchmarks/results/gpu.md says what each figure means.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)] if str(REPO) not in sys.path else []

from draftsmith.proposers import load_proposer  # noqa: E402  (the repository root on the path first)
from draftsmith.proposers.core.lean_forward import fast_paths  # noqa: E402
from draftsmith.proposers.core.types import Draft  # noqa: E402
from draftsmith.proposers.dflash import DFlashProposer  # noqa: E402
from draftsmith.proposers.dflash_head import dflash_config_for_target, dflash_for_target  # noqa: E402
from draftsmith.proposers.eagle import EagleProposer  # noqa: E402
from draftsmith.proposers.eagle_head import config_for_target, draft_for_target  # noqa: E402
from draftsmith.proposers.medusa import MedusaProposer  # noqa: E402
from draftsmith.proposers.medusa_head import MedusaHeads  # noqa: E402
from draftsmith.proposers.mtp import MtpProposer  # noqa: E402
from draftsmith.proposers.mtp_head import config_for_target as mtp_config  # noqa: E402
from draftsmith.proposers.mtp_head import modules_for_target  # noqa: E402
from draftsmith.verify import SpeculativeDecoder, load_target  # noqa: E402
from draftsmith.verify.target import Target  # noqa: E402

SECTIONS = ("tests", "probes", "demo", "cost", "overhead", "drafting", "compile")
NEEDS_S = {"tests": 60, "compile": 120}  # a section starts only with this much of the budget left (others: 5 s)
TESTS_TIMEOUT = 240
RANDOM_WEIGHTS = "random weights: the costs are real, the taus and acceptance mean nothing"
SHAPES = {  # Llama-3.2-1B and Llama-3.1-8B; --quick: two tiny stand-ins of the same kind
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8),
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
}
QUICK_SHAPES = {
    "1B": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "8B": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2),
}


class Clock:
    """Wall time around device work: synchronizes before reading the clock (a no-op on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def median_ms(self, fn, reps: int, warm: int = 2) -> float:
        for _ in range(warm):
            fn()
        times = []
        for _ in range(reps):
            start = self.now()
            fn()
            times.append((self.now() - start) * 1e3)
        return statistics.median(times)


def random_llama(shape: str, args) -> LlamaForCausalLM:
    """A random-weight Llama of ``shape`` in bf16 on the device (fp32 on a CPU, whose bf16 matmuls are slow)."""
    dims = (QUICK_SHAPES if args.quick else SHAPES)[shape]
    vocab = 1024 if args.quick else 128256
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False, **dims)
    dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # made in its dtype, on its device: an 8B model never exists in fp32 or on the host
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval()


def prompt_ids(model, length: int, device) -> torch.Tensor:
    return (torch.arange(length, device=device) * 7919 % (model.config.vocab_size - 10) + 5)[None]


# -- sections --------------------------------------------------------------------------------


def run_tests(args) -> dict:
    """The device tests that run on this machine's GPU (identity, half precision, law, the draft check), in a child pytest."""
    command = [sys.executable, "-m", "pytest", "tests/verify/test_device.py", "-q", "-x", "-p", "no:cacheprovider"]
    command += ["-k", "identical or half or law or named"]  # the stand-in device's tests run on the CPU, in every pytest
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TESTS_TIMEOUT)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return {"command": " ".join(command[2:]), "passed": done.returncode == 0, "last_line": last, "tail": done.stdout[-3000:]}


def run_probes(args) -> dict:
    """Which fast paths pass their probes on this device, per target dtype, with the logged reason of each fallback."""
    reasons: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: reasons.append(record.getMessage())
    logging.getLogger("draftsmith").addHandler(handler)
    out = {}
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            torch.manual_seed(0)
            config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
            model = LlamaForCausalLM(config).to(args.device, dtype).eval()
            del reasons[:]
            paths = fast_paths(model, "target", None, None, False)
            lean = paths.lean
            fused = bool(lean is not None and getattr(lean, "fused", None) is not None)
            out[str(dtype).removeprefix("torch.")] = {"preallocated_cache": paths.preallocate, "lean_forward": lean is not None,
                                                      "fused_layers": fused, "reasons": list(reasons)}  # fmt: skip
    finally:
        logging.getLogger("draftsmith").removeHandler(handler)
    return out


def run_demo(args) -> dict:
    """Every shipped proposer config on the demo target: tok/s against plain, tau, identity, CUDA's count of host syncs."""
    target, tokenizer = load_target(REPO / "recipes/models/demo_target")
    target = target.to(args.device)
    texts = ["def main(argv):\n    parser = argparse.ArgumentParser()\n    ", "The history of the city begins with a small market town, "]
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts[: 1 if args.quick else 2]]
    configs = sorted((REPO / "recipes/proposers").glob("*.yaml"))
    configs = [c for c in configs if c.stem in ("ngram", "eagle3_chain")] if args.quick else configs
    new_tokens = 16 if args.quick else 96
    plain = SpeculativeDecoder(target)
    rows = {"plain": decode_row(plain, prompts, new_tokens, args, None)}
    for config in configs:
        decoder = SpeculativeDecoder(target, load_proposer(config, target=target), adaptive=False)
        rows[config.stem] = decode_row(decoder, prompts, new_tokens, args, rows["plain"]["outputs"])
    for row in rows.values():
        row["speedup"] = row["tokens_per_s"] / rows["plain"]["tokens_per_s"]
        del row["outputs"]
    return rows


def decode_row(decoder, prompts, new_tokens: int, args, reference) -> dict:
    clock, outputs, seconds, tokens, steps, forwards = Clock(args.device), [], 0.0, 0, 0, 0
    decoder.generate(prompts[0], max_new_tokens=4)  # warm
    syncs = count_cuda_syncs(lambda: decoder.generate(prompts[0], max_new_tokens=new_tokens), args.device)
    for ids in prompts:
        start = clock.now()
        result = decoder.generate(ids, max_new_tokens=new_tokens)
        seconds += clock.now() - start
        outputs.append(result.new_tokens)
        tokens, steps, forwards = tokens + len(result.new_tokens), steps + result.stats.steps, forwards + result.stats.target_forwards
    row = {"tokens_per_s": tokens / seconds, "tau": tokens / forwards, "outputs": outputs}
    row["identical_to_plain"] = reference is None or outputs == reference
    row["cuda_syncs_per_step"] = syncs / max(steps / len(prompts), 1) if syncs is not None else None
    return row


def count_cuda_syncs(fn, device) -> int | None:
    """The synchronizing calls CUDA reports while ``fn`` runs (None on a CPU)."""
    if device.type != "cuda":
        return None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run_cost(args, models) -> dict:
    """T(n) / T(1): one verified tree of n rows (a root and n - 1 nodes, binary) after a prompt, per model."""
    ns = [1, 2, 4, 8, 16] if args.quick else list(range(1, 65))
    context = 64 if args.quick else 512
    out = {"note": RANDOM_WEIGHTS}
    for shape, model in models.items():
        times = {n: tree_ms(model, n, context, args) for n in ns}
        out[shape] = {"context": context, "t1_ms": times[1], "ratio": {n: t / times[1] for n, t in times.items()}}
    return out


_PATHS: dict[int, object] = {}


def fast_target(model) -> Target:
    """A request's view of ``model`` with its fast paths (probed once per model)."""
    if id(model) not in _PATHS:
        _PATHS[id(model)] = fast_paths(model, "target", None, None, False)
    paths = _PATHS[id(model)]
    return Target(model, (), paths.preallocate, paths.forward)


@torch.inference_mode()
def tree_ms(model, rows: int, context: int, args) -> float:
    """Median ms of scoring a binary tree of ``rows`` rows (root included) after ``context`` tokens, then dropping it."""
    target = fast_target(model)
    target.prefill(prompt_ids(model, context, args.device), capacity=context + 128)
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, rows - 1)])[: rows - 1]
    draft = Draft(torch.arange(rows - 1) % 50 + 7, parents)

    def score():
        target.score(11, draft)
        target.commit([])

    return Clock(args.device).median_ms(score, reps=3 if args.quick else 10)


def run_overhead(args, models) -> dict:
    """Plain decoding, our loop against ``model.generate``: ms per step, and the loop's time above the target's forward."""
    return {shape: overhead(model, args) for shape, model in models.items()}


def overhead(model, args) -> dict:
    clock, new = Clock(args.device), 16 if args.quick else 64
    ids = prompt_ids(model, 128, args.device)
    ours, mask = SpeculativeDecoder(model), torch.ones_like(ids)

    def generate():
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    loop_ms = clock.median_ms(lambda: ours.generate(ids, max_new_tokens=new), reps=3) / new
    hf_ms = clock.median_ms(generate, reps=3) / new
    forward_ms = tree_ms(model, 1, 128, args)  # one row after the prompt: a plain step's forward
    return {"loop_ms_per_step": loop_ms, "generate_ms_per_step": hf_ms, "forward_ms": forward_ms,
            "loop_over_generate": hf_ms / loop_ms, "loop_host_overhead_ms": loop_ms - forward_ms}  # fmt: skip


def run_drafting(args, models) -> dict:
    """Each drafter's time per step (``stats.draft_time`` over its steps, a fixed config) against the 8B shape's plain step."""
    model = models["8B"]
    layers = model.config.num_hidden_layers
    torch.manual_seed(0)
    builders = {
        "eagle3_step": lambda: EagleProposer(draft_for_target(config_for_target(model, 3), model), model, k=1),
        "eagle3_chain_5": lambda: EagleProposer(draft_for_target(config_for_target(model, 3), model), model, k=5),
        "mtp_module": lambda: MtpProposer(modules_for_target(mtp_config(model, 1), model), target=model),
        "medusa_4_heads": lambda: MedusaProposer(
            MedusaHeads.for_target(model, 4), tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], target=model
        ),
        "dflash_block_8": lambda: DFlashProposer(
            dflash_for_target(dflash_config_for_target(model, block_size=8, num_layers=1, aux_layers=[1, layers // 2, layers - 1]), model),
            model,
        ),
        "peagle_5": lambda: EagleProposer(draft_for_target(config_for_target(model, 3, parallel_depth=5, mask_token_id=0), model), model),
    }
    ids, new, clock = prompt_ids(model, 128, args.device), 8 if args.quick else 32, Clock(args.device)
    plain = SpeculativeDecoder(model)
    plain.generate(ids, max_new_tokens=4)
    start = clock.now()
    result = plain.generate(ids, max_new_tokens=new)
    step_ms = (clock.now() - start) * 1e3 / result.stats.target_forwards
    out = {"note": RANDOM_WEIGHTS + " (random heads too: drafts are rejected, drafting costs are real)", "target_step_ms": step_ms}
    for name, build in builders.items():
        proposer = build()
        decoder = SpeculativeDecoder(model, proposer, adaptive=False)
        decoder.generate(ids, max_new_tokens=4)
        stats = decoder.generate(ids, max_new_tokens=new).stats
        draft_ms = stats.draft_time * 1e3 / max(stats.steps, 1)
        out[name] = {"draft_ms_per_step": draft_ms, "of_target_step": draft_ms / step_ms}
        del proposer, decoder
    return out


def run_compile(args, models) -> dict:
    """Plain decoding on the 1B shape with the target's forward compiled and not: ms per step (after the compiling run)."""
    model, clock, new = models["1B"], Clock(args.device), 16 if args.quick else 64
    ids = prompt_ids(model, 128, args.device)
    out = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        decoder = SpeculativeDecoder(model, compile_forward=compiled)
        start = clock.now()
        decoder.generate(ids, max_new_tokens=8)
        first = clock.now() - start
        out[name] = {
            "first_run_s": first,
            "ms_per_step": clock.median_ms(lambda d=decoder: d.generate(ids, max_new_tokens=new), reps=3) / new,
        }
    out["compiled_over_eager"] = out["eager"]["ms_per_step"] / out["compiled"]["ms_per_step"]
    return out


# -- the run ---------------------------------------------------------------------------------


def summarize(results: dict) -> list[str]:
    lines = []
    section = results["sections"]
    if "tests" in section and "passed" in section["tests"]:
        lines.append(f"tests: {'passed' if section['tests']['passed'] else 'FAILED'} ({section['tests']['last_line']})")
    for dtype, probe in section.get("probes", {}).items():
        if isinstance(probe, dict) and "lean_forward" in probe:
            lines.append(
                f"probes {dtype}: cache {probe['preallocated_cache']}, lean {probe['lean_forward']}, fused {probe['fused_layers']}"
            )
    for name, row in section.get("demo", {}).items():
        if isinstance(row, dict) and "speedup" in row:
            syncs = f", {row['cuda_syncs_per_step']:.1f} syncs/step" if row.get("cuda_syncs_per_step") is not None else ""
            lines.append(f"demo {name}: {row['speedup']:.2f}x plain, tau {row['tau']:.2f}, identical {row['identical_to_plain']}{syncs}")
    for shape, row in section.get("cost", {}).items():
        if isinstance(row, dict) and "ratio" in row:
            picks = {n: row["ratio"][n] for n in row["ratio"] if n in (2, 4, 8, 16, 32, 64)}
            lines.append(f"cost {shape}: T(1) {row['t1_ms']:.2f} ms; T(n)/T(1) " + ", ".join(f"{n}: {r:.2f}" for n, r in picks.items()))
    for shape, row in section.get("overhead", {}).items():
        if isinstance(row, dict) and "loop_ms_per_step" in row:
            lines.append(f"overhead {shape}: loop {row['loop_ms_per_step']:.2f} ms/step, generate {row['generate_ms_per_step']:.2f}, "
                         f"forward {row['forward_ms']:.2f} (host overhead {row['loop_host_overhead_ms']:.2f} ms)")  # fmt: skip
    for name, row in section.get("drafting", {}).items():
        if isinstance(row, dict) and "draft_ms_per_step" in row:
            lines.append(f"drafting {name}: {row['draft_ms_per_step']:.2f} ms/step = {row['of_target_step']:.2f} of the 8B step")
    if "compiled_over_eager" in section.get("compile", {}):
        lines.append(f"compile: {section['compile']['compiled_over_eager']:.2f}x eager per step")
    lines += [f"{name}: {row['skipped']}" for name, row in section.items() if isinstance(row, dict) and "skipped" in row]
    lines += [f"{name}: ERROR {row['error']}" for name, row in section.items() if isinstance(row, dict) and "error" in row]
    return lines + [RANDOM_WEIGHTS + " (cost, overhead, drafting, compile)"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and short runs (the CPU check the test suite runs)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--budget", type=float, default=None, help="seconds (default 450; --quick 90): later sections are skipped")
    parser.add_argument("--out", default="outputs/gpu_check.json", help="the JSON file")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --device cpu --quick")
    args.budget = args.budget or (90.0 if args.quick else 450.0)
    skipped = {}
    if args.quick and args.device.type == "cpu":  # the suite that runs this runs the tests, and compiles on a CPU take minutes
        skipped = {"tests": "--quick on a CPU: the test suite runs them", "compile": "--quick on a CPU: a compile takes 10-50 s"}
    torch.set_num_threads(min(torch.get_num_threads(), 4) if args.device.type == "cpu" else torch.get_num_threads())
    started = time.perf_counter()
    name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else platform.processor()
    results = {"device": str(args.device), "name": name, "torch": torch.__version__, "quick": args.quick, "sections": {}}
    models: dict = {}
    runners = {"tests": run_tests, "probes": run_probes, "demo": run_demo, "cost": run_cost, "overhead": run_overhead,
               "drafting": run_drafting, "compile": run_compile}  # fmt: skip
    for name in SECTIONS:
        if name not in args.sections:
            continue
        if name in skipped:
            results["sections"][name] = {"skipped": skipped[name]}
            continue
        left = args.budget - (time.perf_counter() - started)
        if left < NEEDS_S.get(name, 5):
            results["sections"][name] = {"skipped": f"the time budget ({args.budget:.0f} s) ran out"}
            continue
        tick = time.perf_counter()
        try:
            if name in ("cost", "overhead", "drafting", "compile"):
                for shape in ("1B", "8B") if name != "compile" else ("1B",):
                    models.setdefault(shape, random_llama(shape, args))
                section = runners[name](args, models)
            else:
                section = runners[name](args)
        except Exception as error:  # one section's failure is a finding, not the end of the run
            section = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
        section["seconds"] = time.perf_counter() - tick
        results["sections"][name] = section
        print(f"[{name}] {section['seconds']:.1f} s", flush=True)
    results["seconds"] = time.perf_counter() - started
    results["summary"] = summarize(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print("\n".join(results["summary"]))
    print(f"wrote {args.out} ({results['seconds']:.0f} s)")
    return (
        1 if any("error" in s for s in results["sections"].values()) or not results["sections"].get("tests", {}).get("passed", True) else 0
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
