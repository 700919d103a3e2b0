"""Evaluation prompts per domain, from local files.

A domain file is JSONL with one object per line, ``{"prompt": str, "domain": str}`` or
``{"messages": [{"role": ..., "content": ...}, ...], "domain": str}`` (rendered with the
tokenizer's chat template), or a plain-text file / directory of ``.txt`` files. A text
file is one prompt (its opening) by default, or one prompt per paragraph (blank-line
separated) with ``split="paragraph"``. Prompts are cut to a fixed number of tokens.

A row of domain ``name/part`` belongs to domain ``name`` and is reported as its
sub-domain ``name/part``: a domain that interleaves several kinds of request (``mixed``)
keeps its order and still gets a row per kind. A file may hold several domains: the rows
of other domains are left to the config keys that name them, and counted in the one-line
error when none of the file's rows is of this domain.

A question file (Spec-Bench / MT-bench / EAGLE rows ``{"question_id", "category", "turns"}``)
is a domain file too, read whole and run turn by turn (``questions.py``); a file holds one
kind of row.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.files import read_text


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


MAX_CHARS_PER_TOKEN = 64  # text kept per prompt token before tokenizing: bounds what one huge row may cost
SPLITS = ("file", "paragraph")  # how a text file becomes prompts
TEMPLATE_HINT = "give one with the eval config's 'chat_template' (a jinja file, or 'plain' for 'User: ... Assistant:' text)"


def load_domain(
    name: str,
    path: str | Path,
    tokenizer,
    num_prompts: int,
    prompt_tokens: int,
    max_positions: int | None = None,
    split: str = "file",
) -> list[Prompt]:
    """Read up to ``num_prompts`` prompts of domain ``name`` from ``path``, each cut to ``prompt_tokens`` tokens.

    Only the first (for a chat, the last) ``prompt_tokens * MAX_CHARS_PER_TOKEN`` characters of a
    text are tokenized, so a single huge row costs no more than a normal one.

    Args:
        split: for text files, ``file`` (one prompt each) or ``paragraph`` (one per blank-line-separated paragraph).
    """
    if split not in SPLITS:
        raise InputError(f"domain {name!r}: split must be one of {list(SPLITS)}, got {split!r}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"domain {name!r}: file {path} does not exist")
    if max_positions is not None and prompt_tokens >= max_positions:
        raise InputError(
            f"domain {name!r}: prompt_tokens={prompt_tokens} leaves no room in the model's context of {max_positions} positions"
        )
    budget = prompt_tokens * MAX_CHARS_PER_TOKEN
    others: Counter = Counter()  # rows of other domains, by domain
    texts = _read_jsonl(name, path, tokenizer, others) if path.suffix == ".jsonl" else _read_text(name, path, budget, split)
    prompts, short = [], 0
    for source, text, keep_end, domain in texts:
        # a rendered chat keeps its end, where the assistant turn opens
        text = text[-budget:] if keep_end else text[:budget]
        # verbose=False: the text is longer than the model's context on purpose (cut below)
        ids = tokenizer(text, add_special_tokens=False, verbose=False).input_ids
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
        if len(ids) < 2:
            short += 1
            continue
        ids = ids[-prompt_tokens:] if keep_end else ids[:prompt_tokens]
        prompts.append(Prompt(domain, torch.tensor([ids]), source))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise InputError(f"domain {name!r}: {path} holds no usable prompt: {_why_none(name, others, short)}")
    return prompts


def _why_none(name: str, others: Counter, short: int) -> str:
    """What a file without a usable prompt held instead, in words."""
    if others:
        listing = ", ".join(f"{domain!r} ({count})" for domain, count in others.most_common(5))
        return (
            f"its rows are of other domains ({listing}), none of {name!r} or {name + '/...'!r}; "
            f"name the config key after one of them, or drop the rows' 'domain' fields"
        )
    if short:
        return f"its {short} text(s) are each under 2 tokens"
    return "it is empty"


def _read_jsonl(name: str, path: Path, tokenizer, others: Counter) -> Iterator[tuple[str, str, bool, str]]:
    """(source, text, keep_end, domain) of each row of domain ``name`` or ``name/part``, read lazily line by line.

    Rows of other domains are counted in ``others``.
    """
    where = f"domain {name!r}: {path}"
    prompt_rows = 0
    for lineno, row in json_rows(path, where):
        if is_question_row(row):
            raise InputError(
                f"{where}:{lineno} is a question row ('turns') after {prompt_rows} prompt / messages row(s): a file holds one kind"
                if prompt_rows
                else f"{where}:{lineno} is a question row ('turns'): question files run turn by turn in draftsmith eval"
            )
        prompt_rows += 1
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise InputError(f"{where}:{lineno} must be an object with exactly one of 'prompt' or 'messages'")
        domain = row.get("domain", name)
        if not isinstance(domain, str):
            raise InputError(f"{where}:{lineno} 'domain' must be a string")
        if domain != name and not domain.startswith(name + "/"):
            others[domain] += 1  # a shared file may hold several domains
            continue
        if "prompt" in row:
            if not isinstance(row["prompt"], str):
                raise InputError(f"{where}:{lineno} 'prompt' must be a string")
            yield f"{path.name}:{lineno}", row["prompt"], False, domain
        else:
            yield f"{path.name}:{lineno}", render_chat(row["messages"], tokenizer, f"{where}:{lineno}"), True, domain


def json_rows(path: Path, where: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of each non-blank line of a JSONL file, lazily; a bad line is one InputError at ``where:line``."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if b"\x00" in raw:
                raise InputError(f"{where}:{lineno} holds NUL bytes: the file looks binary; give UTF-8 JSON lines")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(f"{where}:{lineno} is not UTF-8 text (byte 0x{raw[err.start]:02x})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{where}:{lineno} is not valid JSON ({err.msg})") from None
            yield lineno, row


def is_question_row(row) -> bool:
    """A row of a question file (Spec-Bench, MT-bench, EAGLE: ``turns``, ``question_id``), not a prompt / messages row."""
    return isinstance(row, dict) and "prompt" not in row and "messages" not in row and ("turns" in row or "question_id" in row)


def render_chat(messages, tokenizer, where: str) -> str:
    """A conversation rendered with the tokenizer's chat template, opening the assistant's turn."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError(f"{where} has 'messages' but the tokenizer has no chat template; {TEMPLATE_HINT}")
    valid = isinstance(messages, list) and messages
    valid = valid and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not valid:
        raise InputError(f"{where} 'messages' must be a non-empty list of {{'role': str, 'content': str}} objects")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # the template's own checks (an unknown role, ...) raise from inside jinja
        why = (str(err).splitlines() or [type(err).__name__])[0]  # an exception may have an empty message
        raise InputError(f"{where}: the chat template refused the messages ({why})") from None


def _read_text(name: str, path: Path, budget: int, split: str) -> Iterator[tuple[str, str, bool, str]]:
    """(source, text, False, name) of a text file or of each ``.txt`` file in a directory, whole or per paragraph.

    A whole file is read up to ``budget`` characters (its opening is the prompt); per
    paragraph, the whole file, each paragraph cut to ``budget``.
    """
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise InputError(f"domain {name!r}: directory {path} has no .txt files")
    for file in files:
        text = read_text(file, f"domain {name!r}: file", max_bytes=4 * budget if split == "file" else None)
        if split == "file":
            if text.strip():
                yield file.name, text, False, name
            continue
        for number, paragraph in enumerate(re.split(r"\n\s*\n", text), 1):
            if paragraph.strip():
                yield f"{file.name}:paragraph {number}", paragraph[:budget], False, name
