"""What an error that ends a worker leaves behind: one line on the console, the whole error in the run directory.

Once a run directory is this job's (set-up made the run context, the lock held), every error that
ends a worker, a lost peer included, is appended to ``RUN_DIR/logs/rank_R.log``: a header (time,
host, process, rank, step), the console line, and the full traceback with every exception that led
to it, the ones raised ``from None`` included (a lost peer's message from gloo or NCCL is there). The
console gets one line per rank: which rank stopped, at which step, why (for a lost peer: which rank
died or stopped answering, and what this rank kept), what to do next, and the log's path. A signal
that stops the run at a step boundary is no error: nothing is written for it.

An error before the run context exists (a bad config, a world that does not assemble, a run
directory another job holds) is printed as before: there is no directory of this job to write to.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple, Optional

from subnetdp.core.contracts import RunContext
from subnetdp.core.errors import PeerLost, SubnetdpError
from subnetdp.launchers.failures import NATIVE_ENV, tell_agent
from subnetdp.train.stopping import Interrupted, continue_command

LOGS = "logs"


def log_path(run_dir: Path, rank: int) -> Path:
    """``RUN_DIR/logs/rank_R.log``: where rank R's errors are kept."""
    return Path(run_dir) / LOGS / f"rank_{rank}.log"


def format_chain(error: BaseException) -> str:
    """``error``'s traceback after those of the exceptions that led to it, oldest first, as Python
    prints a chain, but with the contexts a ``raise ... from None`` hides."""
    chain: list[BaseException] = []
    e: Optional[BaseException] = error
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ if e.__cause__ is not None else e.__context__
    parts: list[str] = []
    for older, newer in zip(reversed(chain), [*reversed(chain[:-1]), None]):
        parts.extend(traceback.format_exception(type(older), older, older.__traceback__, chain=False))
        if newer is not None:
            parts.append("\nThe above exception was the direct cause of the following exception:\n\n"
                         if newer.__cause__ is older else
                         "\nDuring handling of the above exception, another exception occurred:\n\n")
    return "".join(parts)


def write_log(path: Path, header: str, line: str, error: BaseException) -> bool:
    """Append one error to ``path`` (created with its folder); False when it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"==== {header}\n{line}\n\n{format_chain(error)}\n")
            f.flush()
            os.fsync(f.fileno())  # the process may leave with os._exit right after
        return True
    except OSError:
        return False


class Failure(NamedTuple):
    """The error that ended this worker: its console line and its log (None when none was written)."""

    line: str
    log: Optional[Path]


class FailureLog:
    """Context manager around a worker's run: on an error after :meth:`claim`, the log and the line.

    The error itself is re-raised unchanged (callers of :func:`subnetdp.train.loop.train` see the
    exception the run raised); :attr:`failure` holds what the command prints instead of a traceback.
    """

    def __init__(self) -> None:
        self.ctx: Optional[RunContext] = None
        self.state: Any = None
        self.failure: Optional[Failure] = None

    def claim(self, ctx: RunContext) -> None:
        """The run context exists: from now on an error is this run's, and is logged in its directory."""
        self.ctx = ctx
        route_native_stderr(ctx.run_dir, ctx.rank)

    def follow(self, state: Any) -> None:
        """The training state, whose progress says at which step an error came."""
        self.state = state

    def __enter__(self) -> "FailureLog":
        return self

    def __exit__(self, kind: Any, error: Optional[BaseException], tb: Any) -> None:
        if self.ctx is None or not isinstance(error, Exception) or isinstance(error, Interrupted):
            return
        try:
            self.failure = self._record(self.ctx, error)
        except Exception:  # reporting must never hide the error itself
            self.failure = None

    def _record(self, ctx: RunContext, error: Exception) -> Failure:
        rank, where = ctx.rank, self._where()
        if isinstance(error, SubnetdpError):
            why = str(error)
        else:
            text = str(error).strip().splitlines()
            why = f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__
        line = f"rank {rank} stopped {where}: {why}"
        if isinstance(error, PeerLost):
            line += f"; {next_step(ctx)}"
        log = log_path(ctx.run_dir, rank)
        header = (f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} of {ctx.comm.world_size}, host "
                  f"{os.uname().nodename}, pid {os.getpid()}, {where}: {' '.join(sys.argv)}")
        written = write_log(log, header, line, error)
        line += f"; the full error: {log}" if written else f" (no log: {log} could not be written)"
        tell_agent(line, str(log) if written else None)
        return Failure(line, log if written else None)

    def _where(self) -> str:
        progress = getattr(self.state, "progress", None)
        if progress is None:
            return "during set-up"
        if not progress.step:
            return "before its first step"
        return f"after step {progress.step}" if progress.settled else f"in step {progress.step}"


def next_step(ctx: RunContext) -> str:
    """What to do after a lost peer: the launcher's restart when it has one left (and the run resumes
    by itself), else the command that continues the run."""
    cfg = ctx.cfg
    count, most = os.environ.get("TORCHELASTIC_RESTART_COUNT", ""), os.environ.get("TORCHELASTIC_MAX_RESTARTS", "")
    if cfg.resume == "auto" and count.isdigit() and most.isdigit() and int(count) < int(most):
        return (f"the launcher restarts the workers (restart {int(count) + 1} of {most}), which continue from "
                "there (resume=auto)")
    return f"continue with: {continue_command(sys.argv, cfg.run.dir, ctx.run_name)}"


def stamp() -> str:
    """The local time at the head of a plain log line (a batch job's log reads as a timeline)."""
    return time.strftime("%Y-%m-%d %H:%M:%S")


def say_going_on(ctx: RunContext, step: int) -> None:
    """After a restart, each node's first worker says that the job goes on, and from where.

    Every node's console, not only rank 0's: whoever watches node 1 learns that the job recovered.
    Nothing on a first start.
    """
    count, most = os.environ.get("TORCHELASTIC_RESTART_COUNT", ""), os.environ.get("TORCHELASTIC_MAX_RESTARTS", "")
    if not count.isdigit() or int(count) == 0 or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    node = os.environ.get("GROUP_RANK", "0")
    of = f" of {most}" if most.isdigit() else ""
    print(f"{stamp()} subnetdp: node {node}: the job goes on after restart {count}{of}: {ctx.world_size} ranks, "
          f"from step {step}", flush=True)


def native_log_path(run_dir: Path, rank: int) -> Path:
    """``RUN_DIR/logs/rank_R.stderr``: what the C++ side of rank R wrote to its standard error."""
    return Path(run_dir) / LOGS / f"rank_{rank}.stderr"


def route_native_stderr(run_dir: Path, rank: int) -> None:
    """In a worker of torch's elastic launcher, send file descriptor 2 to ``logs/rank_R.stderr``.

    torch's C++ side (the TCPStore client, gloo, c10 warnings and their backtraces) writes to fd 2
    directly: after a lost peer that is dozens of lines per rank, against the console's one line per
    rank. Python's ``sys.stderr`` is rebound to a copy of the console's descriptor first, so every
    line of subnetdp's own (and Python's warnings) still reaches the console. Only in a launched
    worker (``TORCHELASTIC_RUN_ID``): a process run in-line (a test, a notebook) keeps its streams.
    ``SUBNETDP_NATIVE_STDERR=console`` leaves fd 2 alone.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get(NATIVE_ENV) == "console":
        return
    path = native_log_path(run_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sys.stderr.flush()
        console = os.dup(2)
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return  # the console keeps it all: better noisy than silent
    os.dup2(target, 2)
    os.close(target)
    sys.stderr = open(console, "w", buffering=1, encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                      errors="backslashreplace")
