"""The offline demo: domains from held-out files only, and the quick demo end to end."""

from __future__ import annotations

import json

from draftsmith.training.demo.corpus import Document
from draftsmith.training.demo.run import run_demo
from draftsmith.verify.evaluation.demo import build_domains


def test_domains_are_built_from_the_documents_given(tmp_path):
    docs = {
        "code": [Document(f"stdlib/m{i}.py", "code", "".join(f"x{i}_{j} = total({j})\n" for j in range(40))) for i in range(3)],
        "prose": [Document(f"man/p{i}.1.gz", "prose", "".join(f"word{i} line {j}\n" for j in range(40))) for i in range(3)],
    }
    paths = build_domains(docs, tmp_path, num_prompts=3, prompt_chars=200)
    rows = {d: [json.loads(line) for line in open(p)] for d, p in paths.items()}
    assert [len(rows[d]) for d in ("code", "prose", "copy", "repeat", "mixed")] == [3, 3, 3, 3, 6]
    assert {r["source"] for r in rows["code"]} <= {d.path for d in docs["code"]}
    for row in rows["copy"]:
        passage, opening = row["prompt"].split("\n\n")
        assert passage.startswith(opening)  # the continuation of the prompt repeats the passage
    first, back, edited = rows["repeat"][:3]  # the passage, a later turn back to it, the passage with a word renamed
    assert back["prompt"].endswith("\n\n" + first["prompt"]) and edited["prompt"] != first["prompt"]
    assert edited["prompt"].replace("_new", "") == first["prompt"]
    assert [r["domain"] for r in rows["mixed"]] == ["mixed/code", "mixed/prose", "mixed/repeat"] * 2
    # chat: a question file, categories in turn, every other pair of questions two turns long
    assert [(r["question_id"], r["category"], len(r["turns"])) for r in rows["chat"]] == [(0, "code", 2), (1, "prose", 2), (2, "code", 1)]


def test_prose_has_no_licence_texts_and_takes_its_kinds_in_turn(tmp_path):
    text = "".join(f"line {j} of a text that is long enough\n" for j in range(40))
    prose = [Document(p, "prose", text) for p in ("doc/a/copyright", "doc/a/README", "doc/b/LICENSE.txt", "doc/c/README.md")]
    prose += [Document(f"man/man1/t{i}.1.gz", "prose", text) for i in range(3)] + [Document("pydoc/topic", "prose", text)]
    docs = {"code": [Document("stdlib/m.py", "code", text)], "prose": prose}
    paths = build_domains(docs, tmp_path, num_prompts=8, prompt_chars=200)
    sources = [json.loads(line)["source"] for line in open(paths["prose"])]
    assert sources == ["doc/a/README", "man/man1/t0.1.gz", "pydoc/topic", "doc/c/README.md", "man/man1/t1.1.gz", "man/man1/t2.1.gz"]
    every = {json.loads(line)["source"] for path in paths.values() for line in open(path)}
    assert not {"doc/a/copyright", "doc/b/LICENSE.txt"} & every  # no domain reads them


def test_quick_demo_end_to_end(tmp_path, monkeypatch):
    """Trains the quick target (cached under .cache/ after the first run) and evaluates it."""
    summary = run_demo(quick=True, output_dir=str(tmp_path / "demo"), num_prompts=2, max_new_tokens=16)
    rows = {(r["domain"], r["method"]): r for r in summary["rows"]}
    for domain in ("code", "prose", "copy"):
        for method in ("plain", "ngram", "ngram_tree", "hf_prompt_lookup[ngram]"):
            row = rows[(domain, method)]
            assert row["identical"] == "2/2", (domain, method)
            assert row["tau"] >= 1.0
    for domain in ("chat/code", "chat/prose"):  # the multi-turn domain, every turn of plain and ngram alike
        assert rows[(domain, "ngram")]["identical"] == rows[(domain, "plain")]["identical"] == "2/2", domain
    for name in ("table.md", "tau_speedup.png", "acceptance_by_depth.png", "records.jsonl", "summary.json"):
        assert (tmp_path / "demo" / name).stat().st_size > 0
    # the domains were written from the held-out split of the target's corpus
    sources = {json.loads(line)["source"] for line in open(tmp_path / "demo" / "domains" / "code.jsonl")}
    assert sources


def test_shipped_proposers_are_evaluated_when_present_and_fitting(tmp_path, monkeypatch):
    """Every SHIPPED row whose directory exists with the target's vocabulary is evaluated; others are skipped."""
    import draftsmith.verify.evaluation.demo as demo

    monkeypatch.setattr(demo, "MODELS", tmp_path)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"vocab_size": 300}))
    for directory, vocab in (("demo_draft", 300), ("demo_medusa", 299), ("demo_eagle1", 300)):
        (tmp_path / directory).mkdir()
        (tmp_path / directory / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    found = demo.trained_drafts(tmp_path / "target")
    assert sorted(found) == ["demo_draft", "eagle1", "eagle2", "suffix+draft"]  # medusa: another vocabulary; eagle3: not shipped
    assert found["suffix+draft"]["proposers"][1] == found["demo_draft"]
    assert found["eagle2"] == {**demo.SHIPPED["eagle2"][1], "model": str(tmp_path / "demo_eagle1")}
