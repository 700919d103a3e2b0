"""Chat data: ShareGPT and UltraChat files train as they are, the loss on every assistant turn; self-distillation
regenerates every assistant turn; bad rows are one line naming the file and row, before the target loads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from bad_input import assert_one_line_naming
from datasets import Dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

import draftsmith.training.train as train_module
from draftsmith.proposers.core.errors import InputError
from draftsmith.training.chat_data import normalise_conversation, reply_end, reply_stop_ids
from draftsmith.training.data import build_dataset, check_files, render_chat
from draftsmith.training.draft_lm import DraftLMObjective
from draftsmith.training.recipe import load_config
from draftsmith.training.train import run

from tiny_recipe import REPO, recipe_overrides

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}
# Contents in the tiny tokenizer's own words (few tokens each); one or two exchanges, some with a system turn.
CONVERSATIONS = [
    [("system", "be brief")] * (i % 2)
    + [("user", f"def f{i}(x):"), ("assistant", f"return x * {i}")]
    + [("user", f"The fox number {i}"), ("assistant", f"jumps over the lazy dog {i % 5} times.")] * (i % 3 != 0)
    for i in range(8)
]


def as_messages(turns):
    return [{"role": role, "content": content} for role, content in turns]


def sharegpt_row(turns, i=0) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": SHAREGPT_ROLE[role], "value": content} for role, content in turns]}


def ultrachat_row(turns, i=0) -> dict:
    return {"prompt_id": f"p{i}", "prompt": turns[-2][1], "messages": as_messages(turns)}


LAYOUTS = {"sharegpt": sharegpt_row, "ultrachat": ultrachat_row}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def chat_config(target_dir, data_file, root, *extra):
    overrides = recipe_overrides(target_dir, data_file, root, "data.format=chat", "data.block_size=64", *extra)
    return load_config(REPO / "recipes" / "training" / "distill_draft_full.yaml", overrides)


def trained_runs(ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The tokens whose prediction is trained (token t + 1 where loss_mask[t]), in runs of consecutive positions."""
    runs, last = [], None
    for t, on in enumerate(loss_mask[: len(ids) - 1]):
        if on:
            if last != t - 1:
                runs.append([])
            runs[-1].append(ids[t + 1])
            last = t
    return runs


def assistant_turns(turns) -> list[str]:
    """What the demo template renders of each assistant turn: its content and the end-of-turn token."""
    return [content + "<|end|>" for role, content in turns if role == "assistant"]


# --- the real loop ---------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_chat_file_trains_with_the_loss_on_exactly_every_assistant_turn(layout, target_dir, tmp_path, monkeypatch):
    """A ShareGPT or UltraChat file as it is (``chat_format: auto``), three steps of the real loop: in every batch, the
    trained tokens of each row are its conversation's assistant turns, each turn one run, and nothing else."""
    data_file = write_jsonl(tmp_path / f"{layout}.jsonl", [LAYOUTS[layout](turns, i) for i, turns in enumerate(CONVERSATIONS)])
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    expected = {tokenizer.apply_chat_template(as_messages(turns), tokenize=False): turns for turns in CONVERSATIONS}
    assert all(len(tokenizer(text, add_special_tokens=False)["input_ids"]) < 64 for text in expected)  # nothing truncated
    seen, loss = [], DraftLMObjective.loss
    monkeypatch.setattr(
        DraftLMObjective, "loss", lambda self, draft, batch, captured: seen.append(batch) or loss(self, draft, batch, captured)
    )
    out = run(chat_config(target_dir, data_file, tmp_path, "max_steps=3"))
    curve = [p["train_loss"] for p in json.loads((out / "loss_curve.json").read_text()) if "train_loss" in p]
    assert len(curve) == 3 and all(torch.isfinite(torch.tensor(curve)))
    found = set()
    for batch in seen:
        for ids, mask in zip(batch["input_ids"].tolist(), batch["loss_mask"].tolist(), strict=True):
            while ids[-1] == tokenizer.pad_token_id:  # right padding
                ids = ids[:-1]
            text = tokenizer.decode(ids)
            assert text in expected, text
            runs = [tokenizer.decode(run) for run in trained_runs(ids, mask)]
            assert runs == assistant_turns(expected[text]), text
            found.add(text)
    assert found == set(expected)  # every conversation, two-turn ones included, went through the loop


def test_sharegpt_and_ultrachat_rows_of_one_conversation_train_on_the_same_tokens(target_dir, tmp_path):
    """Named or detected, both layouts (and SpecForge's role / content ``conversations``) normalise to one conversation."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    rows = {}
    variants = {
        ("sharegpt", "auto"): [sharegpt_row(t) for t in CONVERSATIONS],
        ("sharegpt", "sharegpt"): [sharegpt_row(t) for t in CONVERSATIONS],
        ("ultrachat", "auto"): [ultrachat_row(t) for t in CONVERSATIONS],
        ("ultrachat", "messages"): [ultrachat_row(t) for t in CONVERSATIONS],
        ("specforge", "auto"): [{"id": "x", "conversations": as_messages(t)} for t in CONVERSATIONS],
        ("mixed", "auto"): [(sharegpt_row if i % 2 else ultrachat_row)(t) for i, t in enumerate(CONVERSATIONS)],
    }
    for (name, chat_format), file_rows in variants.items():
        data_file = write_jsonl(tmp_path / f"{name}-{chat_format}.jsonl", file_rows)
        cfg = chat_config(target_dir, data_file, tmp_path, f"data.chat_format={chat_format}")
        check_files(cfg.data.train_files, cfg.data)
        built = build_dataset(cfg, cfg.data.train_files, tokenizer, None, tmp_path / "run")
        rows[name, chat_format] = (built["input_ids"], built["loss_mask"])
    plain = render_chat(Dataset.from_list([{"messages": as_messages(t)} for t in CONVERSATIONS]), tokenizer, "messages", 64)
    assert all(value == (plain["input_ids"], plain["loss_mask"]) for value in rows.values()), list(rows)


def test_a_named_layout_refuses_the_other_one(target_dir, tmp_path):
    for chat_format, row, field in (
        ("sharegpt", ultrachat_row(CONVERSATIONS[1]), "conversations"),
        ("messages", sharegpt_row(CONVERSATIONS[1]), "messages"),
    ):
        data_file = write_jsonl(tmp_path / f"{chat_format}.jsonl", [row])
        cfg = chat_config(target_dir, data_file, tmp_path, f"data.chat_format={chat_format}")
        with pytest.raises(InputError, match=rf"has no '{field}' field \(data.chat_format: {chat_format}\)") as caught:
            check_files(cfg.data.train_files, cfg.data)
        assert_one_line_naming(caught.value, f"{data_file}:1")


# A Qwen3-style template on the demo tokens: an assistant turn before the last user turn loses its
# <think> block when rendered; the last one keeps it. Its assistant turns are {% generation %} blocks.
REWRITING_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% set content = message['content'] %}"
    "{% if loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{% endif %}"
    "{{ '<|assistant|>\n' }}{% generation %}{{ content + '<|end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_is_masked_as_rendered(target_dir, tmp_path):
    """Three exchanges under a template that strips <think> from earlier assistant turns: the trained tokens are each
    turn as rendered (stripped, stripped, kept), never the turns' text as written in the file."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.chat_template = REWRITING_TEMPLATE
    assert reply_end(tokenizer) == "<|end|>"
    turns = [
        ("user", "def f1(x):"),
        ("assistant", "<think>\nthe fox\n</think>\n\nreturn x"),
        ("user", "def f2(x):"),
        ("assistant", "<think>\nthe dog\n</think>\n\nreturn x * 2"),
        ("user", "def f3(x):"),
        ("assistant", "<think>\nlazy\n</think>\n\nreturn x * 3"),
    ]
    data_file = write_jsonl(tmp_path / "think.jsonl", [sharegpt_row(turns)])
    cfg = chat_config(target_dir, data_file, tmp_path, "data.block_size=256")
    row = build_dataset(cfg, cfg.data.train_files, tokenizer, None, tmp_path / "run")[0]
    rendered = tokenizer.decode(row["input_ids"])
    assert "the fox" not in rendered and "the dog" not in rendered and "lazy" in rendered  # the template did rewrite
    runs = [tokenizer.decode(run) for run in trained_runs(row["input_ids"], row["loss_mask"])]
    assert runs == ["return x<|end|>", "return x * 2<|end|>", "<think>\nlazy\n</think>\n\nreturn x * 3<|end|>"]


def test_chat_rows_may_hold_line_separators(target_dir, tmp_path):
    """U+2028 and U+0085 are legal inside JSON strings: a JSONL row is cut at newlines only (str.splitlines cut it)."""
    turns = [("user", "the fox\u2028jumps"), ("assistant", "over\x85the dog")]
    data_file = write_jsonl(tmp_path / "separators.jsonl", [ultrachat_row(turns), sharegpt_row(CONVERSATIONS[1])])
    cfg = chat_config(target_dir, data_file, tmp_path)
    check_files(cfg.data.train_files, cfg.data)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    row = build_dataset(cfg, cfg.data.train_files, tokenizer, None, tmp_path / "run")[0]
    assert [tokenizer.decode(run) for run in trained_runs(row["input_ids"], row["loss_mask"])] == ["over\x85the dog<|end|>"]


# --- self-distillation ---------------------------------------------------------------


def greedy_reply(target, tokenizer, turns, max_new_tokens) -> str:
    """The oracle: the target's greedy reply to ``turns``, rendered with the generation prompt, cut at its end of turn."""
    prompt = tokenizer.apply_chat_template(as_messages(turns), add_generation_prompt=True, return_dict=True)["input_ids"]
    end_of_turn = tokenizer.convert_tokens_to_ids("<|end|>")
    out = target.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[tokenizer.eos_token_id, end_of_turn]
    )
    new = out[0, len(prompt) :].tolist()
    for stop in (tokenizer.eos_token_id, end_of_turn):
        new = new[: new.index(stop)] if stop in new else new
    return tokenizer.decode(new)


def test_self_distillation_regenerates_both_turns_each_on_the_targets_own_first_reply(target_dir, tmp_path, monkeypatch):
    """Two-turn conversations: the rows hold the target's greedy replies to both turns, with the loss on them, and
    turn 2 was prompted with the target's own first reply (the prompts the target saw are checked, not only its output)."""
    two_turn = [turns for turns in CONVERSATIONS if sum(role == "assistant" for role, _ in turns) == 2][:3]
    data_file = write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt_row(turns, i) for i, turns in enumerate(two_turn)])
    sd = ["data.self_distill.enabled=true", "data.self_distill.num_prompts=3", "data.self_distill.max_new_tokens=6"]
    cfg = chat_config(target_dir, data_file, tmp_path, "data.block_size=128", *sd, f"data.self_distill.cache_dir={tmp_path / 'sd'}")
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    assert reply_stop_ids(tokenizer, reply_end(tokenizer)) == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>")]
    prompts, generate = [], target.generate

    def spy(input_ids, attention_mask, **kwargs):
        prompts.extend([ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)])
        return generate(input_ids, attention_mask=attention_mask, **kwargs)

    monkeypatch.setattr(target, "generate", spy)
    rows = build_dataset(cfg, cfg.data.train_files, tokenizer, target, tmp_path / "run")
    monkeypatch.undo()
    assert len(rows) == 3
    expected_prompts = [[], []]
    for turns, row in zip(two_turn, rows, strict=True):
        head, answer1, user2, answer2 = turns[:-3], turns[-3][1], turns[-2][1], turns[-1][1]
        first = greedy_reply(target, tokenizer, head, 6)
        second = greedy_reply(target, tokenizer, [*head, ("assistant", first), ("user", user2)], 6)
        for k, so_far in enumerate((head, [*head, ("assistant", first), ("user", user2)])):
            expected_prompts[k].append(
                tokenizer.apply_chat_template(as_messages(so_far), add_generation_prompt=True, return_dict=True)["input_ids"]
            )
        expected = [*head, ("assistant", first), ("user", user2), ("assistant", second)]
        assert row["input_ids"] == tokenizer.apply_chat_template(as_messages(expected), return_dict=True)["input_ids"]
        runs = [tokenizer.decode(run) for run in trained_runs(row["input_ids"], row["loss_mask"])]
        assert runs == [first + "<|end|>", second + "<|end|>"]
        assert answer1 not in tokenizer.decode(row["input_ids"]) and answer2 not in tokenizer.decode(row["input_ids"])
    assert prompts == expected_prompts[0] + expected_prompts[1]  # every first turn, then every second turn on its own reply
    assert not any(answer in tokenizer.decode(p) for p in prompts for answer in (t[-3][1] for t in two_turn))
    # cached: a second build does not ask the target again
    monkeypatch.setattr(target, "generate", lambda *a, **k: pytest.fail("regenerated despite the cache"))
    assert build_dataset(cfg, cfg.data.train_files, tokenizer, target, tmp_path / "run")["input_ids"] == rows["input_ids"]


def test_self_distillation_ends_a_conversation_before_a_turn_with_no_room(target_dir, tmp_path):
    """A block that fits the shorter first prompts only: those conversations end after their regenerated first turn
    (never on a user turn, never with the file's own answers), the others are dropped."""
    two_turn = [turns for turns in CONVERSATIONS if sum(role == "assistant" for role, _ in turns) == 2][:3]
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)

    def prompt_length(turns):
        return len(tokenizer.apply_chat_template(as_messages(turns), add_generation_prompt=True, return_dict=True)["input_ids"])

    room = 6 + 1  # max_new_tokens and <|end|>
    block = min(prompt_length(turns[:-3]) for turns in two_turn) + room
    expected = []
    for turns in two_turn:
        if prompt_length(turns[:-3]) + room <= block:
            first = greedy_reply(target, tokenizer, turns[:-3], 6)
            assert prompt_length([*turns[:-3], ("assistant", first), turns[-2]]) + room > block  # turn 2 has no room
            # cut at block_size like every chat row (a random target's reply can re-encode longer: invalid UTF-8 becomes U+FFFD)
            rendered = tokenizer.apply_chat_template(as_messages([*turns[:-3], ("assistant", first)]), return_dict=True)
            expected.append(rendered["input_ids"][:block])
    assert 0 < len(expected) < len(two_turn)  # some kept, some dropped
    data_file = write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt_row(turns, i) for i, turns in enumerate(two_turn)])
    sd = ["data.self_distill.enabled=true", "data.self_distill.max_new_tokens=6", f"data.self_distill.cache_dir={tmp_path / 'sd'}"]
    cfg = chat_config(target_dir, data_file, tmp_path, f"data.block_size={block}", *sd)
    assert build_dataset(cfg, cfg.data.train_files, tokenizer, target, tmp_path / "run")["input_ids"] == expected


# --- bad rows ------------------------------------------------------------------------

NAMINGS = {
    "sharegpt": ("conversations", "from", "value", {"user": "human", "assistant": "gpt", "system": "system"}),
    "messages": ("messages", "role", "content", {"user": "user", "assistant": "assistant", "system": "system"}),
}
TEXT = st.text(max_size=12)
GOOD_TURNS = st.builds(
    lambda system, exchanges: system + [turn for pair in exchanges for turn in pair],
    st.lists(st.tuples(st.just("system"), TEXT), max_size=1),
    st.lists(st.tuples(st.tuples(st.just("user"), TEXT), st.tuples(st.just("assistant"), TEXT)), min_size=1, max_size=3),
)
# What each class of bad row must say, beside the file and row.
BAD_ROWS = {
    "unknown role": "unknown role",
    "missing field": r"has no|neither",
    "empty conversation": "empty conversation",
    "ends on a user turn": "ends on a",
    "non-string content": "must be a string",
}


def encode(turns, layout: str) -> dict:
    field, role_key, content_key, roles = NAMINGS[layout]
    return {field: [{role_key: roles[role], content_key: content} for role, content in turns]}


@st.composite
def bad_row(draw, layout: str, kind: str) -> dict:
    """A good conversation in ``layout``, broken one way."""
    field, role_key, content_key, roles = NAMINGS[layout]
    row = encode(draw(GOOD_TURNS), layout)
    turns = row[field]
    at = draw(st.integers(0, len(turns) - 1))
    if kind == "unknown role":
        names = st.sampled_from(["bot", "Human", "model", "tool", "", "user", "assistant", "human", "gpt", "chatgpt"])
        turns[at][role_key] = draw(st.one_of(names, st.text(max_size=6)).filter(lambda r: r not in roles.values()))
    elif kind == "missing field":
        choice = draw(st.sampled_from(["row", role_key, content_key]))
        if choice == "row":
            del row[field]
        else:
            del turns[at][choice]
    elif kind == "empty conversation":
        row[field] = []
    elif kind == "ends on a user turn":
        turns.append({role_key: roles["user"], content_key: draw(TEXT)})
    else:
        turns[at][content_key] = draw(
            st.one_of(
                st.none(), st.integers(), st.floats(), st.booleans(), st.lists(TEXT, max_size=2), st.dictionaries(TEXT, TEXT, max_size=1)
            )
        )
    return row


def test_every_bad_row_is_one_line_naming_the_file_and_row_before_the_target_loads(target_dir, text_file, tmp_path, monkeypatch):
    monkeypatch.setattr(train_module, "load_frozen_target", lambda *a, **k: pytest.fail("the target was loaded before the check"))
    base = chat_config(target_dir, text_file, tmp_path)

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(
        st.data(), st.sampled_from(sorted(NAMINGS)), st.sampled_from(sorted(BAD_ROWS)), st.sampled_from(["auto", "named"]), st.booleans()
    )
    def check(data, layout, kind, chat_format, json_list):
        good = data.draw(st.lists(GOOD_TURNS.map(lambda t: encode(t, layout)), max_size=3))
        at = data.draw(st.integers(0, len(good)))
        rows = [*good[:at], data.draw(bad_row(layout, kind)), *good[at:]]
        if json_list:
            path = tmp_path / "bad.json"
            path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
            where = f"{path} row {at + 1}"
        else:
            blank = data.draw(st.booleans())  # a blank line still counts as a line of the file
            path = write_jsonl(tmp_path / "bad.jsonl", rows)
            if blank:
                path.write_text("\n" + path.read_text(encoding="utf-8"), encoding="utf-8")
            where = f"{path}:{at + 1 + blank}"
        named = layout if chat_format == "named" else "auto"
        cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, train_files=[str(path)], chat_format=named))
        with pytest.raises(InputError, match=BAD_ROWS[kind]) as caught:
            run(cfg)
        assert_one_line_naming(caught.value, where)

    check()


def test_good_rows_of_either_layout_pass_and_normalise_to_their_conversation(target_dir, text_file, tmp_path):
    """The control of the test above: unbroken rows, any text in them, pass the check and read back as written."""
    base = chat_config(target_dir, text_file, tmp_path)

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(GOOD_TURNS, st.sampled_from(sorted(NAMINGS))), min_size=1, max_size=4))
    def check(conversations):
        rows = [encode(turns, layout) for turns, layout in conversations]
        path = write_jsonl(tmp_path / "good.jsonl", rows)
        check_files([str(path)], base.data)
        for (turns, layout), row in zip(conversations, rows, strict=True):
            assert normalise_conversation(row, "auto", "messages") == as_messages(turns)
            assert normalise_conversation(row, layout, "messages") == as_messages(turns)

    check()


def test_chat_data_must_be_json(target_dir, text_file, tmp_path):
    cfg = chat_config(target_dir, text_file, tmp_path)
    with pytest.raises(InputError, match="data.format chat reads conversations from JSON rows") as caught:
        check_files(cfg.data.train_files, cfg.data)
    assert_one_line_naming(caught.value, str(text_file))
