"""Evaluation prompts per domain, from local files.

A domain file is JSONL with one object per line, ``{"prompt": str, "domain": str}`` or
``{"messages": [{"role": ..., "content": ...}, ...], "domain": str}`` (rendered with the
tokenizer's chat template), or a plain-text file / directory of ``.txt`` files whose
texts become prompts. Prompts are cut to a fixed number of tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt.

    Args:
        domain: the domain it belongs to.
        input_ids: ``[1, T]`` token ids.
        source: where it came from (file and line), for the per-prompt records.
    """

    domain: str
    input_ids: torch.Tensor
    source: str


def load_domain(
    name: str, path: str | Path, tokenizer, num_prompts: int, prompt_tokens: int, max_positions: int | None = None
) -> list[Prompt]:
    """Read up to ``num_prompts`` prompts of domain ``name`` from ``path``, each cut to ``prompt_tokens`` tokens."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"domain {name!r}: file {path} does not exist")
    if max_positions is not None and prompt_tokens >= max_positions:
        raise ValueError(
            f"domain {name!r}: prompt_tokens={prompt_tokens} leaves no room in the model's context of {max_positions} positions"
        )
    texts = _read_jsonl(name, path, tokenizer) if path.suffix == ".jsonl" else _read_text(name, path)
    prompts = []
    for source, text, keep_end in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
        if len(ids) < 2:
            continue
        # a rendered chat keeps its end, where the assistant turn opens
        ids = ids[-prompt_tokens:] if keep_end else ids[:prompt_tokens]
        prompts.append(Prompt(name, torch.tensor([ids]), source))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"domain {name!r}: {path} holds no usable prompt (empty file, or every text under 2 tokens)")
    return prompts


def _read_jsonl(name: str, path: Path, tokenizer) -> list[tuple[str, str, bool]]:
    texts = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"domain {name!r}: {path}:{lineno} is not valid JSON ({err.msg})") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise ValueError(f"domain {name!r}: {path}:{lineno} must be an object with exactly one of 'prompt' or 'messages'")
        if row.get("domain", name) != name:
            continue  # a shared file may hold several domains
        if "prompt" in row:
            if not isinstance(row["prompt"], str):
                raise ValueError(f"domain {name!r}: {path}:{lineno} 'prompt' must be a string")
            texts.append((f"{path.name}:{lineno}", row["prompt"], False))
        else:
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(f"domain {name!r}: {path}:{lineno} has 'messages' but the tokenizer has no chat template")
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            texts.append((f"{path.name}:{lineno}", text, True))
    return texts


def _read_text(name: str, path: Path) -> list[tuple[str, str, bool]]:
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"domain {name!r}: directory {path} has no .txt files")
    texts = [(f.name, f.read_text(errors="replace"), False) for f in files]
    return [t for t in texts if t[1].strip()]
