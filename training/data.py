"""Training data from local files through ``datasets``, shared by every kind of draft.

Rows are ``{"input_ids": [...], "loss_mask": [...]}`` where ``loss_mask[t]`` says whether the
prediction of token ``t + 1`` counts: plain text packed into blocks (every position counts),
chat conversations (ShareGPT or messages rows, ``training.chat_data``) rendered with the
tokenizer's chat template (assistant tokens only, every turn), or prompts continued by the
target itself (self-distillation: text windows continued, or every assistant turn of a
conversation regenerated; the loss on what the target wrote), cached on disk under a hash
of everything it depends on. ``cfg`` is a training recipe (``training.recipe.TrainConfig``)
throughout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Literal

import torch
from datasets import Dataset, load_dataset, load_from_disk
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.files import atomic_directory, read_text
from draftsmith.training.chat_data import (
    check_conversation,
    check_template,
    normalise_rows,
    render_chat,
    reply_end,
    reply_stop_ids,
    reply_text,
)
from draftsmith.training.common import config_hash, file_signature

JSON_SUFFIXES = (".json", ".jsonl")
# What chat self-distillation does, in its cache key: a change of behaviour is a new cache.
CHAT_DISTILL = "every assistant turn, each on the target's own earlier turns"


@dataclass
class SelfDistillConfig:
    """Replace the data's continuations by the target's own (greedy or sampled), cached on disk."""

    enabled: bool = False
    num_prompts: int = 256  # text: windows of the documents; chat: conversations (every assistant turn regenerated)
    prompt_tokens: int = 64  # text only: tokens per prompt window
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 16  # prompts per target.generate call
    cache_dir: str = ".cache/draftsmith/self_distill"


@dataclass
class DataConfig:
    """Local files read with ``datasets``: ``.txt`` (one document per file) or ``.json`` / ``.jsonl``."""

    format: Literal["text", "chat"] = "text"  # text: packed blocks, loss everywhere | chat: conversations, loss on assistant tokens
    chat_format: Literal["auto", "sharegpt", "messages"] = "auto"  # chat rows: detected per row, or named (training.chat_data)
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    text_field: str = "text"  # JSON field of a text document
    messages_field: str = "messages"  # JSON field of a messages-layout conversation ({"role", "content"} turns)
    block_size: int = 256  # tokens per packed block / longest conversation kept
    max_documents: int = 0  # use the first N documents of train_files (0 = all)
    self_distill: SelfDistillConfig = field(default_factory=SelfDistillConfig)


def check_files(files: list[str], data: DataConfig | None = None) -> None:
    """Check every data file before anything slow: it exists, is UTF-8 text, holds something, and parses when JSON;
    with ``data.format: chat``, every row is a conversation to train on (``training.chat_data``).

    Raises FileNotFoundError naming every missing file, or InputError naming the first bad
    file (and line, for JSON lines; row, for a JSON list).
    """
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"data file(s) {missing} do not exist")
    chat = data is not None and data.format == "chat"
    for name in files:
        path = Path(name)
        text = read_text(path, "data file")
        if not text.strip():
            raise InputError(f"data file {path} is empty")
        if chat and path.suffix not in JSON_SUFFIXES:
            raise InputError(f"data file {path} is not .json / .jsonl: data.format chat reads conversations from JSON rows")
        for where, row in json_rows(path, text):
            if chat:
                check_conversation(row, where, data.chat_format, data.messages_field)


def json_rows(path: Path, text: str):
    """``(where, row)`` for every row of a ``.jsonl`` (one object a line) or ``.json`` (an object or a list of them) file;
    nothing for other files. InputError naming the first row that is not a JSON object."""
    if path.suffix == ".jsonl":
        # JSON lines end at "\n" only: str.splitlines would also cut at U+2028 and U+0085 inside strings
        for lineno, line in enumerate(text.split("\n"), 1):
            if line.strip():
                yield f"data file {path}:{lineno}", _parse_json(line, f"data file {path}:{lineno}")
    elif path.suffix == ".json":
        value = _parse_json(text, f"data file {path}", rows=True)
        if isinstance(value, dict):
            yield f"data file {path}", value
        else:
            yield from ((f"data file {path} row {i}", row) for i, row in enumerate(value, 1))


def _parse_json(text: str, where: str, rows: bool = False):
    """``text`` as a JSON object (or, with ``rows``, an object or a list of objects); else InputError."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{where} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if isinstance(value, dict) or (rows and isinstance(value, list) and value and all(isinstance(v, dict) for v in value)):
        return value
    raise InputError(f"{where} must hold a JSON object per row, got {type(value).__name__}")


def read_files(files: list[str], cache_dir: Path, max_documents: int = 0, data: DataConfig | None = None) -> Dataset:
    """Rows of local files via ``datasets``: JSON / JSONL as they are, other files one document each (``text``);
    checked first (``check_files``, with ``data``'s chat rows)."""
    check_files(files, data)
    is_json = [Path(f).suffix in JSON_SUFFIXES for f in files]
    if any(is_json) and not all(is_json):
        raise InputError(f"data files {files} mix JSON and plain text; give one kind per list")
    if all(is_json):
        rows = load_dataset("json", data_files=list(files), split="train", cache_dir=str(cache_dir))
    else:
        rows = load_dataset("text", data_files=list(files), split="train", sample_by="document", cache_dir=str(cache_dir))
    return rows.select(range(min(max_documents, len(rows)))) if max_documents else rows


def _require_column(rows: Dataset, name: str, key: str) -> None:
    if name not in rows.column_names:
        raise InputError(f"data rows have no {name!r} field (columns: {rows.column_names}); set data.{key}")


def tokenize_text(rows: Dataset, tokenizer, text_field: str) -> Dataset:
    """``input_ids`` of every document, the tokenizer's BOS (if it adds one) first and EOS last."""
    _require_column(rows, text_field, "text_field")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return rows.map(
        lambda batch: {"input_ids": [ids + eos for ids in tokenizer(batch[text_field])["input_ids"]]},
        batched=True,
        remove_columns=rows.column_names,
        desc="tokenize",
    )


def pack_blocks(docs: Dataset, block_size: int) -> Dataset:
    """Concatenate documents and cut ``block_size`` blocks (``input_ids`` ``[block_size]``, ``loss_mask`` all ones)."""

    def pack(batch):
        stream = list(chain.from_iterable(batch["input_ids"]))
        blocks = [stream[i : i + block_size] for i in range(0, len(stream) - block_size + 1, block_size)]
        return {"input_ids": blocks, "loss_mask": [[1] * block_size for _ in blocks]}

    return docs.map(pack, batched=True, remove_columns=docs.column_names, desc="pack")


def build_dataset(cfg, files: list[str], tokenizer, target, run_dir: Path, max_documents: int = 0) -> Dataset:
    """Training rows ``{"input_ids": [...], "loss_mask": [...]}`` from ``files``, regenerated by the target when asked."""
    data = cfg.data
    rows = read_files(files, run_dir / "datasets", max_documents, data)
    if data.format == "chat":
        rows = normalise_rows(rows, data.chat_format, data.messages_field)  # one "messages" column, role / content turns
    if data.self_distill.enabled:
        return self_distill(cfg, files, rows, tokenizer, target)
    if data.format == "chat":
        return render_chat(rows, tokenizer, "messages", data.block_size)
    return pack_blocks(tokenize_text(rows, tokenizer, data.text_field), data.block_size)


def eval_config(cfg):
    """The recipe for building evaluation rows: self-distil no more prompts than the evaluation reads."""
    sd = cfg.data.self_distill
    sd = dataclasses.replace(sd, num_prompts=min(sd.num_prompts, cfg.eval_batches * cfg.batch_size))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, self_distill=sd))


def distill_prompts(cfg, rows: Dataset, tokenizer) -> list[list[int]]:
    """Prompts for self-distilling text: ``num_prompts`` windows of ``prompt_tokens`` tokens of the documents."""
    sd, data = cfg.data.self_distill, cfg.data
    docs = [ids for ids in tokenize_text(rows, tokenizer, data.text_field)["input_ids"] if len(ids) > sd.prompt_tokens]
    if not docs:
        return []
    # Documents evenly spread over the data (each several times when there are fewer
    # documents than prompts), one window at a seeded random offset in each.
    rng = random.Random(cfg.seed)
    picked = [docs[i * len(docs) // sd.num_prompts] for i in range(sd.num_prompts)]
    starts = [rng.randrange(len(ids) - sd.prompt_tokens) for ids in picked]
    return [ids[s : s + sd.prompt_tokens] for ids, s in zip(picked, starts, strict=True)]


def self_distill(cfg, files: list[str], rows: Dataset, tokenizer, target) -> Dataset:
    """Rows of prompts + the target's own continuations, loss on what the target wrote; cached by a hash of their inputs.

    ``rows``: ``read_files``' rows, chat rows normalised (``chat_data.normalise_rows``).
    """
    sd, chat = cfg.data.self_distill, cfg.data.format == "chat"
    if sd.max_new_tokens >= cfg.data.block_size:
        raise InputError(f"self_distill.max_new_tokens={sd.max_new_tokens} leaves no room for a prompt in block_size={cfg.data.block_size}")
    key = {
        "target": [*file_signature(cfg.target), cfg.target_dtype],
        "files": [[str(Path(f).resolve()), Path(f).stat().st_size, Path(f).stat().st_mtime_ns] for f in files],
        "rows": len(rows),
        "data": {
            k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in ("train_files", "eval_files", "self_distill", "chat_format")
        },
        "self_distill": {k: v for k, v in dataclasses.asdict(sd).items() if k not in ("cache_dir", "batch_size")},
        "seed": cfg.seed,
    }
    if chat:  # text keys stay as they were: their behaviour did not change
        template = hashlib.sha1(str(tokenizer.chat_template).encode()).hexdigest()[:10]  # it renders prompts and rows
        key["chat"] = {"chat_format": cfg.data.chat_format, "template": template, "regenerates": CHAT_DISTILL}
    out = Path(sd.cache_dir) / config_hash(key)
    if (out / "self_distill.json").is_file():
        print(f"self-distillation: reusing {out}")
        return load_from_disk(str(out))
    if chat:
        conversations = regenerate_conversations(cfg, rows.select(range(min(sd.num_prompts, len(rows))))["messages"], tokenizer, target)
        if not conversations:
            raise InputError(f"no conversation of {files} fits a first reply: prompts longer than block_size - max_new_tokens")
        examples = render_chat(Dataset.from_list([{"messages": c} for c in conversations]), tokenizer, "messages", cfg.data.block_size)
    else:
        prompts = distill_prompts(cfg, rows, tokenizer)
        if not prompts:
            raise InputError(f"no self-distillation prompts from {files}: documents shorter than prompt_tokens={sd.prompt_tokens}?")
        examples = Dataset.from_list(generate_continuations(target, tokenizer, prompts, sd, cfg.seed))
    with atomic_directory(out) as partial:
        examples.save_to_disk(str(partial))
        (partial / "self_distill.json").write_text(json.dumps(key, indent=1))
    return load_from_disk(str(out))


def regenerate_conversations(cfg, conversations: list[list[dict]], tokenizer, target) -> list[list[dict]]:
    """Every assistant turn of every conversation replaced by the target's reply, in order, each prompted with the
    conversation so far (the target's own earlier replies in it) through the chat template.

    Turn k of every conversation is generated in one batched pass after turn k - 1 of all. A
    conversation ends before the first turn whose prompt leaves no room in ``block_size`` for
    ``max_new_tokens`` and the template's end of turn (one with no room for its first reply is
    dropped). A reply cut at ``max_new_tokens`` is kept as it is.
    """
    data, sd = cfg.data, cfg.data.self_distill
    check_template(tokenizer)
    end = reply_end(tokenizer)
    stop_ids = reply_stop_ids(tokenizer, end)
    room = data.block_size - sd.max_new_tokens - len(tokenizer.encode(end, add_special_tokens=False))
    torch.manual_seed(cfg.seed)
    conversations = [[dict(turn) for turn in c] for c in conversations]
    turns = [[i for i, turn in enumerate(c) if turn["role"] == "assistant"] for c in conversations]
    kept = [None] * len(conversations)  # each conversation up to its last regenerated turn
    active, k = list(range(len(conversations))), 0
    while active:
        prompts, waiting = [], []
        for c in active:
            prompt = tokenizer.apply_chat_template(conversations[c][: turns[c][k]], add_generation_prompt=True, return_dict=True)
            if len(prompt["input_ids"]) <= room:
                prompts.append(prompt["input_ids"])
                waiting.append(c)
        replies = generate_tokens(target, tokenizer, prompts, sd, stop_ids) if prompts else []
        for c, reply in zip(waiting, replies, strict=True):
            conversations[c][turns[c][k]] = {"role": "assistant", "content": reply_text(tokenizer, reply, stop_ids, end)}
            kept[c] = conversations[c][: turns[c][k] + 1]
        k += 1
        active = [c for c in waiting if len(turns[c]) > k]
    return [c for c in kept if c is not None]


@torch.no_grad()
def generate_tokens(target, tokenizer, prompts: list[list[int]], sd: SelfDistillConfig, stop_ids: list[int]) -> list[list[int]]:
    """The target's new tokens after every prompt (left-padded batches of ``sd.batch_size``), each up to and with its
    first stop token (all ``max_new_tokens`` when it wrote none)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling = {"do_sample": False} if sd.temperature == 0 else {"do_sample": True, "temperature": sd.temperature}
    if sd.temperature > 0:
        sampling.update(top_k=sd.top_k or None, top_p=sd.top_p)
    replies = []
    for start in tqdm(range(0, len(prompts), sd.batch_size), desc="self-distill", unit="batch"):
        batch = prompts[start : start + sd.batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=target.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=target.device)
        out = target.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=sd.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=stop_ids or None,
            **sampling,
        )
        for row in out[:, width:].tolist():
            end = next((i for i, token in enumerate(row) if token in stop_ids), None)
            replies.append(row if end is None else row[: end + 1])
    return replies


def generate_continuations(target, tokenizer, prompts: list[list[int]], sd: SelfDistillConfig, seed: int) -> list[dict]:
    """The target continues every text prompt (up to EOS); rows with the loss on the generated tokens."""
    torch.manual_seed(seed)
    stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    examples = []
    for prompt, new in zip(prompts, generate_tokens(target, tokenizer, prompts, sd, stop_ids), strict=True):
        examples.append({"input_ids": prompt + new, "loss_mask": [0] * (len(prompt) - 1) + [1] * len(new) + [0]})
    return examples


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch: ``input_ids`` ``[batch, longest]``, ``loss_mask`` (0 on padding), and any captured
    ``hidden.<layer>`` rows ``[seq, hidden]`` stacked to ``[batch, longest, hidden]`` (zeros on padding).

    With causal attention, right padding never changes what a real token sees, so no
    attention mask is needed.
    """
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        input_ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        loss_mask[i, : len(r["loss_mask"])] = torch.tensor(r["loss_mask"], dtype=torch.bool)
    batch = {"input_ids": input_ids, "loss_mask": loss_mask}
    for name in (k for k in rows[0] if k.startswith("hidden.")):
        stacked = rows[0][name].new_zeros(len(rows), width, rows[0][name].shape[-1])
        for i, r in enumerate(rows):
            stacked[i, : len(r[name])] = r[name]
        batch[name] = stacked
    return batch


def make_loader(rows: Dataset, batch_size: int, pad_id: int) -> DataLoader:
    """Shuffled full batches (the order is re-seeded per epoch by accelerate's seedable sampler)."""
    if len(rows) < batch_size:
        raise InputError(f"only {len(rows)} training rows, fewer than batch_size={batch_size}: add data or lower batch_size")
    return DataLoader(rows, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=partial(collate, pad_id=pad_id))
