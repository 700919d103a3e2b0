"""Domain files: rows of other domains are left to their own keys and named when nothing else is there; text files per file or paragraph."""

from __future__ import annotations

import json

import pytest

from draftsmith.proposers.core.errors import InputError
from draftsmith.verify.evaluation.domains import load_domain
from draftsmith.verify.target import load_target


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return load_target(tiny_target_dir)[1]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_file_of_several_domains_gives_each_key_its_own_rows(tokenizer, tmp_path):
    shared = write_rows(tmp_path / "all.jsonl", [{"prompt": f"the quick brown fox {i}", "domain": d} for i, d in enumerate("aabab")])
    assert [p.source for p in load_domain("a", shared, tokenizer, 8, 16)] == ["all.jsonl:1", "all.jsonl:2", "all.jsonl:4"]
    assert len(load_domain("b", shared, tokenizer, 8, 16)) == 2


def test_a_file_with_no_row_of_the_domain_names_the_domains_it_holds(tokenizer, tmp_path):
    """The old message blamed an empty file or short texts; the file held rows of another domain."""
    path = write_rows(tmp_path / "code.jsonl", [{"prompt": "def add(a, b): return a + b", "domain": "python"}] * 3)
    with pytest.raises(InputError, match=r"its rows are of other domains \('python' \(3\)\), none of 'code'"):
        load_domain("code", path, tokenizer, 8, 16)
    short = write_rows(tmp_path / "short.jsonl", [{"prompt": "", "domain": "code"}])
    with pytest.raises(InputError, match=r"its 1 text\(s\) are each under 2 tokens"):
        load_domain("code", short, tokenizer, 8, 16)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match="holds no usable prompt: it is empty"):
        load_domain("code", tmp_path / "empty.jsonl", tokenizer, 8, 16)


def test_a_text_file_is_one_prompt_or_one_per_paragraph(tokenizer, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox\njumps over\n\nthe lazy dog sleeps\n\n\nand the fox runs away\n")
    assert [p.source for p in load_domain("notes", text, tokenizer, 8, 32)] == ["notes.txt"]
    paragraphs = load_domain("notes", text, tokenizer, 8, 32, split="paragraph")
    assert [p.source for p in paragraphs] == ["notes.txt:paragraph 1", "notes.txt:paragraph 2", "notes.txt:paragraph 3"]
    with pytest.raises(InputError, match=r"split must be one of \['file', 'paragraph'\], got 'line'"):
        load_domain("notes", text, tokenizer, 8, 32, split="line")


def test_the_demo_says_why_a_row_runs_below_plain():
    from draftsmith.verify.evaluation.demo import below_plain

    def row(method, speedup, plain_share, tau=1.5, domain="code"):
        return {"domain": domain, "method": method, "speedup": speedup, "plain_share": plain_share, "tau": tau}

    lines = below_plain(
        [row("plain", 1.0, None), row("ngram", 2.1, 0.0), row("medusa", 0.96, 0.98), row("medusa", 0.97, 0.9, domain="long"),
         row("eagle3", 0.9, 0.1, tau=3.2), row("hf_assisted[demo_draft]", 0.5, None)]
    )  # fmt: skip
    assert len(lines) == 3 and not any("ngram" in line for line in lines)
    assert lines[0].startswith("Below 1x: medusa (code 0.96x, long 0.97x): the controller planned 90%-98% of its steps plain")
    assert "tau 3.20" in lines[1] and "transformers' own loop" in lines[2]
