"""The local corpus: sources, filters, dedupe, and a leak-free deterministic split."""

import gzip
from pathlib import Path

import pytest

from draftsmith.training.demo.corpus import HELDOUT_MOD, collect_corpus, is_heldout, strip_troff

LICENSE = "Permission is hereby granted, free of charge, to any person obtaining a copy. " * 5
MAN_PAGE = r""".\" a comment
.TH DEMO 1 "2024" "demo 1.0" "User Commands"
.SH NAME
demo \- do a thing
.SH DESCRIPTION
.B demo
prints \fIfiles\fR in \(lqorder\(rq.
.TP
\fB\-a\fR, \fB\-\-all\fR
list all
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode()) if path.suffix == ".gz" else text.encode())


def fake_roots(root: Path, num_modules: int = 60, reverse: bool = False) -> dict[str, Path]:
    """A tiny stdlib / man / doc tree; ``reverse`` creates the files in the opposite order."""
    files = {f"lib/pkg{i % 7}/mod{i}.py": f"def f{i}(x):\n    return x + {i}\n" * 20 for i in range(num_modules)}
    files |= {
        "lib/test/test_big.py": "x = 1\n" * 100,  # skipped: tests
        "lib/idlelib/shell.py": "y = 2\n" * 100,  # skipped: IDLE
        "lib/site-packages/pkg/mod.py": "z = 3\n" * 100,  # skipped: installed packages
        "lib/huge.py": "w = 4\n" * 100_000,  # skipped: too large
        "lib/dup.py": "def f0(x):\n    return x + 0\n" * 20,  # same text as mod0.py
    }
    files |= {f"man/man1/tool{i}.1.gz": MAN_PAGE.replace("demo", f"tool{i}") * 3 for i in range(30)}
    files |= {f"doc/pkg{i}/copyright": LICENSE for i in range(10)}  # one text, ten files
    files |= {f"doc/pkg{i}/README": f"Package {i} does thing {i}. " * 20 for i in range(30)}
    files |= {"doc/pkg0/changelog.gz": "not a README " * 50}  # not collected
    for rel in sorted(files, reverse=reverse):
        write(root / rel, files[rel])
    return {"stdlib": root / "lib", "man": root / "man", "doc": root / "doc"}


def all_docs(corpus):
    return [doc for splits in corpus.values() for docs in splits.values() for doc in docs]


def test_split_has_no_leakage(tmp_path):
    corpus = collect_corpus(fake_roots(tmp_path), heldout_mod=5, include_pydoc=False)
    for domain, splits in corpus.items():
        assert splits["train"] and splits["heldout"], domain
        train_paths = {doc.path for doc in splits["train"]}
        train_texts = {doc.text for doc in splits["train"]}
        for doc in splits["heldout"]:
            assert is_heldout(doc.path, 5) and doc.path not in train_paths and doc.text not in train_texts
        assert not any(is_heldout(path, 5) for path in train_paths)


def test_filters_and_dedupe(tmp_path):
    docs = all_docs(collect_corpus(fake_roots(tmp_path), include_pydoc=False))
    paths = {doc.path for doc in docs}
    assert not {"stdlib/test/test_big.py", "stdlib/idlelib/shell.py", "stdlib/huge.py"} & paths
    assert not any("site-packages" in p or "changelog" in p for p in paths)
    assert sum(doc.text == LICENSE for doc in docs) == 1  # ten copies, kept once
    assert len({doc.text for doc in docs}) == len(docs)
    assert {doc.domain for doc in docs if doc.path.startswith("stdlib/")} == {"code"}
    assert {doc.domain for doc in docs if doc.path.startswith(("man/", "doc/"))} == {"prose"}


def test_collect_is_deterministic(tmp_path):
    first = collect_corpus(fake_roots(tmp_path / "a"), max_bytes={"code": 20_000}, include_pydoc=False)
    again = collect_corpus(fake_roots(tmp_path / "a"), max_bytes={"code": 20_000}, include_pydoc=False)
    reversed_tree = collect_corpus(fake_roots(tmp_path / "b", reverse=True), max_bytes={"code": 20_000}, include_pydoc=False)
    assert first == again == reversed_tree
    for splits in first.values():
        for docs in splits.values():
            assert [d.path for d in docs] == sorted(d.path for d in docs)


def test_cap_limits_kept_text(tmp_path):
    roots = fake_roots(tmp_path)
    capped = collect_corpus(roots, max_bytes={"code": 3_000}, include_pydoc=False)
    full = collect_corpus(roots, include_pydoc=False)
    size = sum(len(doc.text) for docs in capped["code"].values() for doc in docs)
    assert 3_000 <= size < 3_000 + 1_000  # stops after the file that crosses the cap
    assert len(all_docs({"code": capped["code"]})) < len(all_docs({"code": full["code"]}))


def test_missing_sources_name_the_searched_directories(tmp_path):
    roots = fake_roots(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no code files found; searched: .*empty"):
        collect_corpus({**roots, "stdlib": empty}, include_pydoc=False)
    with pytest.raises(FileNotFoundError, match="no prose files found; searched: .*empty.*empty"):
        collect_corpus({**roots, "man": empty, "doc": empty}, include_pydoc=False)


def test_strip_troff_leaves_plain_text():
    text = strip_troff(MAN_PAGE)
    assert "\\" not in text and ".TH" not in text and "a comment" not in text
    assert "demo - do a thing" in text
    assert 'prints files in "order".' in text
    assert "-a, --all" in text


def test_this_machine_has_both_domains():
    corpus = collect_corpus(max_bytes={"code": 300_000, "prose": 300_000})
    for domain, splits in corpus.items():
        assert splits["train"], domain
        train_texts = {doc.text for doc in splits["train"]}
        assert not any(doc.text in train_texts for doc in splits["heldout"])
    assert all(is_heldout(d.path, HELDOUT_MOD) for docs in corpus.values() for d in docs["heldout"])
    assert {d.path.split("/")[0] for d in corpus["prose"]["train"]} >= {"man", "doc"}
