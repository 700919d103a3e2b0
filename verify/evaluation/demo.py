"""The offline demo's evaluation: its domains, written from the target's held-out documents, and its proposers.

``draftsmith demo`` builds or reuses the target (``training.demo``), then hands its
held-out documents here: the evaluation domains are written from them, and every proposer
that needs no training of its own, plus the trained drafts and heads shipped under
``recipes/models/``, runs against plain decoding and transformers' prompt lookup / assisted
generation. A document is anything with a ``path`` and a ``text``.

Domains (one JSONL file each, ``{"prompt", "domain", "source"}``):
- ``code``: held-out standard-library modules;
- ``prose``: held-out man pages, package READMEs and pydoc topics, taken in turn (no licence
  or copyright texts: the target recites those from memory, which measures lookup);
- ``copy``: a held-out passage, a blank line, then the passage's opening again, so
  the continuation repeats the context (the RAG / summarisation case);
- ``long``: held-out code and prose documents long enough to fill the target's context
  (prompts of positions - max_new_tokens tokens: 960 for the 1024-position demo target),
  when the target has at least 512 positions;
- ``repeat``: requests that return to earlier requests' material, in threes per held-out
  passage: the passage; another passage's opening, then the passage again (a later turn
  that comes back to it); the passage with its most frequent word renamed (an agent
  rewriting the same file with a small change);
- ``mixed``: code, prose and repeat requests interleaved (sub-domains ``mixed/code``,
  ``mixed/prose``, ``mixed/repeat``; twice the prompts of a domain);
- ``chat``: a question file (Spec-Bench's shape: ``question_id``, ``category``, ``turns``),
  categories ``chat/code`` and ``chat/prose``, half of the questions two turns long, the
  second turn rendered after the model's own first answer with the target's chat template.

Each domain reads its own held-out documents (offsets ``num_prompts`` apart, when the
split holds enough), so that a proposer that learns across requests (``suffix``) does not
meet one domain's passages in another's.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from itertools import zip_longest
from pathlib import Path

from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.files import check_writable

from .evaluate import PLAIN, DomainFile, EvalConfig, evaluate
from .report import markdown_table

MODELS = Path("recipes/models")  # the shipped target, drafts and heads
DEMO_TARGET = MODELS / "demo_target"
MIN_PROMPT_TOKENS = 16
LONG_MIN_POSITIONS = 512  # targets with fewer positions get no long domain
CHARS_PER_LONG_TOKEN = 6  # characters kept per long-prompt token (the demo tokenizer averages about 3.5)
SUFFIX = {"type": "suffix"}
LICENCE_TEXT = re.compile(r"(^|/)(copyright|copying|licen[cs]e)([._][^/]*)?$", re.IGNORECASE)
DEMO_PROPOSERS = {
    "ngram": {"type": "ngram"},
    "ngram_tree": {"type": "ngram", "min_n": 1, "branches": 4, "max_nodes": 16},
    "suffix": SUFFIX,
    # the suffix tries first; where they match nothing, prompt lookup
    "suffix+ngram": {"type": "composite", "proposers": [SUFFIX, {"type": "ngram"}]},
}
#: A composite's suffix member drafts when its tree's score (the expected accepted tokens under
#: its counts) reaches this; below, the next member (a draft model) drafts.
SUFFIX_FIRST = 1.0


def _window(text: str, chars: int, salt: str) -> str:
    """A deterministic slice of about ``chars`` characters starting at a line boundary."""
    lines = text.splitlines(keepends=True)
    start = int(hashlib.sha1(salt.encode()).hexdigest(), 16) % max(1, len(lines) // 2)
    out = "".join(lines[start:])[:chars]
    return out if out.strip() else text[:chars]


def varied_prose(documents: list) -> list:
    """The prose documents without licence texts, their kinds (man pages, package READMEs, pydoc topics) taken in turn.

    Licence and copyright files are boilerplate the target recites from memory (a prose row
    of them measured lookup, not prose), so no domain reads them.
    """
    kinds: dict[str, list] = {}
    for doc in documents:
        if not LICENCE_TEXT.search(doc.path):
            kinds.setdefault(doc.path.split("/")[0], []).append(doc)
    return [doc for group in zip_longest(*kinds.values()) for doc in group if doc is not None]


def build_domains(docs: dict[str, list], out_dir: Path, num_prompts: int, prompt_chars: int, long_chars: int = 0) -> dict[str, str]:
    """Write the demo's domain files (code, prose, copy, repeat, mixed, chat and, with ``long_chars``, long); return ``{domain: path}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = {**docs, "prose": varied_prose(docs["prose"])}
    rows: dict[str, list[dict]] = {"code": [], "prose": [], "copy": []}
    if long_chars:
        long_docs = [d for pair in zip(docs["code"], docs["prose"], strict=False) for d in pair if len(d.text) >= long_chars]
        rows["long"] = [{"prompt": d.text[:long_chars], "domain": "long", "source": d.path} for d in long_docs[:num_prompts]]
    for domain in ("code", "prose"):
        for doc in docs[domain][:num_prompts]:
            rows[domain].append({"prompt": _window(doc.text, prompt_chars, doc.path), "domain": domain, "source": doc.path})
    both = [d for pair in zip(docs["code"], docs["prose"], strict=False) for d in pair]
    for doc in both[:num_prompts]:
        passage = _window(doc.text, prompt_chars // 2, "copy:" + doc.path).rstrip()
        opening = passage.splitlines()[0] if passage.splitlines() else passage[:40]
        rows["copy"].append({"prompt": f"{passage}\n\n{opening}", "domain": "copy", "source": doc.path})
    rows["repeat"] = _repeat_rows(docs, num_prompts, prompt_chars, "repeat", offset=num_prompts)[:num_prompts]
    rows["mixed"] = _mixed_rows(docs, num_prompts, prompt_chars)
    rows["chat"] = _chat_rows(docs, num_prompts, prompt_chars)
    paths = {}
    for domain, items in rows.items():
        if not items:
            raise InputError(f"no held-out documents for domain {domain!r}: the target's corpus split is empty")
        path = out_dir / f"{domain}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in items))
        paths[domain] = str(path)
    return paths


def _repeat_rows(docs: dict[str, list], count: int, prompt_chars: int, domain: str, offset: int) -> list[dict]:
    """Three requests per passage, in order: the passage, a later turn back to it, the passage edited."""
    both = _interleave(_unread(docs["code"], offset), _unread(docs["prose"], offset))
    rows = []
    for i, doc in enumerate(both[: -(-count // 3)]):
        passage = _window(doc.text, prompt_chars // 2, "repeat:" + doc.path).rstrip()
        other = both[(i + 1) % len(both)]
        aside = _window(other.text, prompt_chars // 4, "aside:" + other.path).rstrip()
        for kind, prompt in (("first", passage), ("return", f"{aside}\n\n{passage}"), ("edit", _edited(passage))):
            rows.append({"prompt": prompt, "domain": domain, "source": f"{doc.path} ({kind})"})
    return rows


def _unread(docs: list, offset: int) -> list:
    """The documents from ``offset`` on, which the domains before did not read (all of them, for a corpus too small)."""
    return docs[offset:] or docs


def _interleave(first: list, second: list) -> list:
    """first[0], second[0], first[1], ...; the longer list's rest at the end."""
    out = [x for pair in zip(first, second, strict=False) for x in pair]
    return out + first[len(second) :] + second[len(first) :]


def _edited(text: str) -> str:
    """The text with its most frequent word of 4+ letters renamed everywhere (a small edit of a file)."""
    words = Counter(re.findall(r"\b[A-Za-z_]{4,}\b", text))
    if not words:
        return text + "\n"
    word = words.most_common(1)[0][0]
    return re.sub(rf"\b{word}\b", f"{word}_new", text)


def _chat_rows(docs: dict[str, list], num_prompts: int, prompt_chars: int) -> list[dict]:
    """``num_prompts`` questions in the question-file shape (Spec-Bench, MT-bench): categories ``code`` and ``prose`` in
    turn, every other pair of them two turns long (the second asks about another passage, after the model's own answer)."""
    offset = 4 * num_prompts  # past what the other domains read, where the split holds that much
    sources = {kind: _unread(docs[kind], offset) for kind in ("code", "prose")}
    rows = []
    for i in range(num_prompts):
        kind = ("code", "prose")[i % 2]
        first, second = sources[kind][(i // 2) % len(sources[kind])], sources[kind][(i // 2 + 1) % len(sources[kind])]
        turns = [f"Continue this text:\n\n{_window(first.text, prompt_chars // 2, 'chat:' + first.path).rstrip()}"]
        if i % 4 < 2:
            turns.append(f"Now continue this one:\n\n{_window(second.text, prompt_chars // 2, 'chat2:' + second.path).rstrip()}")
        rows.append({"question_id": i, "category": kind, "turns": turns, "source": first.path})
    return rows


def _mixed_rows(docs: dict[str, list], num_prompts: int, prompt_chars: int) -> list[dict]:
    """Code, prose and repeat requests interleaved, 2 x num_prompts of them, from documents no other domain reads."""
    offset = 2 * num_prompts
    kinds = {
        "code": [_window(d.text, prompt_chars, d.path) for d in _unread(docs["code"], offset)],
        "prose": [_window(d.text, prompt_chars, d.path) for d in _unread(docs["prose"], offset)],
        "repeat": [r["prompt"] for r in _repeat_rows(docs, num_prompts, prompt_chars, "mixed/repeat", offset + num_prompts)],
    }
    rows = []
    for i in range(2 * num_prompts):
        kind = ("code", "prose", "repeat")[i % 3]
        if i // 3 < len(kinds[kind]):
            rows.append({"prompt": kinds[kind][i // 3], "domain": f"mixed/{kind}", "source": f"mixed {i}"})
    return rows


#: Trained proposers shipped under recipes/: row name -> (directory, the config the demo evaluates it with).
#: The draft model drafts 6 deep with a confidence threshold of 0.4: measured faster than a
#: fixed depth 4 on every demo domain (see benchmarks/RESULTS.md). Medusa grows the tree
#: calibrated with its heads. EAGLE: the EAGLE-1 head drafts 5-token chains (eagle1) and
#: EAGLE-2's dynamic trees (eagle2); the EAGLE-3 head the same dynamic trees (6 deep, 2
#: children per expanded node, 16 nodes: on this CPU a verified node costs a sixteenth of a
#: target step whatever its chance, and these trees ran faster than 24-node ones with 3
#: children in 11 of 12 paired runs, at 5-9% less tau; benchmarks/RESULTS.md). MTP: the 3
#: modules draft a 3-token chain. The drafters of every depth in one forward (DFlash's block
#: drafter, the parallel EAGLE-3 head) draft trees of each depth's 2 best tokens, 12 nodes
#: (benchmarks/results/parallel.md).
SHIPPED = {
    "demo_draft": ("demo_draft", {"type": "draft_model", "k": 6, "confidence_threshold": 0.4}),
    "medusa": ("demo_medusa", {"type": "medusa"}),
    "eagle1": ("demo_eagle1", {"type": "eagle", "k": 5}),
    "eagle2": ("demo_eagle1", {"type": "eagle", "k": 6, "tree_width": 2, "max_nodes": 16}),
    "eagle3": ("demo_eagle3", {"type": "eagle", "k": 6, "tree_width": 2, "max_nodes": 16}),
    "mtp": ("demo_mtp", {"type": "mtp"}),
    "dflash": ("demo_dflash", {"type": "dflash", "tree_width": 2, "max_nodes": 12}),
    "peagle": ("demo_peagle", {"type": "eagle", "k": 5, "tree_width": 2, "max_nodes": 12}),
}


def trained_drafts(target_dir: Path) -> dict[str, dict]:
    """Proposer configs for the trained proposers shipped under recipes/ (``SHIPPED``) that fit the target's vocabulary."""

    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    found = {}
    for name, (directory, config) in SHIPPED.items():
        path = MODELS / directory / "config.json"
        if path.is_file() and json.loads(path.read_text())["vocab_size"] == vocab:
            found[name] = {**config, "model": str(path.parent)}
    if "demo_draft" in found:  # model-free first, the learned draft where the suffix tries are unsure
        found["suffix+draft"] = {"type": "composite", "proposers": [{**SUFFIX, "min_score": SUFFIX_FIRST}, found["demo_draft"]]}
    return found


def check_demo_settings(output_dir: str, num_prompts: int, max_new_tokens: int) -> None:
    """The demo's own settings, checked before any target is built; an InputError names the bad one."""
    for name, value in (("num_prompts", num_prompts), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be an integer >= 1, got {value!r}")
    check_writable(output_dir, "output_dir")


def evaluate_demo(
    target_dir: Path, documents, output_dir: str, num_prompts: int = 8, max_new_tokens: int = 64, domains_only: bool = False
) -> dict:
    """Write the domains from ``documents()`` (domain -> held-out documents), run the evaluation; return its summary.

    Args:
        documents: called once the settings are known to fit the target (reading the corpus is slow).
        domains_only: stop after writing the domains; return ``{domain: path or DomainFile}``.
    """
    block = json.loads((target_dir / "config.json").read_text()).get("max_position_embeddings", 256)
    prompt_tokens = min(128, block - max_new_tokens - 8)
    if prompt_tokens < MIN_PROMPT_TOKENS:
        most = block - 8 - MIN_PROMPT_TOKENS
        raise InputError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the demo target's {block} positions (at most {most})"
        )
    long_tokens = block - max_new_tokens if block >= LONG_MIN_POSITIONS else 0
    domains: dict = build_domains(
        documents(), Path(output_dir) / "domains", num_prompts, 4 * prompt_tokens, CHARS_PER_LONG_TOKEN * long_tokens
    )
    if long_tokens:
        domains["long"] = DomainFile(domains["long"], prompt_tokens=long_tokens)
    domains["mixed"] = DomainFile(domains["mixed"], num_prompts=2 * num_prompts)
    if domains_only:
        return domains
    proposers = {**DEMO_PROPOSERS, **trained_drafts(target_dir)}
    config = EvalConfig(
        target=str(target_dir),
        domains=domains,
        proposers=proposers,
        num_prompts=num_prompts,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new_tokens,
        peers=True,  # transformers' prompt lookup / assisted generation beside the proposers that declare them
        output_dir=output_dir,
        # The demo models are tiny: one intra-op thread is as fast, and two thrash
        # whenever anything else runs on the machine.
        threads=1,
    )
    summary = evaluate(config)
    notes = below_plain(summary["rows"])
    summary["table"] = markdown_table(summary["rows"]) + ("\n" + "\n".join(notes) + "\n" if notes else "")
    (Path(output_dir) / "table.md").write_text(summary["table"])
    return summary


def below_plain(rows: list[dict]) -> list[str]:
    """One line per method that ran below plain decoding somewhere, saying why (from what the controller chose)."""
    slow: dict[str, list[dict]] = {}
    for row in rows:
        if row["method"] != PLAIN and row["speedup"] < 1.0:
            slow.setdefault(row["method"], []).append(row)
    lines = []
    for method, group in slow.items():
        where = ", ".join(f"{r['domain']} {r['speedup']:.2f}x" for r in group)
        plain = [r["plain_share"] for r in group if r.get("plain_share") is not None]
        if method.startswith("hf_"):
            why = "transformers' own loop, which costs more per step than ours (a plain step of its own is slower than ours)"
        elif plain and min(plain) >= 0.5:
            why = (
                f"the controller planned {min(plain):.0%}-{max(plain):.0%} of its steps plain, as drafting does not pay here (a draft "
                "forward costs a fifth to a quarter of this small target's step); what is left is the proposer's bookkeeping and "
                "the controller's probes"
            )
        else:
            taus = ", ".join(f"{r['tau']:.2f}" for r in group)
            why = f"its drafts (tau {taus}) did not cover their drafting and verification on this CPU"
        lines.append(f"Below 1x: {method} ({where}): {why}.")
    return lines
