"""A local text corpus (code and prose) with a fixed train / held-out split.

Sources every machine of this kind has, so the demo target needs no download:

- ``code``:  the Python standard library sources (``*.py``);
- ``prose``: man pages (gzip'd troff, stripped to plain text; the English
  ``man*/`` sections, at most ``MAX_MAN_PAGES_PER_FAMILY`` per command family),
  package ``README*`` and ``copyright`` texts under the doc directory, and the
  pydoc topics (``pydoc_data.topics.topics``, one document per topic).

Rules, in the order they apply (all deterministic; none depends on directory
listing order or on the machine's absolute paths):

1. Every candidate file gets a *relative path* ``<source>/<path under root>``,
   e.g. ``stdlib/json/decoder.py`` or ``man/man1/ls.1.gz``.
2. Candidates of a domain are visited in the order of ``sha1("order:" + path)``
   (a fixed pseudo-random order, so a size cap samples all sources evenly).
3. A document is dropped when its text is shorter than ``MIN_DOC_CHARS`` or
   longer than ``max_doc_chars``, or when the same text (whitespace-stripped,
   keyed by sha1) was already kept: duplicates are removed *before* the split,
   so one text can never be in both splits (license texts repeat a lot).
4. Visiting stops once the kept texts reach ``max_bytes`` for the domain.
5. Split by whole file: a document is held out when
   ``int(sha1(path)) % heldout_mod == 0`` (1 in 20 by default); held-out files
   are never seen in training.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import sysconfig
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from draftsmith.proposers.core.errors import InputError

DOMAINS = ("code", "prose")
SPLITS = ("train", "heldout")
HELDOUT_MOD = 20
MIN_DOC_CHARS = 200
MAX_DOC_CHARS = 200_000
# Skipped stdlib directories: tests, the IDLE app, installed packages, the
# pydoc topics (already prose) and the generated codec tables.
SKIP_CODE_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "pydoc_data", "encodings", "__pycache__"})
# Some tools ship thousands of near-identical man pages (one per subcommand);
# keep at most this many pages per command family (name before the first - or _).
MAX_MAN_PAGES_PER_FAMILY = 20
DOC_FILE = re.compile(r"^(README([._-].*)?|copyright)$", re.IGNORECASE)


@dataclass(frozen=True)
class Document:
    """One source file as plain text; ``path`` is relative to its source root."""

    path: str
    domain: str
    text: str


@dataclass(frozen=True)
class Candidate:
    """A file not read yet: its relative path and how to read it."""

    path: str
    read: Callable[[], str]


def default_roots() -> dict[str, Path]:
    """The source roots of this machine: stdlib, man and doc directories."""
    data = Path(sysconfig.get_paths()["data"])
    share = Path("/usr/share") if Path("/usr/share/man").is_dir() else data / "share"
    return {"stdlib": Path(sysconfig.get_paths()["stdlib"]), "man": share / "man", "doc": share / "doc"}


def stable_hash(text: str) -> int:
    """sha1 of a string as an integer (stable across runs and machines)."""
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest(), 16)


def is_heldout(path: str, heldout_mod: int = HELDOUT_MOD) -> bool:
    """Whether the file at relative ``path`` belongs to the held-out split."""
    return stable_hash(path) % heldout_mod == 0


def read_text(path: Path) -> str:
    """A file's text, gunzipped when it ends in ``.gz``; undecodable bytes replaced."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


# --- troff to plain text -------------------------------------------------

# fmt: off
TROFF_CHARS = {
    "em": "--", "en": "-", "hy": "-", "bu": "*", "aq": "'", "dq": '"', "lq": '"', "rq": '"',
    "oq": "'", "cq": "'", "co": "(c)", "rg": "(R)", "tm": "(TM)", "<=": "<=", ">=": ">=",
    "mu": "x", "ti": "~", "ha": "^", "rs": "\\", "ba": "|", "bv": "|", "pl": "+", "mi": "-",
    "eq": "=", "sl": "/", "ga": "`", "aa": "'", "Fo": "<<", "Fc": ">>", "ra": "->", "->": "->",
}
# fmt: on
TROFF_ESCAPE = re.compile(
    r"\\(?:"
    r"f(?:\[[^\]]*\]|\([A-Za-z0-9]{2}|[A-Za-z0-9])"  # font change: dropped
    r"|s[+-]?\d+|s\([+-]?\d{2}|s\[[^\]]*\]"  # size change: dropped
    r"|\*(?:\[[^\]]*\]|\(..|.)"  # string register: dropped
    r"|n(?:\[[^\]]*\]|\(..|.)"  # number register: dropped
    r"|[hvwlLoxbDXZkY]'[^']*'"  # motions, widths, boxes: dropped
    r"|\((?P<two>..)|\[(?P<named>[^\]]*)\]"  # special characters
    r"|(?P<one>.)"  # one-character escapes
    r")"
)
ONE_CHAR = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "0": " ", "~": " ", "'": "'", "`": "`", ".": "."}
DROPPED_REQUESTS = set(
    "TH Dd Dt Os de ig so nr ds ie el if TS TE EQ EN IX Vb Ve in ti ft ps ne na ad hy nh fi nf br "
    "RS RE UC tr cc ll ta ss hw PD PU cs mso rm rr als char fam ev Bl El Bd Ed Bk Ek".split()
)
# mdoc (BSD) macros that only mark up their arguments; "Fl x" is the flag "-x".
MDOC_MARKUP = set("Fl Ar Op Oo Oc Ns Cm Pa Nm Xr Sy Em Li Dq Sq Qq Pq Ql Ic Ev Va Fn Fa Ft Dv Er Sx An Lk Mt Aq Bq".split())
JOINED_MACROS = {"BR", "RB", "BI", "IB", "IR", "RI"}  # alternating fonts: no spaces between arguments


def _replace_escape(match: re.Match) -> str:
    if match.group("two") is not None:
        return TROFF_CHARS.get(match.group("two"), "")
    if match.group("named") is not None:
        return TROFF_CHARS.get(match.group("named"), "")
    if match.group("one") is not None:
        return ONE_CHAR.get(match.group("one"), "")
    return ""


def _mdoc_text(words: list[str], program: str) -> str:
    """Plain text of an mdoc line's words (the macro name included)."""
    out, glue, dash, close = [], False, False, ""
    for word in words:
        if word in MDOC_MARKUP and word not in {"Nm", "Op", "Oo", "Oc"}:
            glue, dash = (True, dash) if word == "Ns" else (glue, word == "Fl")
            continue
        text = {"Nm": program, "Op": "[", "Oo": "[", "Oc": "]"}.get(word, word)
        close += "]" if word == "Op" else ""
        text = "-" + text if dash else text
        if (glue or word == "Oc" or (out and out[-1] == "[")) and out:
            out[-1] += text
        else:
            out.append(text)
        glue, dash = False, False
    return " ".join(out) + close


def _macro_line(line: str, program: str = "") -> str | None:
    """Plain text of a troff request line, or None to drop it."""
    parts = line[1:].strip().split(None, 1)
    if not parts or parts[0].startswith('\\"'):
        return None
    name, args = parts[0], (parts[1] if len(parts) > 1 else "")
    if name in DROPPED_REQUESTS or not (args or name in {"Nm", "Fl"}):
        return "" if name in {"PP", "P", "LP", "sp", "SH", "SS", "Sh", "Pp"} else None
    words = [w.strip('"') for w in re.findall(r'"[^"]*"|\S+', args)]
    if name in {"IP", "TP", "HP"} and len(words) > 1 and words[-1].isdigit():
        words = words[:-1]  # the indent, not text
    if name == "Nm" and words:
        return " ".join(words)
    if name in MDOC_MARKUP or name in {"It", "Nd"}:
        text = _mdoc_text([name, *words] if name in MDOC_MARKUP else words, program)
        return f"- {text}" if name == "Nd" else text
    text = ("" if name in JOINED_MACROS else " ").join(words)
    return f"\n{text}" if name in {"SH", "SS", "Sh", "Ss"} else text


def strip_troff(source: str) -> str:
    """Plain text of a troff (man or mdoc) page: requests and escapes removed."""
    lines, end_of_skip, program = [], None, ""
    for line in source.splitlines():
        if line.startswith(".Nm ") and not program:
            program = line.split()[1]
        if end_of_skip:  # inside a macro definition or a conditional block
            done = line.strip() == ".." if end_of_skip == ".." else end_of_skip in line
            end_of_skip = None if done else end_of_skip
            continue
        if line.startswith((".de ", ".ig", ".am ")):
            end_of_skip = ".."
            continue
        if line.startswith((".", "'")) and "\\{" in line and "\\}" not in line:
            end_of_skip = "\\}"
            continue
        if line.startswith((".", "'")):
            line = _macro_line(line, program)
            if line is None:
                continue
        lines.append(TROFF_ESCAPE.sub(_replace_escape, line).rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


# --- candidates per source -----------------------------------------------


def code_candidates(stdlib: Path) -> Iterator[Candidate]:
    """The stdlib ``*.py`` files outside ``SKIP_CODE_DIRS``."""
    for file in stdlib.rglob("*.py"):
        rel = file.relative_to(stdlib)
        if not SKIP_CODE_DIRS.intersection(rel.parts[:-1]) and file.is_file():
            yield Candidate(f"stdlib/{rel.as_posix()}", lambda file=file: read_text(file))


def man_candidates(man: Path) -> Iterator[Candidate]:
    """English man pages (``man*/``), at most ``MAX_MAN_PAGES_PER_FAMILY`` per command family."""
    pages = sorted(p.relative_to(man).as_posix() for p in man.glob("man*/*") if p.is_file() and not p.is_symlink())
    per_family: dict[str, list[str]] = {}
    for rel in sorted(pages, key=lambda rel: stable_hash("order:" + rel)):
        family = re.split(r"[-_.]", rel.split("/")[-1], maxsplit=1)[0]
        per_family.setdefault(family, []).append(rel)
    for rel in sorted(r for family in per_family.values() for r in family[:MAX_MAN_PAGES_PER_FAMILY]):
        yield Candidate(f"man/{rel}", lambda file=man / rel: strip_troff(read_text(file)))


def doc_candidates(doc: Path) -> Iterator[Candidate]:
    """Package READMEs and ``copyright`` files (plain or gzip'd) under the doc directory."""
    for file in doc.rglob("*"):
        name = file.name[:-3] if file.name.endswith(".gz") else file.name
        if DOC_FILE.match(name) and file.is_file() and not file.name.endswith((".html", ".htm")):
            yield Candidate(f"doc/{file.relative_to(doc).as_posix()}", lambda file=file: read_text(file))


def pydoc_candidates() -> Iterator[Candidate]:
    """The pydoc help topics (``pydoc_data.topics.topics``), one document per topic."""
    from pydoc_data.topics import topics

    for name, text in topics.items():
        yield Candidate(f"pydoc/topics/{name}", lambda text=text: text)


def domain_candidates(domain: str, roots: Mapping[str, Path], include_pydoc: bool = True) -> list[Candidate]:
    """All candidates of a domain; a clear error naming the searched places when empty."""
    if domain == "code":
        found, searched = list(code_candidates(roots["stdlib"])), [roots["stdlib"]]
    elif domain == "prose":
        found = [*man_candidates(roots["man"]), *doc_candidates(roots["doc"])]
        found += list(pydoc_candidates()) if include_pydoc else []
        searched = [roots["man"], roots["doc"], "pydoc_data.topics"]
    else:
        raise InputError(f"unknown domain {domain!r}; valid domains: {list(DOMAINS)}")
    if not found:
        raise FileNotFoundError(f"no {domain} files found; searched: {', '.join(map(str, searched))}")
    return found


# --- the corpus ------------------------------------------------------------


def collect_domain(
    candidates: list[Candidate],
    domain: str,
    max_bytes: int,
    max_doc_chars: int = MAX_DOC_CHARS,
    heldout_mod: int = HELDOUT_MOD,
) -> dict[str, list[Document]]:
    """Read, filter, dedupe, cap and split one domain (rules 2-5 of the module docstring).

    Args:
        candidates: the domain's files; their order does not matter.
        domain: the name stored on each ``Document``.
        max_bytes: stop once the kept texts reach this many UTF-8 bytes (0 = no cap).
        max_doc_chars: skip documents longer than this.
        heldout_mod: a file is held out when ``sha1(path) % heldout_mod == 0``.
    """
    seen, kept, total = set(), [], 0
    ordered = sorted(candidates, key=lambda c: (stable_hash("order:" + c.path), c.path))
    for candidate in tqdm(ordered, desc=f"corpus ({domain})", unit="file", leave=False):
        text = candidate.read()
        key = hashlib.sha1(text.strip().encode("utf-8")).hexdigest()
        if not MIN_DOC_CHARS <= len(text) <= max_doc_chars or key in seen:
            continue
        seen.add(key)
        kept.append(Document(candidate.path, domain, text))
        total += len(text.encode("utf-8"))
        if max_bytes and total >= max_bytes:
            break
    kept.sort(key=lambda doc: doc.path)
    return {
        "train": [doc for doc in kept if not is_heldout(doc.path, heldout_mod)],
        "heldout": [doc for doc in kept if is_heldout(doc.path, heldout_mod)],
    }


def collect_corpus(
    roots: Mapping[str, Path] | None = None,
    max_bytes: Mapping[str, int] | None = None,
    max_doc_chars: int = MAX_DOC_CHARS,
    heldout_mod: int = HELDOUT_MOD,
    include_pydoc: bool = True,
) -> dict[str, dict[str, list[Document]]]:
    """The corpus as ``{domain: {"train" | "heldout": [Document, ...]}}``, sorted by path.

    Args:
        roots: source roots ``{"stdlib", "man", "doc"}`` (default: this machine's, see
            ``default_roots``).
        max_bytes: per-domain cap in UTF-8 bytes, e.g. ``{"code": 12_000_000}``; missing = no cap.
        max_doc_chars: skip documents longer than this.
        heldout_mod: a file is held out when ``sha1(path) % heldout_mod == 0``.
        include_pydoc: add the pydoc topics to the prose domain.
    """
    roots = {**default_roots(), **(roots or {})}
    max_bytes = max_bytes or {}
    return {
        domain: collect_domain(
            domain_candidates(domain, roots, include_pydoc), domain, max_bytes.get(domain, 0), max_doc_chars, heldout_mod
        )
        for domain in DOMAINS
    }
