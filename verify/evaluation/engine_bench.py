"""Serving under load: every exported proposer in ``vllm serve``, driven by ``vllm bench serve`` at rising concurrency.

``draftsmith engine-bench --config recipes/eval/engine_bench_demo.yaml`` exports each
configured proposer (``Proposer.export``), serves the target on 127.0.0.1 plain and with each
export (and each extra static k of ``k_values``) through ``vllm serve`` in the engine venv that
``engine-check`` manages, and drives every server with vLLM's own load generator at each
concurrency level: the same prompts (the domain files, as a ShareGPT-format dataset), the
same output limit, greedy. It keeps the engine's figures (throughput, TTFT / TPOT / ITL /
end-to-end p50 and p99, failed requests, acceptance length and per-position acceptance) and
the memory of the server's processes, then derives per proposer the level from which
speculation stops paying and the ``num_speculative_tokens_per_batch_size`` schedule the
measurements support (``bench_schedule``), serves that schedule and measures it the same
way, and judges it and plain decoding (``bench_verdict``). A proposer whose schedule is
derived is also served as ``<name> off``: its export with k = 0 at every batch size, which
in vLLM 0.32 still runs a model drafter's forward; the schedule's k = 0 is measured there, not
on plain decoding. ``repeats`` runs everything again, for the run-to-run noise. Writes
``summary.json``, ``table.md`` and ``speedup.png`` under ``output_dir``.

Every server and load generator runs in a process group of its own and is stopped on
success, failure, Ctrl-C and SIGTERM (``engine_server``).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.config import build, load
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.files import check_writable, write_text_atomic
from draftsmith.proposers.core.models import context_limit

from ..target import load_target
from . import bench_schedule as bs
from .bench_report import plot_speedup, summary_table
from .bench_verdict import K0_NOTE, proposer_verdict
from .engine_check import EngineSetup, EngineUnavailable, check_served_rows, ensure_engine, served_model
from .engine_server import EngineProcessError, Group, Server, clean_env, free_port, log_tail, sigterm_as_interrupt
from .evaluate import PLAIN, DomainFile, load_prompts

CLI = Path(__file__).with_name("vllm_cli.py")


@dataclass(frozen=True)
class EngineBenchConfig:
    """What to sweep; every key of the YAML file maps to one field (unknown keys fail).

    Args:
        target: directory of the target model and tokenizer.
        domains: domain name -> prompt file (or ``{path, prompt_tokens, num_prompts}``), as in ``draftsmith eval``.
        proposers: row name -> proposer config, exported and served at the k its export drafts.
        concurrency: the load levels, requests in flight (``vllm bench serve --max-concurrency``).
        num_requests: requests per level (the prompts, cycled).
        num_prompts, prompt_tokens: prompts per domain and their length in tokens.
        max_new_tokens: output tokens of every request (``ignore_eos``: exactly this many).
        k_values: proposer row -> more static k to serve it with (each one more server).
        schedules: rows whose schedule is derived and served (None: every proposer; []: none).
        schedules_from: an earlier run's ``summary.json``: serve its schedules in every repeat beside the
            static rows (interleaved, so that drift in the machine's load hits both alike) instead of after them.
        off_rows: serve each row of ``schedules`` also as ``<row> off`` (k = 0 at every batch size, the drafter
            loaded): what a schedule's k = 0 costs in vLLM 0.32, and what the derived schedules pick k = 0 from
            (False: plain decoding's throughput stands for k = 0, which a model drafter's server does not reach).
        repeats: how many times the whole sweep runs (2 or more report the run-to-run noise).
        temperature: 0 is greedy.
        ignore_eos: keep generating past EOS, so that every request has the same output length.
        warmup_requests: untimed requests before each level (``--num-warmups``).
        dtype: the server's ``--dtype`` (float32 on a CPU; bfloat16 or auto on a GPU).
        max_num_seqs: the server's batch limit (None: the highest level); the schedule's last range ends there.
        ready_timeout_s: the most a server may take to answer ``/health``.
        bench_timeout_s: the most one server's sweep of every level may take.
        output_dir: exports, the dataset, logs, results, summary.json, table.md, speedup.png.
        engine: the engine's venv and process (``EngineSetup``, as in ``engine-check``; ``timeout_s`` unused).
    """

    target: str
    domains: dict[str, str | DomainFile]
    proposers: dict[str, dict[str, Any]]
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    num_requests: int = 32
    num_prompts: int = 4
    prompt_tokens: int = 128
    max_new_tokens: int = 64
    k_values: dict[str, list[int]] = field(default_factory=dict)
    schedules: list[str] | None = None
    schedules_from: str | None = None
    off_rows: bool = True
    repeats: int = 1
    temperature: float = 0.0
    ignore_eos: bool = True
    warmup_requests: int = 2
    dtype: str = "float32"
    max_num_seqs: int | None = None
    ready_timeout_s: int = 300
    bench_timeout_s: int = 900
    output_dir: str = "outputs/engine_bench"
    engine: EngineSetup = field(default_factory=EngineSetup)

    def __post_init__(self):
        check_served_rows(self.proposers)
        levels = self.concurrency
        if not levels or any(c < 1 for c in levels) or list(levels) != sorted(set(levels)):
            raise InputError(f"concurrency must be increasing levels >= 1 (e.g. [1, 2, 4, 8, 16]), got {levels}")
        for name in ("num_requests", "num_prompts", "prompt_tokens", "max_new_tokens", "repeats", "ready_timeout_s", "bench_timeout_s"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_requests < 0 or self.temperature < 0:
            raise InputError(f"warmup_requests and temperature must be >= 0, got {self.warmup_requests} and {self.temperature}")
        for key, names in (("k_values", list(self.k_values)), ("schedules", self.schedules or [])):
            unknown = [n for n in names if n not in self.proposers]
            if unknown:
                raise InputError(f"{key} names {unknown}, which are not proposers; the proposers: {list(self.proposers)}")
        bad = {name: ks for name, ks in self.k_values.items() if not ks or any(k < 1 for k in ks)}
        if bad:
            raise InputError(f"k_values must be lists of k >= 1 (k = 0, plain, is always served), got {bad}")
        if self.max_num_seqs is not None and self.max_num_seqs < levels[-1]:
            raise InputError(f"max_num_seqs {self.max_num_seqs} is below the highest concurrency level {levels[-1]}")

    @property
    def batch_limit(self) -> int:
        return self.max_num_seqs or self.concurrency[-1]

    @staticmethod
    def from_yaml(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> EngineBenchConfig:
        return load(EngineBenchConfig, path, overrides, what="engine-bench config")

    @staticmethod
    def from_dict(raw: dict[str, Any], where: str = "engine-bench config") -> EngineBenchConfig:
        return build(EngineBenchConfig, raw, where)


@dataclass(frozen=True)
class Serving:
    """One server of the sweep: a row of the table.

    Args:
        name: the row (``plain``, ``ngram``, ``ngram k=3``, ``ngram off``, ``ngram schedule``).
        proposer: the proposer row it serves (None: plain, no drafter loaded).
        k: the k it drafts (0: plain or ``off``; None: a schedule).
        model: the directory ``vllm serve`` loads.
        speculative_config: vLLM's, or None.
        speculation_off: the export served with k = 0 at every batch size (``<name> off``): its drafter
            loaded and, for a model drafter in vLLM 0.32, run every step; plain decoding is False here.
    """

    name: str
    proposer: str | None
    k: int | None
    model: str
    speculative_config: dict[str, Any] | None = None
    speculation_off: bool = False


# --- the sweep -----------------------------------------------------------------------


def engine_bench(config: EngineBenchConfig, progress: bool = True) -> dict[str, Any]:
    """Export, serve, load, derive the schedules, serve them; write the summary, table and plot and return the summary."""
    out = check_writable(config.output_dir, "output_dir").absolute()  # the load generator runs in its own directory
    python = ensure_engine(config.engine)
    model, tokenizer = load_target(config.target)
    dataset = write_dataset(out / "dataset.json", load_prompts(config, model, tokenizer), tokenizer)
    max_model_len = context_limit(model) or config.prompt_tokens + 2 * config.max_new_tokens
    target = str(Path(config.target).absolute())
    shutil.rmtree(out / "exports", ignore_errors=True)
    wanted = config.schedules if config.schedules is not None else list(config.proposers)
    servings, exports = [Serving(PLAIN, None, 0, target)], {}
    for name, proposer_config in config.proposers.items():
        export = load_proposer(proposer_config, target=model, tokenizer=tokenizer).export(out / "exports" / name, format="vllm")
        exports[name] = export
        off_batch = config.batch_limit if config.off_rows and name in wanted else None
        servings += static_servings(name, export.speculative_config, served_model(export, target), config.k_values.get(name, []), off_batch)
    del model  # the engine has the machine to itself from here

    def scheduled(name: str, schedule: list) -> Serving:
        export = exports[name]
        return Serving(
            f"{name} schedule", name, None, served_model(export, target), bs.schedule_config(export.speculative_config, schedule)
        )

    given = {name: s for name, s in read_schedules(config.schedules_from).items() if name in wanted} if config.schedules_from else {}
    first = servings + [scheduled(name, s) for name, s in given.items()]
    run = Sweep(config, python, dataset, max_model_len, out, progress)
    with sigterm_as_interrupt():
        for repeat in range(config.repeats):
            for serving in first:
                run.measure(serving, repeat)
        derived, k0_from = {}, {}
        for name in [n for n in wanted if n not in run.failed]:
            candidates = schedule_candidates(name, servings, run.failed)
            derived[name] = bs.derive_schedule(run.throughputs(candidates), config.concurrency, config.batch_limit)
            k0_from[name] = next(s.name for s in candidates if s.k == 0)
        after = [scheduled(name, s) for name, s in derived.items() if name not in given]
        for repeat in range(config.repeats):
            for serving in after:
                run.measure(serving, repeat)
    summary = summarize(config, first + after, run, {**derived, **given})
    for name, schedule in derived.items():
        summary["proposers"][name]["derived_schedule"] = bs.format_schedule(schedule)  # from this run (served: ``schedule``)
        summary["proposers"][name]["derived_k0_from"] = k0_from[name]
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=1))
    summary["table"] = summary_table(summary)
    write_text_atomic(out / "table.md", summary["table"])
    plot_speedup(summary, out / "speedup.png")
    summary["paths"] = {name: str(out / name) for name in ("summary.json", "table.md", "speedup.png")}
    return summary


def static_servings(name: str, speculative_config: dict[str, Any], model: str, k_values: list[int], off_batch: int | None) -> list[Serving]:
    """``name``'s static rows: its export at its own k, at each of ``k_values``, and (``off_batch`` given) ``<name> off``.

    ``<name> off`` serves the export with k = 0 at batch sizes 1 .. ``off_batch`` (an all-zero
    ``num_speculative_tokens_per_batch_size``): nothing is drafted, but vLLM 0.32 still runs a
    model drafter's forward every step, so this row, not plain decoding, is what k = 0 costs in
    a speculative server. Every family gets it alike (for n-gram it should cost nothing).
    """
    own_k = int(speculative_config["num_speculative_tokens"])
    rows = [
        Serving(name if k == own_k else f"{name} k={k}", name, k, model, dict(speculative_config, num_speculative_tokens=k))
        for k in dict.fromkeys([own_k, *k_values])
    ]
    if off_batch is not None:
        off = bs.schedule_config(speculative_config, [(1, off_batch, 0)])
        rows.append(Serving(f"{name} off", name, 0, model, off, speculation_off=True))
    return rows


def schedule_candidates(name: str, servings: list[Serving], failed: dict[str, str]) -> list[Serving]:
    """The static rows ``name``'s schedule picks among: its k >= 1 and, for k = 0, ``<name> off`` where it was served.

    Plain decoding stands for k = 0 only where no off row was served (``off_rows: false``, or the
    engine failed to serve it): with a model drafter, a schedule's k = 0 runs slower than that.
    """
    mine = [s for s in servings if s.proposer == name and s.k is not None and s.name not in failed]
    return mine if any(s.k == 0 for s in mine) else [s for s in servings if s.proposer is None] + mine


def read_schedules(path: str) -> dict[str, list[tuple[int, int, int]]]:
    """Proposer row -> schedule, from an earlier run's ``summary.json`` (``proposers.<row>.schedule``)."""
    try:
        earlier = json.loads(Path(path).read_text())
        found = {name: [tuple(entry) for entry in v["schedule"]] for name, v in earlier["proposers"].items() if "schedule" in v}
        for schedule in found.values():
            bs.check_schedule(schedule)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"schedules_from: {path} is not an engine-bench summary.json with schedules ({err})") from None
    return found


def first_error(log: Path) -> str:
    """The first exception a server logged (``AssertionError``, ``RuntimeError: ...``): the root cause, before the errors it set off."""
    messages = [line.rsplit("] ", 1)[-1].strip() for line in log_tail(log, 2000).splitlines()]
    for i, message in enumerate(messages):
        if re.match(r"^[\w.]*(Error|Exception)\b", message):
            return " | ".join(m for m in messages[max(0, i - 3) : i + 1] if m.strip("^ "))  # with the frame that raised it
    return log_tail(log, 3)


def write_dataset(path: Path, prompts, tokenizer) -> Path:
    """The prompts as ``vllm bench serve``'s ShareGPT format (text; its output length comes from the command line)."""
    rows = [
        {"id": p.source, "conversations": [{"from": "human", "value": tokenizer.decode(p.input_ids[0], skip_special_tokens=True)},
                                            {"from": "gpt", "value": ""}]}
        for p in prompts
    ]  # fmt: skip
    path.write_text(json.dumps(rows))
    return path


class Sweep:
    """Serves each ``Serving`` and loads it at every level; keeps the parsed results by row, level and repeat."""

    def __init__(self, config: EngineBenchConfig, python: Path, dataset: Path, max_model_len: int, out: Path, progress: bool):
        self.config, self.python, self.dataset, self.max_model_len, self.out, self.progress = (
            config,
            python,
            dataset,
            max_model_len,
            out,
            progress,
        )
        self.results: dict[str, dict[int, list[dict]]] = {}
        self.servers: dict[str, list[dict]] = {}
        self.failed: dict[str, str] = {}  # row -> why: a proposer the engine cannot serve is reported, the sweep goes on

    def log(self, message: str) -> None:
        if self.progress:
            print(f"engine-bench: {message}", file=sys.stderr, flush=True)

    def measure(self, serving: Serving, repeat: int) -> None:
        """Serve ``serving`` and load it at every level; a proposer's failure is recorded (plain's raises)."""
        if serving.name in self.failed:
            return
        try:
            self._measure(serving, repeat)
        except EngineUnavailable as err:
            if serving.proposer is None:
                raise
            self.failed[serving.name] = str(err)
            self.log(f"{serving.name} FAILED, left out: {str(err).splitlines()[0]}")

    def _measure(self, serving: Serving, repeat: int) -> None:
        config = self.config
        work = self.out / "runs" / serving.name.replace(" ", "_").replace("=", "") / f"repeat{repeat}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        port = free_port()
        command = [str(self.python), str(CLI), "serve", serving.model, "--host", "127.0.0.1", "--port", str(port)]
        command += ["--dtype", config.dtype, "--max-model-len", str(self.max_model_len)]
        command += ["--max-num-seqs", str(config.batch_limit), "--seed", "0"]
        command += ["--enforce-eager"] if config.engine.enforce_eager else []
        command += ["--speculative-config", json.dumps(serving.speculative_config)] if serving.speculative_config else []
        self.log(f"{serving.name} (repeat {repeat + 1}/{config.repeats}): serving on 127.0.0.1:{port}")
        env = clean_env({"VLLM_CPU_KVCACHE_SPACE": str(config.engine.kv_cache_gib)})
        server = Server(command, port, work / "server.log", env)
        try:
            ready_s = server.wait_ready(config.ready_timeout_s)
            levels = ",".join(map(str, config.concurrency))
            bench = Group([str(self.python), str(CLI), "bench-levels", levels, "result", "--", *self.bench_args(serving, server, work)],
                          work / "bench.log", env, cwd=work)  # fmt: skip
            bench.wait(config.bench_timeout_s, f"vllm bench serve against {serving.name!r}")
        except EngineProcessError as err:
            raise EngineUnavailable(str(err)) from None
        finally:
            server.stop()
        self.servers.setdefault(serving.name, []).append({"ready_s": ready_s, "peak_memory_bytes": server.peak_bytes, "port": port})
        parsed = {level: bs.parse_result(json.loads((work / f"result-{level}.json").read_text())) for level in config.concurrency}
        dead = [level for level, result in parsed.items() if result["completed"] == 0]
        if dead:  # the engine died under it (vLLM's Medusa drafter, for one, asserts on a per-batch-size k)
            raise EngineUnavailable(
                f"no request completed at concurrency {dead[0]}; the server's first error: {first_error(work / 'server.log')}"
            )
        for level, result in parsed.items():
            self.results.setdefault(serving.name, {}).setdefault(level, []).append(result)
        self.log(f"{serving.name}: " + ", ".join(f"c={c} {self.results[serving.name][c][-1]['output_throughput']:.0f} tok/s"
                                                 for c in config.concurrency))  # fmt: skip

    def bench_args(self, serving: Serving, server: Server, work: Path) -> list[str]:
        config = self.config
        args = ["--backend", "vllm", "--base-url", server.url, "--model", serving.model, "--tokenizer", serving.model]
        args += ["--dataset-name", "sharegpt", "--dataset-path", str(self.dataset), "--sharegpt-output-len", str(config.max_new_tokens)]
        args += ["--num-prompts", str(config.num_requests), "--temperature", str(config.temperature), "--seed", "0"]
        args += [
            "--num-warmups",
            str(config.warmup_requests),
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,99",
        ]
        args += ["--save-result", "--result-dir", str(work), "--disable-tqdm", "--ready-check-timeout-sec", "0"]
        return args + (["--ignore-eos"] if config.ignore_eos else [])

    def throughputs(self, servings: list[Serving]) -> dict[int, dict[int, list[float]]]:
        """k -> level -> output throughput per repeat, over ``servings`` (static ones, one per k)."""
        assert len({s.k for s in servings}) == len(servings), [s.name for s in servings]
        return {s.k: {c: [r["output_throughput"] for r in runs] for c, runs in self.results[s.name].items()} for s in servings}


# --- the summary ---------------------------------------------------------------------


def summarize(config: EngineBenchConfig, servings: list[Serving], run: Sweep, schedules: dict[str, list]) -> dict[str, Any]:
    """Rows (one per server and level: medians over repeats, their spread), per-proposer verdicts, the noise."""
    plain = {c: statistics.median([r["output_throughput"] for r in run.results[PLAIN][c]]) for c in config.concurrency}
    rows = []
    for s in [s for s in servings if s.name not in run.failed]:
        for c in config.concurrency:
            runs = run.results[s.name][c]
            speeds = [r["output_throughput"] for r in runs]
            row = {"method": s.name, "proposer": s.proposer, "k": s.k, "speculation_off": s.speculation_off, "concurrency": c,
                   "repeats": len(runs)}  # fmt: skip
            for key in runs[0]:
                values = [r[key] for r in runs]
                if key in ("per_position_acceptance", "concurrency"):
                    continue
                row[key] = None if None in values else statistics.median(values)
            row["failed"] = sum(r["failed"] for r in runs)
            row["speedup"] = row["output_throughput"] / plain[c]
            row["speedups"] = [v / plain[c] for v in speeds]
            row["throughput_spread"] = bs.spread(speeds)
            positions = [r["per_position_acceptance"] for r in runs if r["per_position_acceptance"]]
            row["per_position_acceptance"] = [statistics.median(v) for v in zip(*positions, strict=False)] if positions else None
            row["peak_memory_bytes"] = max(x["peak_memory_bytes"] for x in run.servers[s.name])
            row["ready_s"] = statistics.median([x["ready_s"] for x in run.servers[s.name]])
            rows.append(row)
    spreads = [r["throughput_spread"] for r in rows if r["repeats"] > 1]
    noise = statistics.median(spreads) if spreads else None
    proposers = {
        name: proposer_verdict(name, rows, config.concurrency, schedules.get(name), noise)
        for name in config.proposers
        if name not in run.failed
    }
    return {
        "config": asdict(config),
        "servings": [asdict(s) for s in servings],
        "rows": rows,
        "noise": {"median_throughput_spread": noise, "max_throughput_spread": max(spreads) if spreads else None, "repeats": config.repeats},
        "proposers": proposers,
        "not_served": run.failed,
        "k0_note": K0_NOTE,
    }
