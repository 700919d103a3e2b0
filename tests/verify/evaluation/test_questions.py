"""Question files (Spec-Bench / MT-bench rows): categories as sub-domains, each turn on the method's own answers, answer files."""

from __future__ import annotations

import importlib
import json
import shutil
from types import SimpleNamespace

import pytest
from bad_input import ANY_VALUE, assert_one_line_naming
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from draftsmith.proposers.core.errors import InputError
from draftsmith.verify.evaluation.domains import load_domain
from draftsmith.verify.evaluation.evaluate import EvalConfig, evaluate, load_prompts
from draftsmith.verify.evaluation.questions import (
    PLAIN_CHAT_TEMPLATE,
    load_questions,
    spec_bench_lengths,
    turn_prompt,
    use_chat_template,
)
from draftsmith.verify.target import load_target

EVALUATE = importlib.import_module("draftsmith.verify.evaluation.evaluate")  # the package's evaluate() hides the module
QUESTIONS = [  # Spec-Bench's shape: one- and two-turn rows of several categories, a reference on some
    {"question_id": 81, "category": "writing", "turns": ["the quick brown fox", "def add(a, b):"]},
    {"question_id": 82, "category": "math", "turns": ["the lazy dog jumps over the lazy dog"], "reference": ["a dog", "no"]},
    {"question_id": 83, "category": "coding", "turns": ["def add(a, b):\n    return a + b\ndef add(", "the quick brown"]},
    {"question_id": 84, "category": "writing", "turns": ["the quick brown fox jumps over the quick brown fox"]},
]
# Spec-Bench's evaluation/eval.py (hemingkx/Spec-Bench, fd2c1cd): the keys of an answer line and of its choice
ANSWER_KEYS = ["question_id", "category", "answer_id", "model_id", "choices", "tstamp"]
CHOICE_KEYS = ["index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"]


def write_rows(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def log_methods(monkeypatch, replace_tokens=None) -> list[tuple[str, str, list[int], list[int]]]:
    """(method, prompt source, the prompt ids the method was given, its new tokens) of every call, warm-up first.

    ``replace_tokens(name, prompt)``: new tokens that replace what the method made (None: keep them).
    """
    calls, build = [], EVALUATE.build_methods

    def logged(config, model, tokenizer):
        methods, proposers = build(config, model, tokenizer)

        def wrap(name, run):
            def logged_run(prompt, index):
                tokens, record, stats = run(prompt, index)
                tokens = (replace_tokens and replace_tokens(name, prompt)) or tokens
                calls.append((name, prompt.source, prompt.input_ids[0].tolist(), tokens))
                return tokens, record, stats

            return logged_run

        return {name: wrap(name, run) for name, run in methods.items()}, proposers

    monkeypatch.setattr(EVALUATE, "build_methods", logged)
    return calls


def config_for(target, questions, out, **overrides) -> EvalConfig:
    values = dict(target=str(target), domains={"bench": str(questions)}, proposers={"ngram": {"type": "ngram", "min_n": 1}})
    values.update(prompt_tokens=96, max_new_tokens=10, num_prompts=8, output_dir=str(out), adaptive=False)
    return EvalConfig(**(values | overrides))


@pytest.fixture(scope="module")
def run(tiny_target_dir, tmp_path_factory):
    """One evaluation of the question file: plain, ngram and ngram's transformers peer; its records, summary and answer files."""
    folder = tmp_path_factory.mktemp("questions")
    path = write_rows(folder / "question.jsonl", QUESTIONS)
    summary = evaluate(config_for(tiny_target_dir, path, folder / "out"), progress=False)
    records = [json.loads(line) for line in (folder / "out" / "records.jsonl").read_text().splitlines()]
    return SimpleNamespace(folder=folder, out=folder / "out", summary=summary, records=records)


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return load_target(tiny_target_dir)[1]


@pytest.fixture(scope="module")
def templateless_target(tiny_target_dir, tmp_path_factory):
    """The tiny target with a tokenizer that has no chat template."""
    path = tmp_path_factory.mktemp("templateless")
    shutil.copytree(tiny_target_dir, path, dirs_exist_ok=True)
    (path / "chat_template.jinja").unlink()
    assert AutoTokenizer.from_pretrained(path).chat_template is None
    return path


def test_every_category_is_a_sub_domain_with_a_record_per_turn(run):
    methods = ["plain", "ngram", "hf_prompt_lookup[ngram]"]
    domains = ["bench/writing", "bench/math", "bench/coding"]
    assert [(r["domain"], r["method"]) for r in run.summary["rows"]] == [(d, m) for d in domains for m in methods]
    turns = [(r["question_id"], r["turn"], r["category"], r["method"]) for r in run.records]
    assert turns == [(q["question_id"], t, q["category"], m) for q in QUESTIONS for t in range(1, len(q["turns"]) + 1) for m in methods]
    assert all(r["reference"] == (["a dog", "no"] if r["question_id"] == 82 else None) for r in run.records)
    assert all(isinstance(r["answer"], str) and r["source"].startswith("question.jsonl:") for r in run.records)
    rows = {(r["domain"], r["method"]): r for r in run.summary["rows"]}
    assert rows[("bench/writing", "plain")]["questions"] == 2 and rows[("bench/writing", "plain")]["prompts"] == 3
    assert "| bench/coding | ngram |" in (run.out / "table.md").read_text()


def test_greedy_outputs_of_every_turn_are_those_of_plain_decoding(run):
    assert {r["identical_to_plain"] for r in run.records} == {True}
    rows = {(r["domain"], r["method"]): r for r in run.summary["rows"]}
    assert rows[("bench/coding", "ngram")]["identical"] == "2/2"
    assert max(r["tau"] for r in run.summary["rows"] if r["method"] == "ngram") > 1  # the proposer's drafts were accepted


def test_speed_per_question_is_spec_benchs(run):
    """Spec-Bench: a question's tokens over its wall time summed over the turns, the mean over questions, over plain's."""
    by = {}
    for r in run.records:
        tokens, wall = by.get((r["domain"], r["method"], r["question_id"]), (0, 0.0))
        by[(r["domain"], r["method"], r["question_id"])] = (tokens + r["new_tokens"], wall + r["wall_time"])
    for row in run.summary["rows"]:
        speeds = {m: [t / w for (d, mm, _), (t, w) in by.items() if d == row["domain"] and mm == m] for m in (row["method"], "plain")}
        mean = {m: sum(s) / len(s) for m, s in speeds.items()}
        assert row["tokens_per_s_mean"] == pytest.approx(mean[row["method"]], rel=1e-9)
        assert row["speedup_spec_bench"] == pytest.approx(mean[row["method"]] / mean["plain"], rel=1e-9)
    questions = {(q["method"], q["question_id"]): q for q in run.summary["questions"]}
    assert len(questions) == 3 * len(QUESTIONS)
    assert questions[("ngram", 81)]["turns"] == 2 and questions[("plain", 81)]["speedup"] == 1.0
    tokens, wall = by[("bench/writing", "ngram", 81)]
    assert questions[("ngram", 81)]["tokens_per_s"] == pytest.approx(tokens / wall, rel=1e-9)


def test_the_answer_files_have_spec_benchs_fields_and_its_speed_reads_them(run, tiny_target_dir):
    folder = run.out / "model_answer"
    names = sorted(p.name for p in folder.iterdir())
    model = tiny_target_dir.name
    assert names == sorted(f"{model}-{m}.jsonl" for m in ("plain", "ngram", "hf_prompt_lookup[ngram]"))
    assert sorted(run.summary["paths"]["answers"]) == sorted(str(folder / n) for n in names)
    records = {(r["method"], r["question_id"], r["turn"]): r for r in run.records}
    for method in ("plain", "ngram", "hf_prompt_lookup[ngram]"):
        answers = [json.loads(line) for line in (folder / f"{model}-{method}.jsonl").read_text().splitlines()]
        assert [a["question_id"] for a in answers] == [q["question_id"] for q in QUESTIONS]
        lengths = []
        for answer, question in zip(answers, QUESTIONS, strict=True):
            assert list(answer) == ANSWER_KEYS and answer["model_id"] == f"{model}-{method}"
            assert answer["category"] == question["category"] and len(answer["choices"]) == 1
            choice = answer["choices"][0]
            assert list(choice) == CHOICE_KEYS and choice["index"] == 0
            turns = [records[(method, question["question_id"], t + 1)] for t in range(len(question["turns"]))]
            assert choice["turns"] == [r["answer"] for r in turns]
            assert choice["new_tokens"] == [r["new_tokens"] for r in turns] and choice["wall_time"] == [r["wall_time"] for r in turns]
            assert choice["decoding_steps"] == [r["target_forwards"] for r in turns]
            if method != "hf_prompt_lookup[ngram]":  # tokens per target forward, over the question's turns
                assert sum(choice["accept_lengths"]) == sum(choice["new_tokens"])
                assert len(choice["accept_lengths"]) == sum(choice["decoding_steps"])
            lengths += choice["accept_lengths"]
            # what Spec-Bench's speed.py computes of a line
            speed = sum(choice["new_tokens"]) / sum(choice["wall_time"])
            row = next(q for q in run.summary["questions"] if q["method"] == method and q["question_id"] == answer["question_id"])
            assert speed == pytest.approx(row["tokens_per_s"], rel=1e-9)
        if method == "plain":
            assert set(lengths) == {1}
        elif method == "ngram":
            assert max(lengths) > 1  # drafts accepted: more than one token a forward
        else:
            assert lengths == []  # a transformers peer: no per-step counts


def test_spec_bench_lengths_count_a_cut_last_step_without_its_bonus():
    record = SimpleNamespace(steps=3, accept_lengths=[2, 0, 1], truncated_steps=1)
    assert spec_bench_lengths(record) == [1, 3, 1, 1]  # 6 tokens: the prefill's, 2 + bonus, the bonus, 1 accepted and cut
    assert spec_bench_lengths(SimpleNamespace(steps=3, accept_lengths=[2, 0, 1], truncated_steps=0)) == [1, 3, 1, 2]
    assert spec_bench_lengths(SimpleNamespace(steps=None, accept_lengths=[], truncated_steps=None)) == []


def test_the_second_turn_is_given_the_methods_own_first_answer(tiny_target_dir, tmp_path, monkeypatch):
    """The prompt ids each method decodes turn 2 from hold its own turn-1 answer (ngram's is replaced to tell them apart)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    lazy = tokenizer(" the lazy dog", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    calls = log_methods(monkeypatch, lambda name, prompt: lazy if name == "ngram" and prompt.source.endswith("turn 1") else None)
    path = write_rows(tmp_path / "question.jsonl", QUESTIONS[:1])
    evaluate(config_for(tiny_target_dir, path, tmp_path / "out", peers=False), progress=False)
    timed = {(name, source): (ids, tokens) for name, source, ids, tokens in calls}  # the warm-up's calls are overwritten
    plain_ids, plain_first = timed[("plain", "question.jsonl:1 turn 1")][0], timed[("plain", "question.jsonl:1 turn 1")][1]
    assert tokenizer.decode(plain_ids) == "<bos>user: the quick brown fox\nassistant: "
    plain_answer = tokenizer.decode(plain_first, skip_special_tokens=True).strip()
    expected = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "the quick brown fox"},
            {"role": "assistant", "content": plain_answer},
            {"role": "user", "content": "def add(a, b):"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    second = timed[("plain", "question.jsonl:1 turn 2")][0]
    assert second == [tokenizer.bos_token_id] + tokenizer(expected, add_special_tokens=False).input_ids
    ngram_second = tokenizer.decode(timed[("ngram", "question.jsonl:1 turn 2")][0])
    assert ngram_second == "<bos>user: the quick brown fox\nassistant: the lazy dog\nuser: def add(a, b):\nassistant: "
    assert "the lazy dog" not in tokenizer.decode(second)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in records if r["method"] == "ngram"][0] == "the lazy dog"


def test_a_long_conversation_keeps_its_end(tokenizer, tmp_path):
    """Cut as a chat row is: the end, where the assistant's turn opens, stays."""
    path = write_rows(tmp_path / "q.jsonl", [{"turns": ["the quick brown fox " * 40, "def add"]}])
    (question,) = load_questions("q", path, tokenizer, 1, 24)
    prompt = turn_prompt(question, ["the lazy dog " * 40], tokenizer)
    assert prompt.input_ids.shape == (1, 24) and tokenizer.decode(prompt.input_ids[0]).endswith("user: def add\nassistant: ")
    assert prompt.source == "q.jsonl:1 turn 2" and question.domain == "q" and question.question_id == 1  # no category, no id


BAD_ROWS = [
    ({"question_id": 3, "category": "math", "turn": ["the fox"]}, "has no 'turns'"),
    ({"question_id": 3, "turns": "the fox"}, "'turns' must be a non-empty list of strings, got str"),
    ({"question_id": 3, "turns": []}, "'turns' must be a non-empty list of strings, got an empty list"),
    ({"question_id": 3, "turns": ["the fox", 7]}, "turn 2 must be a string, got int"),
    ({"question_id": 3, "turns": ["the fox"], "category": ["math"]}, "'category' must be a string, got list"),
    ({"question_id": [3], "turns": ["the fox"]}, "'question_id' must be an integer or a string, got list"),
    ({"prompt": "the fox"}, "is a 'prompt' / 'messages' row in a file of question rows"),
    ("[1, 2]", "must be an object {'question_id', 'category', 'turns': [str, ...]}, got list"),
    ("{not json", "is not valid JSON"),
]


@pytest.mark.parametrize("row, why", BAD_ROWS, ids=[why.split(" (")[0] for _, why in BAD_ROWS])
def test_a_bad_question_row_is_one_line_naming_the_file_and_the_row(row, why, tokenizer, tmp_path):
    path = write_rows(tmp_path / "question.jsonl", [QUESTIONS[0], "", row])  # a blank line between: line 3 is the bad row
    with pytest.raises(InputError) as err:
        load_questions("bench", path, tokenizer, num_questions=1, prompt_tokens=32)  # past the first question: every row is read
    assert_one_line_naming(err.value, f"{path}:3")
    assert why in str(err.value)


def test_bad_rows_and_missing_templates_fail_before_decoding_begins(tiny_target_dir, templateless_target, tmp_path, monkeypatch):
    def no_model_work(*args):
        raise AssertionError("decoding began before the question file was checked")

    monkeypatch.setattr(EVALUATE, "build_methods", no_model_work)
    path = write_rows(tmp_path / "question.jsonl", [*QUESTIONS, {"question_id": 9, "turns": ["the fox", None]}])
    with pytest.raises(InputError, match=r"question.jsonl:5 turn 2 must be a string, got NoneType"):
        evaluate(config_for(tiny_target_dir, path, tmp_path / "out", num_prompts=1), progress=False)
    good = write_rows(tmp_path / "good.jsonl", QUESTIONS)
    with pytest.raises(InputError) as err:
        evaluate(config_for(templateless_target, good, tmp_path / "out"), progress=False)
    assert_one_line_naming(err.value, str(good))
    assert "the tokenizer has none" in str(err.value) and "'chat_template'" in str(err.value) and "'plain'" in str(err.value)


def test_a_file_holds_question_rows_or_prompt_rows_not_both(tiny_target_dir, tokenizer, tmp_path):
    prompts_first = write_rows(tmp_path / "a.jsonl", [{"prompt": "the quick brown fox"}, QUESTIONS[0]])
    with pytest.raises(InputError, match=r"a.jsonl:2 is a question row \('turns'\) after 1 prompt / messages row\(s\)"):
        load_domain("a", prompts_first, tokenizer, 8, 16)
    questions_first = write_rows(tmp_path / "b.jsonl", [QUESTIONS[0], {"messages": [{"role": "user", "content": "hi"}]}])
    config = config_for(tiny_target_dir, questions_first, tmp_path / "out")
    model, tokenizer = load_target(tiny_target_dir)
    with pytest.raises(InputError, match=r"b.jsonl:2 is a 'prompt' / 'messages' row in a file of question rows"):
        load_prompts(config, model, tokenizer, questions=True)
    only_questions = write_rows(tmp_path / "c.jsonl", QUESTIONS)
    with pytest.raises(InputError, match=r"c.jsonl is a question file \(multi-turn\), which only draftsmith eval runs"):
        load_prompts(config_for(tiny_target_dir, only_questions, tmp_path / "out"), model, tokenizer)  # the engine check's call
    with pytest.raises(InputError, match=r"c.jsonl:1 is a question row \('turns'\): question files run turn by turn"):
        load_domain("c", only_questions, tokenizer, 8, 16)


def test_chat_template_plain_or_a_file_supplies_the_template(templateless_target, tmp_path, monkeypatch):
    calls = log_methods(monkeypatch)
    path = write_rows(tmp_path / "question.jsonl", QUESTIONS[:1])
    evaluate(config_for(templateless_target, path, tmp_path / "out", chat_template="plain", peers=False), progress=False)
    tokenizer = AutoTokenizer.from_pretrained(templateless_target)
    second = tokenizer.decode(next(ids for name, source, ids, _ in calls if source.endswith("turn 2")))
    assert second.startswith("<bos>User: the quick brown fox\n\nAssistant: ") and second.endswith("\n\nUser: def add(a, b):\n\nAssistant:")
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
    )
    use_chat_template(tokenizer, str(template))
    (question,) = load_questions("bench", path, tokenizer, 1, 64)
    assert tokenizer.decode(turn_prompt(question, ["no"], tokenizer).input_ids[0]) == (
        "<bos><user>the quick brown fox<assistant>no<user>def add(a, b):<bot>"
    )
    use_chat_template(tokenizer, "plain")
    assert tokenizer.chat_template == PLAIN_CHAT_TEMPLATE
    with pytest.raises(FileNotFoundError, match=r"chat_template file .*missing.jinja does not exist"):
        use_chat_template(tokenizer, str(tmp_path / "missing.jinja"))
    with pytest.raises(InputError, match="chat_template must be a jinja file's path, 'plain' or null"):
        EvalConfig.from_dict({"target": "t", "domains": {"a": "b"}, "chat_template": " "})
    tokenizer.chat_template = None
    chat = write_rows(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(
        InputError, match=r"chat.jsonl:1 has 'messages' but the tokenizer has no chat template; give one with .*'chat_template'"
    ):
        load_domain("chat", chat, tokenizer, 1, 16)


def test_a_template_that_refuses_a_later_turn_fails_when_the_file_is_read(tiny_target_dir, tmp_path):
    """Turn 2 renders an assistant message: a template without one fails on the file's two-turn row, not mid-run."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'user' %}{{ raise_exception('only user turns') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    path = write_rows(tmp_path / "question.jsonl", [QUESTIONS[1], QUESTIONS[0]])
    with pytest.raises(InputError, match=r"question.jsonl:2: the chat template refused the messages \(only user turns\)"):
        load_questions("bench", path, tokenizer, num_questions=1, prompt_tokens=32)


VALUES = st.one_of(ANY_VALUE, st.lists(st.one_of(st.text(max_size=6), st.integers()), max_size=3))
ROWS = st.one_of(
    st.dictionaries(st.sampled_from(["question_id", "category", "turns", "reference", "prompt", "domain"]), VALUES, max_size=4),
    st.fixed_dictionaries({"turns": st.lists(st.text(max_size=12), max_size=3)}, optional={"category": VALUES, "question_id": VALUES}),
)


def test_a_question_file_gives_questions_or_names_the_file_and_row(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("question_rows")

    @settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(ROWS, min_size=1, max_size=4), st.booleans())
    def check(rows, binary_tail):
        path = folder / "question.jsonl"
        path.write_bytes("".join(json.dumps(row) + "\n" for row in rows).encode() + (b"\xff\x00\n" if binary_tail else b""))
        try:
            questions = load_questions("q", path, tokenizer, num_questions=2, prompt_tokens=16)
        except (InputError, FileNotFoundError) as err:
            assert_one_line_naming(err, str(path))
            return
        assert not binary_tail and 1 <= len(questions) <= 2
        for question in questions:
            assert question.turns and all(isinstance(turn, str) for turn in question.turns)
            assert question.domain == (f"q/{question.category}" if question.category else "q")
            assert turn_prompt(question, [], tokenizer).input_ids.shape[1] <= 16

    check()
