"""Per-domain evaluation on a tiny model: outputs, fields, greedy identity, bad input."""

from __future__ import annotations

import importlib
import json
from collections import Counter
from dataclasses import replace

import pytest
import yaml

from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.proposer import ProposerBase
from draftsmith.proposers.core.types import Draft
from draftsmith.training.cli import main
from draftsmith.verify.evaluation.domains import load_domain
from draftsmith.verify.evaluation.evaluate import DomainFile, EvalConfig, build_methods, evaluate
from draftsmith.verify.target import load_target


@pytest.fixture()
def domain_files(tmp_path):
    code = tmp_path / "code.jsonl"
    code.write_text(
        "\n".join(json.dumps({"prompt": f"def add(a, b):\n    return a + b\n# {i}\ndef add(", "domain": "code"}) for i in range(3)) + "\n"
    )
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "the quick brown fox"}], "domain": "chat"}) + "\n")
    prose = tmp_path / "prose"
    prose.mkdir()
    (prose / "a.txt").write_text("the quick brown fox jumps over the lazy dog. the quick brown")
    return {"code": str(code), "chat": str(chat), "prose": str(prose)}


def ngram_on_code(target, domain_files, out, **fields) -> EvalConfig:
    """A small config: the code domain, one ``ngram`` row, no peers (``fields`` on top)."""
    base = {"num_prompts": 2, "prompt_tokens": 24, "max_new_tokens": 8}
    return EvalConfig(
        target=str(target),
        domains={"code": domain_files["code"]},
        proposers={"ngram": {"type": "ngram", "min_n": 1}},
        peers=False,
        output_dir=str(out),
        **(base | fields),
    )


def test_eval_writes_every_output_with_the_right_fields(tiny_target_dir, domain_files, tmp_path):
    config = EvalConfig(
        target=str(tiny_target_dir),
        domains=domain_files,
        proposers={"ngram": {"type": "ngram", "min_n": 1}, "ngram_tree": {"type": "ngram", "min_n": 1, "branches": 3}},
        num_prompts=2,
        prompt_tokens=24,
        max_new_tokens=12,
        output_dir=str(tmp_path / "out"),
        adaptive=False,  # drafts every step: on a model this tiny the controller, on the real clock, may rightly go plain
    )
    summary = evaluate(config, progress=False)
    out = tmp_path / "out"
    for name in ("records.jsonl", "summary.json", "table.md", "tau_speedup.png", "acceptance_by_depth.png"):
        assert (out / name).stat().st_size > 0, name
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    methods = {"plain", "ngram", "ngram_tree", "hf_prompt_lookup[ngram]"}  # a tree has no transformers peer
    assert {r["method"] for r in records} == methods
    assert len(records) == len(methods) * (2 + 1 + 1)  # code: 2 prompts, chat: 1, prose: 1
    for r in records:
        assert {"domain", "new_tokens", "target_forwards", "accept_lengths", "wall_time", "tau", "speedup", "truncated_steps"} <= set(r)
        assert r["identical_to_plain"] is True  # greedy: every method's output equals plain decoding
        assert r["target_forwards"] >= 1 and r["new_tokens"] >= 1
    rows = {(r["domain"], r["method"]): r for r in summary["rows"]}
    assert rows[("code", "plain")]["tau"] == 1.0 and rows[("code", "plain")]["speedup"] == 1.0
    assert rows[("code", "ngram")]["identical"] == "2/2"
    assert rows[("code", "ngram")]["acceptance_by_depth"]["given_reached"]  # the copy prompt gets drafts
    for row in summary["rows"]:
        assert row["speedup_spec_bench"] > 0 and row["tokens_per_s_mean"] > 0
        if row["method"].startswith("hf_prompt_lookup"):  # a peer: no per-depth counts
            assert row["tau_from_rates"] is None and row["acceptance_by_depth"] is None and row["steps"] is None
        else:  # ours: the counters rebuild the measured tau over the domain
            assert row["requests"] == row["prompts"]
            assert abs(row["tau_from_rates"] - row["tau"]) <= 1e-12, row
    assert "| code | ngram |" in (out / "table.md").read_text()


class PeerlessProposer(ProposerBase):
    """A proposer that declares no peer: ``ProposerBase.transformers_peer`` says None."""

    hidden_layers = ()

    def begin(self, prompt, features):
        pass

    def propose(self, context):
        return Draft.empty()

    def observe(self, result, features):
        pass


def test_peers_are_what_the_proposers_declare(tiny_target_dir, monkeypatch):
    model, tokenizer = load_target(tiny_target_dir)

    def load(config, target, tokenizer):
        return PeerlessProposer() if config["type"] == "old" else load_proposer(config, target=target, tokenizer=tokenizer)

    # the package exports the function evaluate(), which hides its module of the same name
    monkeypatch.setattr(importlib.import_module("draftsmith.verify.evaluation.evaluate"), "load_proposer", load)
    proposers = {
        "ngram": {"type": "ngram", "k": 3, "max_n": 2},
        "ngram_tree": {"type": "ngram", "branches": 2},
        "draft": {"type": "draft_model", "model": str(tiny_target_dir)},
        "old": {"type": "old"},
    }
    config = EvalConfig(target=str(tiny_target_dir), domains={"code": "unused"}, proposers=proposers)
    hooks = len(model._forward_pre_hooks)
    methods, _ = build_methods(config, model, tokenizer)
    assert list(methods) == ["plain", "ngram", "ngram_tree", "draft", "old", "hf_prompt_lookup[ngram]", "hf_assisted[draft]"]
    assert len(model._forward_pre_hooks) == hooks + 1  # the forward counter, for the peers' tau
    model, tokenizer = load_target(tiny_target_dir)
    methods, _ = build_methods(replace(config, peers=False), model, tokenizer)
    assert list(methods) == ["plain", "ngram", "ngram_tree", "draft", "old"]
    assert not model._forward_pre_hooks  # no peer, no hook on our own forwards


def test_cli_eval_with_overrides(tiny_target_dir, domain_files, tmp_path, capsys):
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({"target": str(tiny_target_dir), "domains": {"code": domain_files["code"]}, "proposers": {}}))
    out = tmp_path / "cli_out"
    argv = [
        "eval",
        "--config",
        str(config),
        f"output_dir={out}",
        "num_prompts=1",
        "max_new_tokens=4",
        "peers=false",
        "--no-progress",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| code | plain |" in printed and str(out / "table.md") in printed


def test_bad_configs_and_domain_files(tiny_target_dir, tmp_path):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match=r"unknown key\(s\) \['prompts'\]; valid keys"):
        EvalConfig.from_dict({"target": "x", "domains": {"a": "b"}, "prompts": 3})
    with pytest.raises(ValueError, match="'domains' is empty"):
        EvalConfig.from_dict({"target": "x", "domains": {}})
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    with pytest.raises(FileNotFoundError, match="domain 'code': file .* does not exist"):
        load_domain("code", tmp_path / "nope.jsonl", tok, 4, 16)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        load_domain("code", bad, tok, 4, 16)
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="exactly one of 'prompt' or 'messages'"):
        load_domain("code", bad, tok, 4, 16)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no usable prompt"):
        load_domain("code", empty, tok, 4, 16)
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hello"}\n')
    with pytest.raises(ValueError, match="leaves no room in the model's context"):
        load_domain("code", good, tok, 4, 600, max_positions=512)
    too_long = EvalConfig(target=str(tiny_target_dir), domains={"code": str(good)}, prompt_tokens=500, max_new_tokens=64)
    with pytest.raises(ValueError, match="exceeds the target's context of 512 positions"):
        evaluate(too_long, progress=False)
    config = EvalConfig(target=str(tmp_path), domains={"code": str(good)}, output_dir=str(tmp_path / "o"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        evaluate(config, progress=False)


def test_a_domain_may_set_its_own_prompt_length(tiny_target_dir, tmp_path):
    """``{path, prompt_tokens}``: the demo's long domain fills the context the others leave short."""
    text = tmp_path / "long.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    config = EvalConfig.from_dict(
        {
            "target": str(tiny_target_dir),
            "domains": {"short": str(text), "long": {"path": str(text), "prompt_tokens": 400}},
            "prompt_tokens": 16,
            "max_new_tokens": 8,
            "num_prompts": 1,
            "peers": False,
            "output_dir": str(tmp_path / "out"),
        }
    )
    evaluate(config, progress=False)
    lengths = {r["domain"]: r["prompt_tokens"] for r in map(json.loads, (tmp_path / "out" / "records.jsonl").read_text().splitlines())}
    assert lengths == {"short": 16, "long": 400}
    too_long = replace(config, domains={"long": {"path": str(text), "prompt_tokens": 600}})
    with pytest.raises(ValueError, match=r"domain 'long': prompt_tokens=600 \+ max_new_tokens=8 exceeds the target's context of 512"):
        evaluate(EvalConfig.from_dict({k: getattr(too_long, k) for k in ("target", "domains", "max_new_tokens", "output_dir")}))
    with pytest.raises(ValueError, match=r"key 'domains.long.prompt_tokens': expected int or None, got 'many'"):
        EvalConfig.from_dict({"target": "t", "domains": {"long": {"path": "p", "prompt_tokens": "many"}}})


def test_sub_domains_keep_their_order_and_their_names(tiny_target_dir, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "mixed.jsonl"
    rows = [("mixed/code", "def f(): pass"), ("other", "skipped"), ("mixed/prose", "the fox"), ("mixed", "plain"), ("mixed/code", "x = 1")]
    path.write_text("".join(json.dumps({"prompt": text, "domain": domain}) + "\n" for domain, text in rows))
    prompts = load_domain("mixed", path, AutoTokenizer.from_pretrained(tiny_target_dir), num_prompts=3, prompt_tokens=16)
    assert [p.domain for p in prompts] == ["mixed/code", "mixed/prose", "mixed"]
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        DomainFile(str(path), num_prompts=0)


def test_the_table_shows_what_the_controller_chose_and_adaptive_false_keeps_the_fixed_config(tiny_target_dir, domain_files, tmp_path):
    rows = {}
    for adaptive in (True, False):
        config = ngram_on_code(tiny_target_dir, domain_files, tmp_path / f"out_{adaptive}", max_new_tokens=12, adaptive=adaptive)
        summary = evaluate(config, progress=False)
        rows[adaptive] = {r["method"]: r for r in summary["rows"]}
        assert "| nodes/step | plain steps |" in (tmp_path / f"out_{adaptive}" / "table.md").read_text()
    assert rows[False]["ngram"]["plain_share"] == 0.0  # a fixed config never plans a plain step
    assert rows[True]["ngram"]["planned_plain_steps"] >= 1  # the controller measures a plain step first
    assert rows[True]["plain"]["plain_share"] is None and rows[True]["ngram"]["nodes_per_step"] is not None
    assert rows[True]["ngram"]["identical"] == rows[False]["ngram"]["identical"] == "2/2"


def _order_balance(order, n: int) -> tuple[Counter, Counter]:
    """Over one full cycle of ``order`` for n methods: (how often each method runs at each position, each ordered neighbour pair)."""
    names = [f"m{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    positions, pairs = Counter(), Counter()
    for index in range(cycle):
        row = order(names, index)
        assert sorted(row) == sorted(names)  # every method once per prompt
        positions.update(enumerate(row))
        pairs.update(zip(row, row[1:], strict=False))
    return positions, pairs


@pytest.mark.parametrize("n", range(3, 16))
def test_the_run_order_puts_every_method_everywhere_and_after_every_other_equally_often(n):
    order = importlib.import_module("draftsmith.verify.evaluation.evaluate").balanced_order
    positions, pairs = _order_balance(order, n)
    times = 1 if n % 2 == 0 else 2
    assert set(positions.values()) == {times} and len(positions) == n * n
    assert set(pairs.values()) == {times} and len(pairs) == n * (n - 1)  # every ordered pair of neighbours, equally often

    def turned(names, index):  # negative control: turning one order keeps every method's predecessor
        shift = index % len(names)
        return names[shift:] + names[:shift]

    positions, pairs = _order_balance(turned, n)
    assert set(positions.values()) == {1 if n % 2 == 0 else 2}  # positions balance...
    assert len(pairs) == n  # ...but only the n pairs of the one cycle ever meet


def test_each_prompt_turns_the_run_order_and_the_records_keep_the_row_order(tiny_target_dir, domain_files, tmp_path, monkeypatch):
    evaluate_module = importlib.import_module("draftsmith.verify.evaluation.evaluate")
    assert evaluate_module.balanced_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert evaluate_module.balanced_order(["a", "b"], 1) == ["b", "a"]
    calls = []
    build = evaluate_module.build_methods

    def logged(config, model, tokenizer):
        methods, decoders = build(config, model, tokenizer)
        wrap = lambda name, run: lambda prompt, index: calls.append((index, name)) or run(prompt, index)  # noqa: E731
        for decoder in decoders:  # each decoder is reset after the warm-up, its controller learnt afresh
            decoder.reset = lambda: calls.append("reset")
        return {name: wrap(name, run) for name, run in methods.items()}, decoders

    monkeypatch.setattr(evaluate_module, "build_methods", logged)
    config = EvalConfig(
        target=str(tiny_target_dir),
        domains={"code": domain_files["code"]},
        proposers={"ngram": {"type": "ngram", "min_n": 1}, "tree": {"type": "ngram", "min_n": 1, "branches": 3}},
        peers=False,
        num_prompts=3,
        prompt_tokens=24,
        max_new_tokens=8,
        output_dir=str(tmp_path / "out"),
    )
    evaluate(config, progress=False)
    assert calls[3:5] == ["reset", "reset"]  # the two proposers' decoders, after the three warm-up calls
    timed = calls[5:]
    first = [name for i, (index, name) in enumerate(timed) if i % 3 == 0]
    assert first == ["plain", "ngram", "tree"]  # no method always runs first
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["plain", "ngram", "tree"] * 3
    assert all(r["identical_to_plain"] for r in records) and all(r["speedup"] > 0 for r in records)


@pytest.mark.parametrize("repeats", [1, 3])
def test_plain_decoding_runs_each_prompt_plain_repeats_times_and_its_speed_is_their_median(
    repeats, tiny_target_dir, domain_files, tmp_path, monkeypatch
):
    """With ``plain_repeats`` 3 plain decoding runs 3 times a prompt, in its balanced order, and every row's speedup
    divides by the median of the three runs' speeds (here 10, 40, 20 tok/s: 20). With 1 (negative control: the
    median is no accident of the values) it is the one run's (10)."""
    evaluate_module = importlib.import_module("draftsmith.verify.evaluation.evaluate")
    build, ran = evaluate_module.build_methods, Counter()

    def logged(config, model, tokenizer):
        methods, decoders = build(config, model, tokenizer)
        plain = methods["plain"]

        def timed(prompt, index):
            tokens, record, stats = plain(prompt, index)
            ran[index] += 1
            record.tokens_per_s = (10.0, 40.0, 20.0)[(ran[index] - 1) % 3]
            return tokens, record, stats

        return {**methods, "plain": timed}, decoders

    monkeypatch.setattr(evaluate_module, "build_methods", logged)
    config = ngram_on_code(tiny_target_dir, domain_files, tmp_path / "out", num_prompts=3, plain_repeats=repeats)
    evaluate(config, progress=False)
    assert [ran[index] for index in range(3)] == [repeats + (index == 0) for index in range(3)]  # prompt 0: the warm-up too
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    plain = [r for r in records if r["method"] == "plain"]
    expected = 20.0 if repeats == 3 else 10.0
    assert all(r["tokens_per_s"] == expected for r in plain[1:])  # prompt 0's runs come after its warm-up run
    for r in records:
        if r["method"] == "ngram" and r["prompt_index"] > 0:
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / expected)
    with pytest.raises(ValueError, match="plain_repeats must be >= 1, got 0"):
        replace(config, plain_repeats=0)
