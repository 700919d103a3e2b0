"""The tiny training setup shared by the training tests: the text, and overrides that shrink a recipe to it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEXT = "".join(
    f"def f{i}(x):\n    return x * {i} + {i % 7}\n\nThe fox number {i} jumps over the lazy dog {i % 5} times.\n" for i in range(60)
)


def recipe_overrides(target_dir: Path, text_file: Path, root: Path, *extra: str) -> list[str]:
    """Overrides that shrink the draft-LM recipe to the tiny target and text file (a few seconds per run)."""
    return [
        f"target={target_dir}",
        f"output_dir={root / 'out'}",
        f"run_dir={root / 'run'}",
        f"data.train_files=[{text_file}]",
        "data.eval_files=[]",
        "data.block_size=32",
        "draft.init.num_layers=1",
        "draft.init.hidden_size=32",
        "draft.init.intermediate_size=64",
        "draft.init.num_heads=4",
        "draft.init.num_kv_heads=2",
        "batch_size=4",
        "learning_rate=0.01",
        "warmup_steps=2",
        "log_every=1",
        "checkpoint_every=100",
        "threads=1",
        *extra,
    ]


class LauncherHung(AssertionError):
    """A launcher still ran past its timeout (the message holds its processes' stacks)."""


def run_launcher(command: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a launcher and its workers, which leaves a trace where it hangs.

    The launcher's own log is at INFO (where its agent waits) and every process runs with
    ``faulthandler`` on; past ``timeout`` the launcher and every process under it (the
    workers run in sessions of their own) get SIGABRT, so each prints its Python threads'
    stacks, and ``LauncherHung`` carries the end of stderr.
    """
    env = {**env, "PYTHONFAULTHANDLER": "1", "LOGLEVEL": "INFO"}
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        processes = [child.pid, *descendants(child.pid)]  # read before any dies (its children would move to init)
        signal_all(processes, signal.SIGABRT)
        try:
            out, err = child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            signal_all(processes, signal.SIGKILL)
            out, err = child.communicate()
        raise LauncherHung(f"{command[:6]} still ran after {timeout} s; its processes' stacks:\n{err[-12000:]}") from None
    return subprocess.CompletedProcess(command, child.returncode, out, err)


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, theirs, ...), read from /proc (none where it is absent)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def signal_all(processes: list[int], sig: int) -> None:
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
