"""Question files as domain files, run turn by turn; per-question speed and Spec-Bench's answer files.

A question file is JSONL with one question a line, ``{"question_id": int | str, "category":
str, "turns": [str, ...], "reference"?: ...}``: Spec-Bench's ``data/spec_bench/question.jsonl``,
MT-bench's ``question.jsonl`` and EAGLE's question files, read as they are (other keys are
left alone). A question of category ``c`` in domain ``name`` is reported as the sub-domain
``name/c``. Every row is checked before anything is decoded.

Turn t's prompt is the conversation so far, the user's turns and the method's *own* answers
to the earlier ones, rendered by the target tokenizer's chat template with the generation
prompt, as Spec-Bench and EAGLE build it (their ``evaluation/eval.py``); like a chat row, it
keeps its end when it is longer than ``prompt_tokens``. An answer is the decoded new tokens,
special tokens dropped and whitespace stripped, as in Spec-Bench's answer files.

Spec-Bench's speed (``evaluation/speed.py``) is per question: the new tokens over the wall
time summed over the question's turns, averaged over questions. ``write_answers`` writes a
method's answers in Spec-Bench's ``model_answer`` layout, which its ``speed.py`` reads.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.files import read_text

from .domains import MAX_CHARS_PER_TOKEN, TEMPLATE_HINT, Prompt, is_question_row, json_rows, render_chat

PLAIN_TEMPLATE = "plain"  # the eval config's ``chat_template`` value for the plain-text fallback
# "User: ...\n\nAssistant: ...\n\n" and so on, ending "Assistant:": for a base LM, or a tokenizer without a template.
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
ROW_SHAPE = "{'question_id', 'category', 'turns': [str, ...]}"


@dataclass(frozen=True)
class Question:
    """One question of a question file.

    Args:
        domain: ``name/category`` (``name`` when the row has no category).
        question_id: the row's (its line number when it has none).
        turns: the user's turns, in order.
        reference: the row's ``reference``, kept as it is (None: none).
        source: file and line, for the records.
        prompt_tokens: each turn's prompt is cut to this many tokens (keeping its end).
    """

    domain: str
    question_id: int | str
    category: str | None
    turns: tuple[str, ...]
    reference: Any
    source: str
    prompt_tokens: int


def use_chat_template(tokenizer, option: str | None) -> None:
    """Give ``tokenizer`` the eval config's ``chat_template``: None keeps its own, ``plain`` the plain-text one, else a jinja file's."""
    if option is None:
        return
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE if option == PLAIN_TEMPLATE else read_text(option, "chat_template file")


def is_question_file(path: str | Path) -> bool:
    """Whether ``path`` is a JSONL file whose first row is a question row (``load_questions`` checks the rest)."""
    path = Path(path)
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    try:
        for _, row in json_rows(path, str(path)):
            return is_question_row(row)
    except InputError:  # load_domain names the bad line
        return False
    return False


def load_questions(name: str, path: str | Path, tokenizer, num_questions: int, prompt_tokens: int) -> list[Question]:
    """The first ``num_questions`` questions of domain ``name`` in ``path``, after every row of the file has been checked.

    A bad row (no ``turns``, turns not a non-empty list of strings, a category that is not a
    string, a prompt / messages row) is one InputError naming the file and the line. Each
    conversation is also rendered once, with stand-in answers, so a template that refuses it
    fails here rather than after decoding has begun.
    """
    path = Path(path)
    where = f"domain {name!r}: {path}"
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError(f"{where} holds questions, rendered turn by turn by a chat template, and the tokenizer has none; {TEMPLATE_HINT}")
    questions = [_question(name, row, path, lineno, prompt_tokens, tokenizer) for lineno, row in json_rows(path, where)]
    if not questions:
        raise InputError(f"{where} holds no question")
    return questions[:num_questions]


def _question(name: str, row, path: Path, lineno: int, prompt_tokens: int, tokenizer) -> Question:
    where = f"domain {name!r}: {path}:{lineno}"
    if not isinstance(row, dict):
        raise InputError(f"{where} must be an object {ROW_SHAPE}, got {type(row).__name__}")
    if "prompt" in row or "messages" in row:
        raise InputError(f"{where} is a 'prompt' / 'messages' row in a file of question rows: a domain file holds one kind")
    if "turns" not in row:
        raise InputError(f"{where} has no 'turns': a question row is {ROW_SHAPE}")
    turns = row["turns"]
    if not isinstance(turns, list) or not turns:
        raise InputError(f"{where} 'turns' must be a non-empty list of strings, got {_kind(turns)}")
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, str):
            raise InputError(f"{where} turn {number} must be a string, got {_kind(turn)}")
    category = row.get("category")
    if category is not None and not isinstance(category, str):
        raise InputError(f"{where} 'category' must be a string, got {_kind(category)}")
    question_id = row.get("question_id", lineno)
    if isinstance(question_id, bool) or not isinstance(question_id, (int, str)):
        raise InputError(f"{where} 'question_id' must be an integer or a string, got {_kind(question_id)}")
    render_chat(conversation(turns, ["an answer"] * (len(turns) - 1)), tokenizer, where)
    domain = f"{name}/{category}" if category else name
    return Question(domain, question_id, category, tuple(turns), row.get("reference"), f"{path.name}:{lineno}", prompt_tokens)


def _kind(value) -> str:
    """A value's kind for a one-line message (never the value itself, which may span lines)."""
    return "an empty list" if value == [] else type(value).__name__


def conversation(turns: list[str] | tuple[str, ...], answers: list[str]) -> list[dict[str, str]]:
    """The messages of a conversation: each user turn, followed by its answer where there is one."""
    messages = []
    for number, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if number < len(answers):
            messages.append({"role": "assistant", "content": answers[number]})
    return messages


def turn_prompt(question: Question, answers: list[str], tokenizer) -> Prompt:
    """The prompt of the turn after ``answers``: the conversation so far through the chat template, cut to keep its end."""
    turn = len(answers) + 1
    text = render_chat(conversation(question.turns[:turn], answers), tokenizer, question.source)
    ids = tokenizer(text[-question.prompt_tokens * MAX_CHARS_PER_TOKEN :], add_special_tokens=False, verbose=False).input_ids
    if tokenizer.bos_token_id is not None and ids[:1] != [tokenizer.bos_token_id]:  # a template that writes the BOS gets no second one
        ids = [tokenizer.bos_token_id] + ids
    return Prompt(question.domain, torch.tensor([ids[-question.prompt_tokens :]]), f"{question.source} turn {turn}")


def run_turns(run: Callable, unit: Prompt | Question, index: int, tokenizer) -> list[tuple]:
    """(new tokens, record, stats) of each turn that a method (``run(prompt, index)``: ``build_methods``) makes of a prompt or a question.

    A question's turns run in order, each on the conversation with this method's own earlier
    answers; its records get the question's id, category and reference, the turn (from 1)
    and the answer text.
    """
    if isinstance(unit, Prompt):
        return [run(unit, index)]
    answers, done = [], []
    for turn in range(1, len(unit.turns) + 1):
        tokens, record, stats = run(turn_prompt(unit, answers, tokenizer), index)
        answers.append(tokenizer.decode(tokens, skip_special_tokens=True).strip())
        fields = {"question_id": unit.question_id, "category": unit.category, "reference": unit.reference}
        done.append((tokens, replace(record, turn=turn, answer=answers[-1], **fields), stats))
    return done


def question_speed(records: list) -> float:
    """Spec-Bench's tok/s of some records: per question (a ``prompt_index``), new tokens / wall time summed over its turns; the mean."""
    totals: dict[int, tuple[int, float]] = {}
    for r in records:
        tokens, wall = totals.get(r.prompt_index, (0, 0.0))
        totals[r.prompt_index] = (tokens + r.new_tokens, wall + r.wall_time)
    return statistics.mean(tokens / wall for tokens, wall in totals.values())


def question_rows(records: list, baseline: str) -> list[dict[str, Any]]:
    """Per question and method, for the records of question files: turns, new tokens, wall time, tok/s and speedup over ``baseline``'s."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for r in records:
        if r.turn is None:
            continue
        row = rows.setdefault((r.method, r.prompt_index), {"domain": r.domain, "method": r.method, "question_id": r.question_id})
        row["turns"] = r.turn
        row["new_tokens"] = row.get("new_tokens", 0) + r.new_tokens
        row["wall_time"] = row.get("wall_time", 0.0) + r.wall_time
    for row in rows.values():
        row["tokens_per_s"] = row["new_tokens"] / row["wall_time"]
    for (_, index), row in rows.items():
        row["speedup"] = row["tokens_per_s"] / rows[(baseline, index)]["tokens_per_s"]
    return list(rows.values())


def spec_bench_lengths(record) -> list[int]:
    """Spec-Bench's ``accept_lengths`` of a record: the tokens each target forward emitted (the prefill's one, then each step's
    accepted draft tokens + the recovered / bonus token; 1 each for plain decoding); [] for a transformers peer (no steps)."""
    if record.steps is None:
        return []
    lengths = [1] + [accepted + 1 for accepted in record.accept_lengths]
    if record.truncated_steps:  # only the last step can be cut (EOS, max_new_tokens): its bonus token was not emitted
        lengths[-1] -= 1
    return lengths


def write_answers(folder: Path, records: list, model: str) -> list[Path]:
    """One answer file per method in Spec-Bench's ``model_answer`` layout (``FOLDER/<model>-<method>.jsonl``), for question records.

    Each line is a question as Spec-Bench's ``evaluation/eval.py`` writes it: ``question_id``,
    ``category``, ``answer_id``, ``model_id``, ``choices: [{index, turns, decoding_steps,
    new_tokens, wall_time, accept_lengths}]`` (per turn, ``accept_lengths`` flat over the turns;
    ``decoding_steps``: target forwards) and ``tstamp``.
    """
    by_method: dict[str, dict[int, list]] = {}
    for r in records:
        if r.turn is not None:
            by_method.setdefault(r.method, {}).setdefault(r.prompt_index, []).append(r)
    paths = []
    for method, questions in by_method.items():
        model_id = f"{model}-{method}"
        lines = []
        for turns in questions.values():
            choice = {
                "index": 0,
                "turns": [r.answer for r in turns],
                "decoding_steps": [r.target_forwards for r in turns],
                "new_tokens": [r.new_tokens for r in turns],
                "wall_time": [r.wall_time for r in turns],
                "accept_lengths": [n for r in turns for n in spec_bench_lengths(r)],
            }
            answer = {"question_id": turns[0].question_id, "category": turns[0].category, "answer_id": uuid.uuid4().hex}
            lines.append(json.dumps({**answer, "model_id": model_id, "choices": [choice], "tstamp": time.time()}) + "\n")
        folder.mkdir(parents=True, exist_ok=True)
        paths.append(folder / f"{model_id}.jsonl")
        paths[-1].write_text("".join(lines))
    return paths
