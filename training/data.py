"""Training data from local files through ``datasets``, shared by every kind of draft.

Rows are ``{"input_ids": [...], "loss_mask": [...]}`` where ``loss_mask[t]`` says whether the
prediction of token ``t + 1`` counts: plain text packed into blocks (every position counts),
chat JSONL rendered with the tokenizer's chat template (assistant tokens only), or
prompts continued by the target itself (self-distillation; the continuation only), cached
on disk under a hash of everything it depends on. ``cfg`` is a training recipe
(``training.recipe.TrainConfig``) throughout.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
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
from draftsmith.training.common import config_hash, file_signature


@dataclass
class SelfDistillConfig:
    """Replace the data's continuations by the target's own (greedy or sampled), cached on disk."""

    enabled: bool = False
    num_prompts: int = 256  # text: windows of the documents; chat: conversations (up to their last assistant turn)
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

    format: Literal["text", "chat"] = "text"  # text: packed blocks, loss everywhere | chat: {"messages": [...]}, loss on assistant tokens
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    text_field: str = "text"  # JSON field of a text document
    messages_field: str = "messages"  # JSON field of a chat conversation
    block_size: int = 256  # tokens per packed block / longest conversation kept
    max_documents: int = 0  # use the first N documents of train_files (0 = all)
    self_distill: SelfDistillConfig = field(default_factory=SelfDistillConfig)


def check_files(files: list[str]) -> None:
    """Check every data file before anything slow: it exists, is UTF-8 text, holds something, and parses when JSON.

    Raises FileNotFoundError naming every missing file, or InputError naming the first bad
    file (and line, for JSON lines).
    """
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"data file(s) {missing} do not exist")
    for name in files:
        path = Path(name)
        text = read_text(path, "data file")
        if not text.strip():
            raise InputError(f"data file {path} is empty")
        if path.suffix == ".jsonl":
            for lineno, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    _check_json_row(line, f"data file {path}:{lineno}")
        elif path.suffix == ".json":
            _check_json_row(text, f"data file {path}", rows=True)


def _check_json_row(text: str, where: str, rows: bool = False) -> None:
    """``text`` is a JSON object (or, with ``rows``, an object or a list of objects); else InputError."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{where} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if isinstance(value, dict) or (rows and isinstance(value, list) and value and all(isinstance(v, dict) for v in value)):
        return
    raise InputError(f"{where} must hold a JSON object per row, got {type(value).__name__}")


def read_files(files: list[str], cache_dir: Path, max_documents: int = 0) -> Dataset:
    """Rows of local files via ``datasets``: JSON / JSONL as they are, other files one document each (``text``)."""
    check_files(files)
    is_json = [Path(f).suffix in (".json", ".jsonl") for f in files]
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


def has_generation_markers(tokenizer) -> bool:
    """Whether the chat template marks assistant output with ``{% generation %}`` (needed for the assistant mask)."""
    return bool(re.search(r"{%-?\s*generation\s*-?%}", tokenizer.chat_template or ""))


def render_chat(rows: Dataset, tokenizer, messages_field: str, block_size: int) -> Dataset:
    """Render conversations with the chat template; ``loss_mask[t]`` is set where token ``t + 1`` is an assistant token."""
    _require_column(rows, messages_field, "messages_field")
    if not has_generation_markers(tokenizer):
        raise InputError("the tokenizer's chat template has no {% generation %} markers, so assistant tokens cannot be told apart")

    def render(row):
        out = tokenizer.apply_chat_template(row[messages_field], return_dict=True, return_assistant_tokens_mask=True)
        ids, assistant = out["input_ids"][:block_size], out["assistant_masks"][:block_size]
        return {"input_ids": ids, "loss_mask": assistant[1:] + [0]}

    return rows.map(render, remove_columns=rows.column_names, desc="render chat")


def build_dataset(cfg, files: list[str], tokenizer, target, run_dir: Path, max_documents: int = 0) -> Dataset:
    """Training rows ``{"input_ids": [...], "loss_mask": [...]}`` from ``files``, regenerated by the target when asked."""
    data = cfg.data
    rows = read_files(files, run_dir / "datasets", max_documents)
    if data.self_distill.enabled:
        return self_distill(cfg, files, rows, tokenizer, target)
    if data.format == "chat":
        return render_chat(rows, tokenizer, data.messages_field, data.block_size)
    return pack_blocks(tokenize_text(rows, tokenizer, data.text_field), data.block_size)


def eval_config(cfg):
    """The recipe for building evaluation rows: self-distil no more prompts than the evaluation reads."""
    sd = cfg.data.self_distill
    sd = dataclasses.replace(sd, num_prompts=min(sd.num_prompts, cfg.eval_batches * cfg.batch_size))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, self_distill=sd))


def distill_prompts(cfg, rows: Dataset, tokenizer) -> list[list[int]]:
    """Prompts for self-distillation: windows of the documents (text), or conversations up to their last assistant turn."""
    sd, data = cfg.data.self_distill, cfg.data
    if data.format == "chat":
        _require_column(rows, data.messages_field, "messages_field")
        prompts = []
        for messages in rows[data.messages_field][: sd.num_prompts]:
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
            prompts.append(tokenizer.apply_chat_template(messages[:last], add_generation_prompt=True, return_dict=True)["input_ids"])
        return [p[: data.block_size - sd.max_new_tokens] for p in prompts]
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
    """Rows of prompts + the target's own continuations, loss on the continuations; cached by a hash of their inputs."""
    sd = cfg.data.self_distill
    if sd.max_new_tokens >= cfg.data.block_size:
        raise InputError(f"self_distill.max_new_tokens={sd.max_new_tokens} leaves no room for a prompt in block_size={cfg.data.block_size}")
    key = {
        "target": [*file_signature(cfg.target), cfg.target_dtype],
        "files": [[str(Path(f).resolve()), Path(f).stat().st_size, Path(f).stat().st_mtime_ns] for f in files],
        "rows": len(rows),
        "data": {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in ("train_files", "eval_files", "self_distill")},
        "self_distill": {k: v for k, v in dataclasses.asdict(sd).items() if k not in ("cache_dir", "batch_size")},
        "seed": cfg.seed,
    }
    out = Path(sd.cache_dir) / config_hash(key)
    if (out / "self_distill.json").is_file():
        print(f"self-distillation: reusing {out}")
        return load_from_disk(str(out))
    prompts = distill_prompts(cfg, rows, tokenizer)
    if not prompts:
        raise InputError(f"no self-distillation prompts from {files}: documents shorter than prompt_tokens={sd.prompt_tokens}?")
    examples = generate_continuations(target, tokenizer, prompts, sd, cfg.seed)
    with atomic_directory(out) as partial:
        Dataset.from_list(examples).save_to_disk(str(partial))
        (partial / "self_distill.json").write_text(json.dumps(key, indent=1))
    return load_from_disk(str(out))


@torch.no_grad()
def generate_continuations(target, tokenizer, prompts: list[list[int]], sd: SelfDistillConfig, seed: int) -> list[dict]:
    """The target continues every prompt (left-padded batches); rows with the loss on the generated tokens."""
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    sampling = {"do_sample": False} if sd.temperature == 0 else {"do_sample": True, "temperature": sd.temperature}
    if sd.temperature > 0:
        sampling.update(top_k=sd.top_k or None, top_p=sd.top_p)
    examples = []
    for start in tqdm(range(0, len(prompts), sd.batch_size), desc="self-distill", unit="batch"):
        batch = prompts[start : start + sd.batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=target.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=target.device)
        out = target.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=sd.max_new_tokens, pad_token_id=pad, eos_token_id=eos, **sampling
        )
        for prompt, row in zip(batch, out[:, width:].tolist(), strict=True):
            new = row[: row.index(eos) + 1] if eos in row else row
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
