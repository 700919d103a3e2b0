"""Files: reading user text with one clear error, and writing so that a kill never leaves half a file or directory.

Every writer of the project that must not be seen half-done goes through ``atomic_file``
(one file, or a link) or ``atomic_directory`` (a whole directory, swapped in): the work
happens in a hidden sibling that is renamed into place when it is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .errors import InputError


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a hidden sibling of ``path`` to write (a file or a link); rename it over ``path`` when the block succeeds.

    A kill leaves the old ``path`` or the new one; a failure removes the sibling and re-raises.
    """
    path = Path(path)
    partial = path.with_name(f".{path.name}.tmp")
    partial.unlink(missing_ok=True)
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``atomic_file``."""
    with atomic_file(path) as partial:
        partial.write_text(text)


def staging_dir(out: str | Path) -> Path:
    """The hidden sibling a new version of the directory ``out`` is written into (``atomic_directory``, ``publish_directory``)."""
    out = Path(out)
    return out.with_name(f".{out.name}.partial")


@contextlib.contextmanager
def atomic_directory(out: str | Path) -> Iterator[Path]:
    """Yield an empty staging directory; when the block succeeds, swap it in as ``out`` (an existing ``out`` is replaced).

    A failure removes the staging directory and leaves ``out`` as it was; a kill leaves the
    old ``out`` or the new one (``publish_directory``).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _restore(out)
    staging = staging_dir(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_directory(staging, out)


def publish_directory(staging: Path, out: str | Path) -> Path:
    """Swap the complete directory ``staging`` in as ``out``: ``out`` is old or new, never half-written.

    An existing ``out`` is renamed aside, ``staging`` renamed into place, and the old one
    removed. A kill between the two renames leaves the old directory as ``.<name>.old``;
    the next ``atomic_directory`` of ``out`` puts it back before it starts.
    """
    out = Path(out)
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def _restore(out: Path) -> None:
    """Put back what an interrupted swap set aside, and drop a stale copy of it."""
    old = out.with_name(f".{out.name}.old")
    if old.exists() and not out.exists():
        os.replace(old, out)
    shutil.rmtree(old, ignore_errors=True)


def read_text(path: str | Path, what: str = "file", max_bytes: int | None = None) -> str:
    """The text of a UTF-8 file; a missing, binary or non-UTF-8 file is one InputError line naming it.

    Args:
        what: what the file is, for messages ("domain file", "data file").
        max_bytes: read at most this many bytes (a cut inside a character is dropped).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
    with open(path, "rb") as f:
        data = f.read() if max_bytes is None else f.read(max_bytes)
    if b"\x00" in data:
        raise InputError(f"{what} {path} looks binary (it holds NUL bytes); give a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        if max_bytes is not None and len(data) == max_bytes and err.start >= len(data) - 3:
            return data[: err.start].decode("utf-8")  # the read stopped inside a character
        raise InputError(f"{what} {path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})") from None


def read_json_object(file: str | Path, what: str) -> dict:
    """The JSON object in ``file``; one InputError naming it when it is not valid JSON or not an object.

    A missing file raises FileNotFoundError, for the caller to name what was expected there.
    """
    file = Path(file)
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"{what} {file} is not valid JSON: {first}") from error
    if not isinstance(values, dict):
        raise InputError(f"{what} {file} must hold a JSON object, got {type(values).__name__}")
    return values


def check_writable(directory: str | Path, what: str = "output directory") -> Path:
    """Create ``directory`` if needed and prove a file can be written there, before any long work; else InputError."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".draftsmith-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise InputError(f"{what} {directory} is not writable ({err.strerror or err})") from None
    return directory
