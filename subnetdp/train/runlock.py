"""One job per run directory: an exclusive lock held for the job's lifetime.

The lock is ``RUN_DIR/.lock``, taken with ``fcntl.flock`` before anything is written there and kept
open until the job ends. The kernel releases it when the holder exits, however it exits (a SIGKILL
included), so a crashed job never leaves a stale lock. A second job started on the same run
directory finds the lock taken and stops with the holder's host, process id, start time and
command, which the holder writes into the file.

Who holds it:

- a launcher this project runs (``subnetdp train launch.nproc=N``, ``subnetdp launch`` with
  torchrun on one node) takes it *before any worker exists* (:func:`hold_for_workers`), so a second
  launcher on the same run directory stops before it starts anything, however close together the two
  were started. It names the lock and its own process id to its workers in :data:`HOLDER_ENV`;
- otherwise (torchrun, mpirun or srun started by hand, one process) rank 0 of the job takes it when
  the process group exists. Rank 0 of a launcher's workers takes nothing: :class:`RunLock` accepts the
  lock of the launcher it descends from (checked against the lock file and the process tree) as the
  job's. On several nodes only rank 0 does either, so the lock is the job's, not a node's.

:func:`claim` is the one sequence a launching process runs before a job starts there.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from subnetdp.core.errors import ConfigError, SubnetdpError

LOCK_FILE = ".lock"
#: ``PID:PATH``: the launching process PID holds the lock file PATH for the workers it starts.
HOLDER_ENV = "SUBNETDP_RUN_LOCK"


class RunLockedError(SubnetdpError):
    """Another live job holds the run directory."""


def job_id() -> str:
    """The id of the job this process belongs to, where its launcher gives one (torchrun's run id).

    torchrun keeps it across the restarts of one job (a failure, or nodes joining or leaving), so a
    restarted group recognises the run directory its first group started; ``none`` is torchrun's
    default for every job and tells nothing.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return "" if run_id in ("", "none") else run_id


def _read_info(f: IO[str]) -> dict[str, Any]:
    f.seek(0)
    try:
        info = json.loads(f.read() or "{}")
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def lock_info(run_dir: Path) -> dict[str, Any]:
    """What the newest holder wrote into ``run_dir``'s lock file (empty when there is none)."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file() or path.is_symlink():
        return {}
    with open(path, "r", encoding="utf-8") as f:
        return _read_info(f)


def _holder(f: IO[str]) -> str:
    info = _read_info(f)
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


def _ancestors() -> set[int]:
    """This process and the processes it descends from (Linux: from /proc; elsewhere: the parent)."""
    found = {os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def _held_by_our_launcher(path: Path, f: IO[str]) -> bool:
    """The lock on ``path`` is held by the launcher this process descends from (see :data:`HOLDER_ENV`)."""
    pid, _, named = os.environ.get(HOLDER_ENV, "").partition(":")
    if not pid.isdigit() or not named:
        return False
    try:
        same_file = Path(named).resolve() == path.resolve()
    except OSError:
        return False
    return same_file and _read_info(f).get("pid") == int(pid) and int(pid) in _ancestors()


class RunLock:
    """The exclusive lock on a run directory; :meth:`release` (or the process's exit) frees it.

    A lock already held by the launcher this process descends from is accepted as the job's
    (``handed_over``): the launcher keeps it, and its record in the file stays as it is.
    """

    def __init__(self, run_dir: Path, wait_s: float = 0.0) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.handed_over = False
        if self.path.is_symlink():
            raise SubnetdpError(f"{self.path}: is a symbolic link: remove it (the lock file is the run's own)")
        self._file: IO[str] | None = open(self.path, "a+", encoding="utf-8")
        locked = _try_lock(self._file)
        if not locked and _held_by_our_launcher(self.path, self._file):
            self.handed_over = True
            return
        deadline = time.monotonic() + wait_s
        while not locked and time.monotonic() < deadline:
            time.sleep(0.2)
            locked = _try_lock(self._file)
        if not locked:
            err = _busy(Path(run_dir), self._file)
            self._file.close()
            self._file = None
            raise err
        info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                                "argv": [Path(sys.argv[0]).name, *sys.argv[1:]], "job": job_id()}
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(info))
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock (a handed-over lock stays the launcher's)
            self._file = None


def check_free(run_dir: Path, given: str | None = None) -> None:
    """Raise :class:`RunLockedError` if a live job other than this process's own launcher holds ``run_dir``
    (checked, not taken), or :class:`ConfigError` if ``run_dir`` cannot be written (``given``: ``run.dir``
    as configured, for that line; ``run_dir`` itself when not given)."""
    check_writable(run_dir, str(run_dir) if given is None else given)
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file() or path.is_symlink():
        return
    with open(path, "r", encoding="utf-8") as f:
        if not _try_lock(f) and not _held_by_our_launcher(path, f):
            raise _busy(Path(run_dir), f)


def launcher_holds(run_dir: Path) -> bool:
    """Whether the launcher this process descends from holds ``run_dir``'s lock for its workers (it
    then made the checks that precede a run there)."""
    path = Path(run_dir) / LOCK_FILE
    if not os.environ.get(HOLDER_ENV) or not path.is_file() or path.is_symlink():
        return False
    with open(path, "r", encoding="utf-8") as f:
        return not _try_lock(f) and _held_by_our_launcher(path, f)


@contextmanager
def hold_for_workers(run_dir: Path) -> Iterator[RunLock]:
    """Take ``run_dir``'s lock in a launching process and name it to the workers it starts.

    Raises :class:`RunLockedError` at once when a live job holds it; creates ``run_dir``.
    """
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    lock = RunLock(Path(run_dir))
    saved = os.environ.get(HOLDER_ENV)
    os.environ[HOLDER_ENV] = f"{os.getpid()}:{lock.path.resolve()}"
    try:
        yield lock
    finally:
        if saved is None:
            os.environ.pop(HOLDER_ENV, None)
        else:
            os.environ[HOLDER_ENV] = saved
        lock.release()


def check_writable(run_dir: Path, given: str) -> None:
    """Raise one line naming ``run.dir`` unless this process can create ``run_dir`` and its lock file.

    Checked in the launching process: otherwise every worker of the job fails on its own with an
    ``OSError`` on the lock file. ``given`` is ``run.dir`` as configured (the key's value in the line).
    """
    run_dir = Path(run_dir)
    fix = "choose a run.dir (or run.name) this user can write into, or give the folder write permission (chmod u+w)"
    where = run_dir
    while not where.exists() and not where.is_symlink() and where != where.parent:
        where = where.parent  # the folder the missing ones would be made in
    if not where.is_dir():
        raise ConfigError("run.dir", given, f"{where} is not a folder, so {run_dir} cannot be made", fix)
    lock = run_dir / LOCK_FILE
    if not os.access(where, os.W_OK | os.X_OK) or (lock.exists() and not os.access(lock, os.W_OK)):
        raise ConfigError("run.dir", given, f"{lock if lock.exists() else where} is not writable by this user", fix)


def claim(run_dir: Path, check_new_run: Callable[..., None], given: str, hold: bool = False) -> AbstractContextManager:
    """The checks before a job starts on ``run_dir``, in the launching process, before any worker exists.

    In order: the directory can be written (:func:`check_writable`), no live job holds it
    (:func:`check_free`), no old run is there (``check_new_run``, which deletes it under
    ``run.overwrite``). With ``hold``, the returned context holds the lock for the workers this
    process starts (:func:`hold_for_workers`), and the old run is deleted only once it is held;
    without, the checks are made now and the context holds nothing (the job's rank 0 takes the lock).

    Args:
        run_dir: the run directory (``run.dir/run.name``).
        check_new_run: ``upfront.check_new_run`` bound to the config; takes ``remove``.
        given: ``run.dir`` as configured, for the error line.
        hold: whether this process starts the workers on this node and holds the lock for them.
    """
    check_free(run_dir, given)  # writable first; a busy run directory is this line, not the old-run line below
    if not hold:
        check_new_run()
        return nullcontext()
    check_new_run(remove=False)  # refused here, a job touches nothing, the lock file included
    return _held(Path(run_dir), check_new_run)


@contextmanager
def _held(run_dir: Path, check_new_run: Callable[..., None]) -> Iterator[RunLock]:
    with hold_for_workers(run_dir) as lock:
        check_new_run()  # again, now that no other job can start a run there
        yield lock
