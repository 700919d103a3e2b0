"""Engine processes that must not outlive the run: a ``vllm serve`` on localhost and its load generator.

Each process starts in a session (and process group) of its own, so that the engine's
workers go with it and a Ctrl-C at the terminal reaches only draftsmith, which then stops
every group itself: SIGTERM to the group, SIGKILL to what is left after a grace period, the
leader reaped. On Linux the leader also gets SIGTERM when draftsmith dies without a chance to
clean up (``PR_SET_PDEATHSIG``). Every wait is bounded in time; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

HOST = "127.0.0.1"
GRACE_S = 20.0  # after SIGTERM, before SIGKILL
POLL_S = 0.5


class EngineProcessError(RuntimeError):
    """An engine process failed to start, failed, or ran out of time; the message ends with its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 as servers bind (SO_REUSEADDR): no process is left listening on it.

    Closed connections may linger in TIME_WAIT for a minute; they hold no process and block no server.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (from /proc; zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def group_memory(pgid: int) -> int:
    """Bytes of memory the group's processes use: the sum of their proportional set sizes (shared pages split between them)."""
    total = 0
    for pid in group_pids(pgid):
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in rollup.splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) * 1024
                break
    return total


def log_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else "(no log)"


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when draftsmith dies, even by SIGKILL (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without draftsmith's venv, for the engine venv's Python."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **(extra or {})}


class Group:
    """A command in a process group of its own, with its output in ``log``; ``stop()`` ends the whole group."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str], cwd: Path | None = None):
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent
            )
        self.pgid = self.process.pid  # a new session's leader leads its group

    def stop(self, grace_s: float = GRACE_S) -> None:
        """SIGTERM to the group, SIGKILL to what remains after ``grace_s``; returns once no process of it is left."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=POLL_S)  # reap the leader, so it is not a zombie of this process
                if not group_pids(self.pgid):
                    return

    def wait(self, timeout_s: float, what: str) -> None:
        """Wait for the command to end; stop it and raise past ``timeout_s`` or on a non-zero exit."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise EngineProcessError(f"{what} ran past its {timeout_s:.0f} s:\n{log_tail(self.log)}") from None
        finally:
            self.stop(grace_s=5.0)  # anything it left behind
        if code != 0:
            raise EngineProcessError(f"{what} failed (exit {code}):\n{log_tail(self.log)}")


class Server(Group):
    """``vllm serve`` on 127.0.0.1:``port``; ``wait_ready`` polls ``/health``; the peak memory of its group is sampled."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict[str, str]):
        super().__init__(command, log, env)
        self.port = port
        self.peak_bytes = 0
        self._sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ``/health`` answered 200; raises when the server exits first or ``timeout_s`` passes."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise EngineProcessError(f"vllm serve exited ({self.process.returncode}) before it was ready:\n{log_tail(self.log)}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        self._sampler.start()
                        return time.monotonic() - start
            time.sleep(POLL_S)
        raise EngineProcessError(f"vllm serve was not ready after {timeout_s:.0f} s:\n{log_tail(self.log)}")

    def _sample(self) -> None:
        while not self._sampling.is_set():
            self.peak_bytes = max(self.peak_bytes, group_memory(self.pgid))
            self._sampling.wait(1.0)

    def stop(self, grace_s: float = GRACE_S) -> None:
        self._sampling.set()
        super().stop(grace_s)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside: SIGTERM raises KeyboardInterrupt like Ctrl-C, so every ``finally`` stops its servers."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
