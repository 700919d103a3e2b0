"""Atomic writers: the reader of a path sees the old file or directory or the new one, never half of one."""

from __future__ import annotations

import os

import pytest

from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.files import atomic_directory, atomic_file, read_text, staging_dir, write_text_atomic


def test_a_file_is_replaced_whole_and_a_failure_keeps_the_old_one(tmp_path):
    path = tmp_path / "store.json"
    write_text_atomic(path, "old")
    with pytest.raises(RuntimeError), atomic_file(path) as partial:
        partial.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["store.json"]  # no leftover
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["store.json"]


def test_a_link_is_swapped_atomically(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    link = tmp_path / "current"
    for target in ("a", "b"):
        with atomic_file(link) as partial:
            partial.symlink_to(target)
        assert link.readlink().name == target


def test_a_directory_is_swapped_in_whole_and_a_failure_leaves_the_old_one(tmp_path):
    out = tmp_path / "export"
    with atomic_directory(out) as staging:
        (staging / "weights").write_text("v1")
    with pytest.raises(KeyboardInterrupt), atomic_directory(out) as staging:
        (staging / "weights").write_text("v2, half")
        raise KeyboardInterrupt
    assert (out / "weights").read_text() == "v1" and not staging_dir(out).exists()
    with atomic_directory(out) as staging:
        (staging / "other").write_text("v3")
    assert sorted(p.name for p in out.iterdir()) == ["other"]  # replaced, not merged
    assert sorted(os.listdir(tmp_path)) == ["export"]


def test_an_interrupted_swap_is_put_back_before_the_next_write(tmp_path):
    """A kill between the two renames leaves ``.<name>.old`` and no ``<name>``: the next write restores it first."""
    out, old = tmp_path / "export", tmp_path / ".export.old"
    old.mkdir()
    (old / "weights").write_text("v1")
    with pytest.raises(RuntimeError), atomic_directory(out):
        assert (out / "weights").read_text() == "v1"  # restored before the new version is written
        raise RuntimeError
    assert (out / "weights").read_text() == "v1" and not old.exists()


def test_read_text_names_a_binary_or_non_utf8_file(tmp_path):
    binary, latin = tmp_path / "b.bin", tmp_path / "l.txt"
    binary.write_bytes(b"ab\x00cd")
    latin.write_bytes("café".encode("latin-1"))
    with pytest.raises(InputError, match=r"data file .*b\.bin looks binary"):
        read_text(binary, "data file")
    with pytest.raises(InputError, match=r"l\.txt is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        read_text(latin, "data file")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text(tmp_path / "missing.txt")
