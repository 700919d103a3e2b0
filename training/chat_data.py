"""Chat conversations as users bring them: checked row by row, normalised to role / content turns, rendered.

Two layouts, both normalised to ``[{"role": "user" | "assistant" | "system", "content": str}]``
as SpecForge and vLLM's speculators do:

- ShareGPT: ``{"id", "conversations": [{"from": "human" | "gpt" | "system", "value": str}]}``;
- messages (UltraChat, OpenAI): ``{"messages": [{"role": "user" | "assistant" | "system", "content": str}]}``.

``data.chat_format`` names one for every row (``sharegpt``: the ``conversations`` field,
``from`` / ``value`` turns; ``messages``: the ``data.messages_field`` field, ``role`` /
``content`` turns), or ``auto`` (the default) reads each row as it comes: its turns are in
its ``messages_field`` field, else in its ``conversations`` field, and its first turn says
the naming (``from`` = ShareGPT's, else ``role`` / ``content``). So SpecForge's own
``{"conversations": [{"role", "content"}]}`` rows read too.

The loss mask comes from the rendered template: the tokens inside its
``{% generation %}`` blocks (``apply_chat_template(..., return_assistant_tokens_mask=True)``),
never from matching the turns' text, so templates that rewrite earlier turns (Qwen3 drops
their ``<think>`` blocks) are masked as rendered.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from datasets import Dataset

from draftsmith.proposers.core.errors import InputError

CHAT_FORMATS = ("auto", "sharegpt", "messages")
SHAREGPT_FIELD = "conversations"


@dataclass(frozen=True)
class TurnNaming:
    """How one layout names a turn's speaker and text, and its speakers' roles."""

    name: str
    role_key: str
    content_key: str
    roles: dict[str, str]  # the layout's role name -> user / assistant / system


SHAREGPT = TurnNaming("ShareGPT", "from", "value", {"human": "user", "gpt": "assistant", "system": "system"})
MESSAGES = TurnNaming("messages", "role", "content", {"user": "user", "assistant": "assistant", "system": "system"})


def _json_kind(value) -> str:
    """The JSON name of a parsed value's type (for errors about a user's file)."""
    kinds = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _present(row: dict, key: str) -> bool:
    # datasets fills the fields a row lacks with None, so absent and null read the same
    return isinstance(row, Mapping) and row.get(key) is not None  # datasets hands rows over as a Mapping


def row_layout(row: dict, chat_format: str, messages_field: str) -> tuple[str, TurnNaming]:
    """The field that holds a row's turns and how they are named, under ``data.chat_format``."""
    if chat_format == "sharegpt":
        return SHAREGPT_FIELD, SHAREGPT
    if chat_format == "messages":
        return messages_field, MESSAGES
    field = messages_field if _present(row, messages_field) else SHAREGPT_FIELD
    turns = row.get(field)
    first = turns[0] if isinstance(turns, list) and turns else None
    return field, SHAREGPT if _present(first, "from") and not _present(first, "role") else MESSAGES


def conversation_problem(row: dict, chat_format: str, messages_field: str) -> str | None:
    """What makes a parsed JSON row unusable as a conversation to train on, in a few words; None when it is fine."""
    field, naming = row_layout(row, chat_format, messages_field)
    if not _present(row, field):
        if chat_format == "auto":
            return f"has neither a {messages_field!r} nor a {SHAREGPT_FIELD!r} field (data.chat_format: auto)"
        return f"has no {field!r} field (data.chat_format: {chat_format})"
    turns = row[field]
    if not isinstance(turns, list):
        return f"{field!r} must be a list of turns, got {_json_kind(turns)}"
    if not turns:
        return f"has an empty conversation ({field!r} is [])"
    roles = ", ".join(naming.roles)
    for i, turn in enumerate(turns, 1):
        if not isinstance(turn, dict):
            return f"turn {i} must be an object, got {_json_kind(turn)}"
        for key in (naming.role_key, naming.content_key):
            if key not in turn:
                if chat_format == "auto" and i == 1 and key == "role":
                    return "turn 1 has neither a 'role' nor a 'from' field"
                return f"turn {i} has no {key!r} field ({naming.name} turns are {{{naming.role_key!r}, {naming.content_key!r}}})"
        role, content = turn[naming.role_key], turn[naming.content_key]
        if not isinstance(role, str) or role not in naming.roles:
            return f"turn {i} has unknown role {role!r} ({naming.name} roles: {roles})"
        if not isinstance(content, str):
            return f"turn {i} {naming.content_key!r} must be a string, got {_json_kind(content)}"
    last = turns[-1][naming.role_key]
    if naming.roles[last] != "assistant":
        assistant = next(name for name, role in naming.roles.items() if role == "assistant")
        return f"ends on a {last!r} turn: a conversation to train on ends on an assistant ({assistant!r}) turn"
    return None


def check_conversation(row: dict, where: str, chat_format: str, messages_field: str) -> None:
    """InputError naming ``where`` (the file and row) when a row is not a conversation to train on."""
    problem = conversation_problem(row, chat_format, messages_field)
    if problem is not None:
        raise InputError(f"{where}: {problem}")


def normalise_conversation(row: dict, chat_format: str, messages_field: str) -> list[dict[str, str]]:
    """A checked row's turns as ``[{"role": user | assistant | system, "content": str}]``."""
    field, naming = row_layout(row, chat_format, messages_field)
    return [{"role": naming.roles[turn[naming.role_key]], "content": turn[naming.content_key]} for turn in row[field]]


def normalise_rows(rows: Dataset, chat_format: str, messages_field: str) -> Dataset:
    """Rows of checked conversations (any layout) as one ``messages`` column of role / content turns."""
    return rows.map(
        lambda row: {"messages": normalise_conversation(row, chat_format, messages_field)},
        remove_columns=rows.column_names,
        desc="normalise chat",
    )


def has_generation_markers(tokenizer) -> bool:
    """Whether the chat template marks assistant output with ``{% generation %}`` (needed for the assistant mask)."""
    return bool(re.search(r"{%-?\s*generation\s*-?%}", str(tokenizer.chat_template or "")))


def check_template(tokenizer) -> None:
    if not has_generation_markers(tokenizer):
        raise InputError(
            "the tokenizer's chat template has no {% generation %} markers, so assistant tokens cannot be told apart "
            "(docs/training.md#chat-data says how to add them)"
        )


def render_chat(rows: Dataset, tokenizer, messages_field: str, block_size: int) -> Dataset:
    """Render conversations with the chat template; ``loss_mask[t]`` is set where token ``t + 1`` is an assistant token."""
    if messages_field not in rows.column_names:
        raise InputError(f"data rows have no {messages_field!r} field (columns: {rows.column_names}); set data.messages_field")
    check_template(tokenizer)

    def render(row):
        out = tokenizer.apply_chat_template(row[messages_field], return_dict=True, return_assistant_tokens_mask=True)
        ids, assistant = out["input_ids"][:block_size], out["assistant_masks"][:block_size]
        return {"input_ids": ids, "loss_mask": assistant[1:] + [0]}

    return rows.map(render, remove_columns=rows.column_names, desc="render chat")


def reply_end(tokenizer) -> str:
    """The text the template puts after an assistant turn's content inside its generation block (``<|im_end|>``), or ''."""
    probe = "draftsmith-probe"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}]
    out = tokenizer.apply_chat_template(turns, return_dict=True, return_assistant_tokens_mask=True)
    text = tokenizer.decode(
        [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m], clean_up_tokenization_spaces=False
    )
    at = text.rfind(probe)
    return text[at + len(probe) :] if at >= 0 else ""


def reply_stop_ids(tokenizer, end: str) -> list[int]:
    """Token ids that end a generated reply: EOS, and the end-of-turn token when ``end`` starts with a special token."""
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    first = tokenizer.encode(end.lstrip(), add_special_tokens=False)[:1] if end.strip() else []
    if first and first[0] in tokenizer.added_tokens_decoder and first[0] not in stops:
        stops.append(first[0])
    return stops


def reply_text(tokenizer, new_ids: list[int], stop_ids: list[int], end: str) -> str:
    """A generated reply's content: its tokens before the stop token, decoded, cut at the template's turn end."""
    if new_ids and new_ids[-1] in stop_ids:
        new_ids = new_ids[:-1]
    text = tokenizer.decode(new_ids, clean_up_tokenization_spaces=False)
    return text[: text.find(end)] if end.strip() and end in text else text
