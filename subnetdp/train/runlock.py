"""One job per run directory: an exclusive lock held for the job's lifetime.

Rank 0 of a job takes ``RUN_DIR/.lock`` with ``fcntl.flock`` before anything is written there and
keeps the file open until the job ends. The kernel releases the lock when the holder exits, however
it exits (a SIGKILL included), so a crashed job never leaves a stale lock. A second job started on
the same run directory, for example while the workers of a killed launcher go on, finds the lock
taken and stops with the holder's host, process id, start time and command, which the holder writes
into the file.

The plain launcher (``subnetdp train launch.nproc=N``) checks the lock once before it starts any
worker (:func:`check_free`), so a busy run directory fails at once with exit code 2; the lock itself
is held by rank 0, which lives as long as the job's work does.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any

from subnetdp.core.errors import SubnetdpError

LOCK_FILE = ".lock"


class RunLockedError(SubnetdpError):
    """Another live job holds the run directory."""


def _holder(f: IO[str]) -> str:
    f.seek(0)
    try:
        info = json.loads(f.read() or "{}")
    except ValueError:
        info = {}
    if not info:
        return "another process (it wrote no details)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("time", 0)))
    return (f"pid {info.get('pid')} on {info.get('host')}, started {started}: "
            f"{' '.join(map(str, info.get('argv', [])))[:200]}")


def _try_lock(f: IO[str]) -> bool:
    import fcntl

    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _busy(run_dir: Path, f: IO[str]) -> RunLockedError:
    return RunLockedError(f"run directory {run_dir} is in use by a live job ({_holder(f)}): one job per run "
                          "directory — wait for it to finish, stop it, or choose another run.name")


class RunLock:
    """The exclusive lock on a run directory; :meth:`release` (or the process's exit) frees it."""

    def __init__(self, run_dir: Path, wait_s: float = 0.0) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        if self.path.is_symlink():
            raise SubnetdpError(f"{self.path}: is a symbolic link: remove it (the lock file is the run's own)")
        self._file: IO[str] | None = open(self.path, "a+", encoding="utf-8")
        deadline = time.monotonic() + wait_s
        while not _try_lock(self._file) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _try_lock(self._file):
            err = _busy(Path(run_dir), self._file)
            self._file.close()
            self._file = None
            raise err
        info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                                "argv": [Path(sys.argv[0]).name, *sys.argv[1:]]}
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(info))
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock
            self._file = None


def check_free(run_dir: Path) -> None:
    """Raise :class:`RunLockedError` if a live job holds ``run_dir`` (checked, not taken)."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file() or path.is_symlink():
        return
    with open(path, "r", encoding="utf-8") as f:
        if not _try_lock(f):
            raise _busy(Path(run_dir), f)
