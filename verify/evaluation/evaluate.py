"""Per-domain evaluation: tau, acceptance by depth, speedup over plain decoding, as files.

``draftsmith eval --config recipes/eval/*.yaml`` runs every configured proposer, plain
decoding and the transformers peer each proposer declares (``Proposer.transformers_peer``:
assisted generation, prompt lookup) on the same prompts, interleaved prompt by prompt (a
balanced order, ``order.py``) so machine-load drift and what ran just before hit all
alike, and writes per-prompt JSONL, a summary JSON, a
Markdown table and PNG plots. Question files (Spec-Bench, MT-bench) run turn by turn and
also get Spec-Bench's answer files (``questions.py``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.config import build, load
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.files import check_writable
from draftsmith.proposers.core.models import context_limit, decode_threads
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.types import TransformersPeer

from ..decoder import SpeculativeDecoder
from ..stats import DecodeStats
from ..target import load_target
from .domains import Prompt, load_domain
from .order import balanced_order, median_speed
from .questions import (
    Question,
    is_question_file,
    load_questions,
    question_rows,
    question_speed,
    run_turns,
    use_chat_template,
    write_answers,
)
from .report import markdown_table, plot_acceptance, plot_domains

PLAIN = "plain"
# The raw counters behind tau and the acceptance rates, copied into each summary row.
COUNTS = (
    "requests",
    "steps",
    "truncated_steps",
    "drafted_by_depth",
    "reached_by_depth",
    "accepted_by_depth",
    "steps_by_source",
    "accepted_by_source",
    "drafted_tokens",
    "planned_plain_steps",
    "controller_time",
)


@dataclass(frozen=True)
class DomainFile:
    """A domain's prompts with a length or a count of their own (``prompt_tokens``, ``num_prompts``; None: the config's).

    ``split``: how a text file becomes prompts, ``file`` (one each, its opening) or
    ``paragraph`` (one per blank-line-separated paragraph); JSONL rows are prompts as they are.
    """

    path: str
    prompt_tokens: int | None = None
    num_prompts: int | None = None
    split: Literal["file", "paragraph"] = "file"

    def __post_init__(self):
        for name in ("prompt_tokens", "num_prompts"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate; every key of the YAML file maps to one field (unknown keys fail).

    Args:
        target: directory of the target model and tokenizer (``save_pretrained``).
        domains: domain name -> JSONL / text file or directory of prompts, or
            ``{path: ..., prompt_tokens: n, num_prompts: m}`` for a domain whose prompts have
            another length or count. Rows of ``name/part`` are sub-domains (``domains.py``).
        proposers: row name -> proposer config (``{"type": ..., ...}``).
        peers: also run the transformers peer every proposer declares, in a row named
            ``peer[proposer row]`` (``hf_assisted[demo_draft]``, ``hf_prompt_lookup[ngram]``).
        num_prompts, prompt_tokens, max_new_tokens: per domain.
        temperature, top_k, top_p, seed: sampling (temperature 0 = greedy).
        output_dir: where the results go.
        threads: torch intra-op threads (None: ``decode_threads``'s rule, 1 for a small model).
        adaptive: our methods decode with the speculation controller, which plans each
            step's depth (down to a plain step) and trims drafts from the costs and
            acceptance it measures (``verify.controller``); false keeps every proposer's
            fixed config, as a paper's table would.
        fixed_rows: rows decoded with their proposer's fixed config whatever ``adaptive``
            says, beside the others in the same run (an adaptive row against the fixed ones).
        compile: compile the target's forward for every method of ours
            (``SpeculativeDecoder(compile_forward=True)``; a draft model compiles its own
            with ``compile: true`` in its proposer config). The first requests of each
            method pay the compilation.
        chat_template: the chat template for question files and ``messages`` rows: None, the
            tokenizer's own; ``plain``, plain ``User: ... Assistant:`` text; else a jinja file's path.
        plain_repeats: how many times plain decoding runs each prompt (in the prompt's order
            like a method); its speed for the prompt, which every row's speedup divides by,
            is the median of those runs (3: one unlucky plain run no longer moves every row
            of its prompt alike).
    """

    target: str
    domains: dict[str, str | DomainFile]
    proposers: dict[str, dict[str, Any]] = field(default_factory=dict)
    peers: bool = True
    num_prompts: int = 8
    prompt_tokens: int = 128
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    output_dir: str = "outputs/eval"
    threads: int | None = None
    adaptive: bool = True
    fixed_rows: list[str] = field(default_factory=list)
    compile: bool = False
    chat_template: str | None = None
    plain_repeats: int = 1

    def __post_init__(self):
        if not self.domains:
            raise InputError("'domains' is empty; give at least one name: file")
        if PLAIN in self.proposers:
            raise InputError(f"the row name {PLAIN!r} is reserved for plain decoding")
        for name in ("num_prompts", "prompt_tokens", "max_new_tokens", "plain_repeats"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        SamplingParams(self.temperature, self.top_k, self.top_p)  # refuses what generate would (inf, a negative top_k, ...)
        if self.threads is not None and self.threads < 1:
            raise InputError(f"threads must be >= 1 or null, got {self.threads}")
        unknown = [name for name in self.fixed_rows if name not in self.proposers]
        if unknown:
            raise InputError(f"fixed_rows {unknown} are not proposer rows of this config ({sorted(self.proposers)})")
        if self.chat_template is not None and not self.chat_template.strip():
            raise InputError("chat_template must be a jinja file's path, 'plain' or null, got ''")

    @staticmethod
    def from_yaml(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> EvalConfig:
        """Read a config file (the project's config loader: unknown keys and wrong types fail); ``key=value`` overrides on top."""
        return load(EvalConfig, path, overrides, what="eval config")

    @staticmethod
    def from_dict(raw: dict[str, Any], where: str = "eval config") -> EvalConfig:
        return build(EvalConfig, raw, where)


@dataclass
class Record:
    """One prompt decoded by one method (Spec-Bench-like fields).

    ``accept_lengths`` holds each step's emitted accepted draft tokens; it, ``ttft`` and the
    fields from ``speedup`` to ``verify_time`` come from our own decoder (empty or None for
    transformers peers). A turn of a question file (``questions.py``) has the rest.
    """

    domain: str
    method: str
    prompt_index: int
    source: str
    prompt_tokens: int
    new_tokens: int
    target_forwards: int
    accept_lengths: list[int]
    wall_time: float
    ttft: float | None
    tokens_per_s: float
    tau: float
    identical_to_plain: bool | None
    speedup: float | None = None
    steps: int | None = None
    truncated_steps: int | None = None
    draft_time: float | None = None
    verify_time: float | None = None
    question_id: int | str | None = None
    turn: int | None = None
    category: str | None = None
    reference: Any = None
    answer: str | None = None


def evaluate(config: EvalConfig, progress: bool = True) -> dict[str, Any]:
    """Run the evaluation and write its files; return the summary."""
    check_writable(config.output_dir, "output_dir")  # before anything is decoded
    model, tokenizer = load_target(config.target)
    use_chat_template(tokenizer, config.chat_template)
    torch.set_num_threads(decode_threads(model, config.threads))  # transformers' peers too: every method alike
    prompts = load_prompts(config, model, tokenizer, questions=True)  # every question row checked before any decoding
    methods, decoders = build_methods(config, model, tokenizer)
    for run in methods.values():  # warm-up, untimed: the first call of each path pays one-off costs
        run_turns(run, prompts[0], 0, tokenizer)
    for decoder in decoders:  # what a proposer and a controller learn across requests starts from the evaluated ones
        decoder.reset()  # (a controller would take the warm-up's first forwards of each shape for what drafting costs)
    records, stats = [], {}
    names = list(methods)
    slots = [(name, 0) for name in names] + [(PLAIN, repeat) for repeat in range(1, config.plain_repeats)]
    bar = tqdm(total=len(prompts) * len(slots), desc="eval", disable=not progress)
    for index, prompt in enumerate(prompts):
        done = {}
        for slot in balanced_order(slots, index):  # no method always runs first, or right after the same one
            done[slot] = run_turns(methods[slot[0]], prompt, index, tokenizer)  # a question: every turn, on this method's answers
            bar.update()
        for turn, (plain_tokens, plain_record, _) in enumerate(done[PLAIN, 0]):
            plain_record.tokens_per_s = median_speed([done[PLAIN, repeat][turn][1] for repeat in range(config.plain_repeats)])
            plain_record.wall_time = plain_record.new_tokens / plain_record.tokens_per_s
            for name in names:  # the records in row order
                tokens, record, decode_stats = done[name, 0][turn]
                record.identical_to_plain = tokens == plain_tokens if config.temperature == 0 else None
                record.speedup = record.tokens_per_s / plain_record.tokens_per_s
                records.append(record)
                if decode_stats is not None:
                    stats.setdefault((record.domain, name), []).append(decode_stats)
    bar.close()
    summary = summarise(config, records, stats)
    write_outputs(config, records, summary)
    return summary


def load_prompts(config, model, tokenizer, questions: bool = False) -> list[Prompt | Question]:
    """Every domain's prompts, in domain order, for a config with ``domains``, ``num_prompts``, ``prompt_tokens``, ``max_new_tokens``.

    A question file gives its questions where ``questions`` (``evaluate`` runs them turn by turn), else an error.
    """
    max_positions = context_limit(model)
    prompts = []
    for name, domain in config.domains.items():
        if isinstance(domain, str):
            domain = DomainFile(domain)
        path, prompt_tokens = domain.path, domain.prompt_tokens or config.prompt_tokens
        if max_positions is not None and prompt_tokens + config.max_new_tokens > max_positions:
            raise InputError(
                f"domain {name!r}: prompt_tokens={prompt_tokens} + max_new_tokens={config.max_new_tokens} exceeds the target's "
                f"context of {max_positions} positions; lower one of them"
            )
        count = domain.num_prompts or config.num_prompts
        if not is_question_file(path):
            prompts += load_domain(name, path, tokenizer, count, prompt_tokens, max_positions, domain.split)
        elif questions:
            prompts += load_questions(name, path, tokenizer, count, prompt_tokens)
        else:
            raise InputError(f"domain {name!r}: {path} is a question file (multi-turn), which only draftsmith eval runs")
    return prompts


def build_methods(config: EvalConfig, model, tokenizer) -> tuple[dict[str, Callable], list]:
    """Row name -> fn(prompt, index) -> (new tokens, Record, DecodeStats | None), and the proposers' decoders built.

    Plain decoding first, then every proposer, then the transformers peers they declare
    (with ``config.peers``); ``transformers_peer`` returns None for a proposer that has none.
    """
    plain = SpeculativeDecoder(model, compile_forward=config.compile, threads=config.threads)
    methods = {PLAIN: _ours(plain, PLAIN, config, tokenizer)}
    peers: dict[str, TransformersPeer] = {}
    decoders = []
    for name, proposer_config in config.proposers.items():
        proposer = load_proposer(proposer_config, target=model, tokenizer=tokenizer)
        adaptive = config.adaptive and name not in config.fixed_rows
        decoder = SpeculativeDecoder(model, proposer, compile_forward=config.compile, adaptive=adaptive, threads=config.threads)
        decoders.append(decoder)
        methods[name] = _ours(decoder, name, config, tokenizer)
        peer = proposer.transformers_peer() if config.peers else None
        if peer is not None:
            peers[f"{peer.name}[{name}]"] = peer
    # The hook costs every forward a Python call, ours included: only install it for peers.
    counter = _ForwardCounter(model) if peers else None
    for row, peer in peers.items():
        methods[row] = _hf(model, counter, row, config, tokenizer, peer.generate_kwargs)
    return methods, decoders


def _record(prompt: Prompt, method: str, index: int, new_tokens: int, forwards: int, wall: float, stats: DecodeStats | None) -> Record:
    return Record(
        domain=prompt.domain,
        method=method,
        prompt_index=index,
        source=prompt.source,
        prompt_tokens=prompt.input_ids.shape[1],
        new_tokens=new_tokens,
        target_forwards=forwards,
        accept_lengths=list(stats.accept_lengths) if stats else [],
        wall_time=wall,
        ttft=stats.ttft if stats else None,
        tokens_per_s=new_tokens / wall,
        tau=new_tokens / max(forwards, 1),
        identical_to_plain=None,
        steps=stats.steps if stats else None,
        truncated_steps=stats.truncated_steps if stats else None,
        draft_time=stats.draft_time if stats else None,
        verify_time=stats.verify_time if stats else None,
    )


def _ours(decoder: SpeculativeDecoder, name: str, config: EvalConfig, tokenizer) -> Callable:
    def run(prompt: Prompt, index: int):
        result = decoder.generate(
            prompt.input_ids,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            seed=config.seed + index,
            eos_token_id=tokenizer.eos_token_id,
        )
        s = result.stats
        record = _record(prompt, name, index, s.new_tokens, s.target_forwards, s.total_time, s)
        return result.new_tokens, record, s

    return run


class _ForwardCounter:
    """Counts the target's forward calls (to get tau for transformers' own generation)."""

    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


def _hf(model, counter: _ForwardCounter, name: str, config: EvalConfig, tokenizer, generate_kwargs: dict) -> Callable:
    do_sample = config.temperature > 0
    gen_kwargs = dict(generate_kwargs, do_sample=do_sample)
    if do_sample:  # greedy takes no sampling settings; transformers' "no top-k" is None, ours 0
        gen_kwargs.update(temperature=config.temperature, top_k=config.top_k or None, top_p=config.top_p)

    def run(prompt: Prompt, index: int):
        torch.manual_seed(config.seed + index)
        before = counter.calls
        start = time.perf_counter()
        out = model.generate(
            prompt.input_ids,
            attention_mask=torch.ones_like(prompt.input_ids),  # else prompt tokens equal to the pad id are masked
            max_new_tokens=config.max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            **gen_kwargs,
        )
        wall = time.perf_counter() - start
        tokens = out[0, prompt.input_ids.shape[1] :].tolist()
        record = _record(prompt, name, index, len(tokens), counter.calls - before, wall, None)
        return tokens, record, None

    return run


def summarise(config: EvalConfig, records: list[Record], stats: dict) -> dict[str, Any]:
    """Per domain x method: tau three ways, acceptance by depth and its counts, speedups, tok/s, TTFT, identical outputs.

    Rows of transformers peers have tau and timings only (None for the rest).
    """
    rows = []
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        groups.setdefault((r.domain, r.method), []).append(r)
    for (domain, method), group in groups.items():
        merged = merge_stats(stats.get((domain, method), []))
        ttfts = [r.ttft for r in group if r.ttft is not None]
        identical = [r.identical_to_plain for r in group if r.identical_to_plain is not None]
        mean_speed = question_speed(group)  # a prompt is a question of one turn
        plain_mean_speed = question_speed(groups[(domain, PLAIN)])
        rows.append(
            {
                "domain": domain,
                "method": method,
                "prompts": len(group),
                "questions": len({r.prompt_index for r in group}),
                "tau": sum(r.new_tokens for r in group) / max(sum(r.target_forwards for r in group), 1),
                "tau_from_rates": merged.tau_from_rates if merged else None,
                "tau_iid": merged.tau_iid if merged else None,
                "acceptance_by_depth": asdict(merged.acceptance_by_depth()) if merged else None,
                **{name: getattr(merged, name) if merged else None for name in COUNTS},
                "tokens_per_s": statistics.median(r.tokens_per_s for r in group),
                "tokens_per_s_mean": mean_speed,
                "speedup": statistics.median(r.speedup for r in group),
                # Spec-Bench (evaluation/speed.py): the mean over questions of tokens / wall time over its turns, / plain's
                "speedup_spec_bench": mean_speed / plain_mean_speed,
                "ttft_ms": 1000 * statistics.median(ttfts) if ttfts else None,
                # what the controller chose: the mean of the draft nodes verified per step, and the share of plain steps it planned
                "nodes_per_step": merged.drafted_tokens / merged.steps if merged and merged.steps else None,
                "plain_share": merged.planned_plain_steps / merged.steps if merged and merged.steps and method != PLAIN else None,
                "draft_ms_per_step": 1000 * merged.draft_time / merged.steps if merged and merged.steps else None,
                "identical": f"{sum(identical)}/{len(identical)}" if identical else None,
            }
        )
    questions = question_rows(records, PLAIN)
    return {"config": asdict(config), "rows": rows, **({"questions": questions} if questions else {})}


def merge_stats(all_stats: list[DecodeStats]) -> DecodeStats | None:
    """Every counter and timing of several requests summed (a domain's stats); None for none."""
    return DecodeStats.merged(all_stats) if all_stats else None


def write_outputs(config: EvalConfig, records: list[Record], summary: dict[str, Any]) -> dict[str, Path]:
    """Write records.jsonl, summary.json, table.md and the plots under ``config.output_dir``."""
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "records": out / "records.jsonl",
        "summary": out / "summary.json",
        "table": out / "table.md",
        "domains_plot": out / "tau_speedup.png",
        "acceptance_plot": out / "acceptance_by_depth.png",
    }
    paths["records"].write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
    paths["summary"].write_text(json.dumps(summary, indent=2))
    paths["table"].write_text(markdown_table(summary["rows"]))
    plot_domains(summary["rows"], paths["domains_plot"])
    plot_acceptance(summary["rows"], paths["acceptance_plot"])
    answers = write_answers(out / "model_answer", records, Path(config.target).name)  # Spec-Bench's layout, for question files
    summary["paths"] = {k: str(v) for k, v in paths.items()} | ({"answers": [str(p) for p in answers]} if answers else {})
    return paths
