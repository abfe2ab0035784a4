"""``python -m subnetdp.launchers.torchrun ARGS``: torchrun (``torch.distributed.run``), with one line on a signal.

torchrun turns SIGINT/SIGTERM into a ``SignalException``: it passes the signal to its workers (which
finish their step, write a checkpoint and exit) and then raises it, so the user's terminal ends in a
traceback. This entry point runs the same ``torch.distributed.run.main`` and ends that case with one
line and the exit status ``128 + signal``, as ``subnetdp train launch.nproc=N`` does; a worker group
that failed with no restart left, or a rendezvous that failed, ends with one line and status 1 (each
worker printed its own line above it; the line names the run directory's logs that hold their full
errors, :mod:`subnetdp.launchers.failures`). Everything else, arguments included, is torchrun's.

Each round of the rendezvous gets a fresh store for its workers (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
unless set): with the store shared by the agents (torch's default), a node that joins a running
elastic job waits for an address that the agent that was already rank 0 never publishes again, until the
store's read timeout (60 s) fails both agents (torch 2.14.1), and a re-formed group could read the keys of the previous one. The workers learn the
agent's process id (``SUBNETDP_LAUNCHER_PID``), so one whose agent died before it could ask to die
with it exits at once (:mod:`subnetdp.launchers.lifetime`).

The agent's own log records (torch's ``torch.distributed`` loggers: a failed worker's exit code,
rendezvous rounds, restarts) go to ``RUN_DIR/logs/agent_<host>_<pid>.log`` when the arguments name the
run, as a job over several nodes must: the console keeps one line per rank, and the workers route
their C++ side's output to ``logs/`` too (:func:`subnetdp.train.failures.route_native_stderr`). The
agent's own C++ side logs errors only (:func:`quiet_native_warnings`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from subnetdp.launchers.failures import NATIVE_ENV, describe_failures

if TYPE_CHECKING:
    from subnetdp.launchers.local import StopWatch

SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
SIGNALS_ENV = "PET_SIGNALS_TO_HANDLE"  # torchrun's --signals-to-handle, from the environment
SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's wait for the workers after a signal (30 s)
CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"


def quiet_native_warnings() -> None:
    """Start torch in this agent with its C++ side logging errors only; its workers keep the level they had.

    When the agents of a job over several nodes finish, the one hosting the rendezvous store may exit
    while another is still closing its rendezvous: that one's ``TCPStore`` client prints a warning and a
    C++ backtrace (15 lines) straight to the console before torch raises the error, which the agent's log
    records (measured: an occasional failure of the quiet-console test). The agent cannot send its file
    descriptor 2 to a file as a worker does: its workers inherit it. c10 reads ``TORCH_CPP_LOG_LEVEL`` once,
    when torch starts, so the variable is set for that moment only. ``SUBNETDP_NATIVE_STDERR=console`` leaves it.
    """
    if os.environ.get(NATIVE_ENV) == "console" or "torch" in sys.modules:
        return
    given = os.environ.get(CPP_LOG_ENV)
    os.environ[CPP_LOG_ENV] = "ERROR"
    try:
        import torch  # noqa: F401  (its C++ side reads the level now, once)
    finally:
        if given is None:
            del os.environ[CPP_LOG_ENV]
        else:
            os.environ[CPP_LOG_ENV] = given


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def run_dir_of_args(argv: list[str]) -> Path | None:
    """The run directory of ``... -m subnetdp train [RECIPE] KEY=VALUE ...``, or None if it cannot be told.

    ``run.name=`` must be on the command line (without it the workers make a name up: None then);
    ``run.dir=`` too, or it is read by composing the config (core's
    :func:`~subnetdp.core.config.compose`: the recipe's or the default folder).
    """
    args = list(argv)
    starts = [i for i in range(len(args) - 1) if args[i] == "subnetdp" and args[i + 1] == "train"]
    if not starts:
        return None
    rest = args[starts[0] + 2:]
    given = dict(a.split("=", 1) for a in rest if "=" in a and not a.startswith(("~", "+")))
    if not given.get("run.name"):
        return None  # the workers make a name up (a job over several nodes must give one)
    if given.get("run.dir"):
        return Path(given["run.dir"]) / given["run.name"]
    try:
        from subnetdp.core.config import compose

        recipe = rest[0] if rest and "=" not in rest[0] and not rest[0].startswith("~") else None
        cfg = compose(recipe, rest[1:] if recipe else rest)
    except Exception:  # noqa: BLE001 - a config the workers will refuse in their own words
        return None
    return Path(cfg.run.dir) / cfg.run.name if cfg.run.name else None


class _LazyFileHandler(logging.FileHandler):
    """A file handler that makes its folder at the first record (no run directory before the workers' checks)."""

    def _open(self):  # noqa: ANN202 - logging's own signature
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def route_agent_logs(argv: list[str]) -> Path | None:
    """Send the agent's ``torch.distributed`` log records to the run's ``logs/`` instead of the console.

    Returns the log file, or None when the run directory is unknown (the records stay on the console).
    The file is created at the first record, so a job refused up front leaves nothing behind. Call it
    after torch is imported: torch's logging set-up gives ``torch.distributed`` a console handler then.
    """
    run_dir = run_dir_of_args(argv)
    if run_dir is None:
        return None
    path = run_dir / "logs" / f"agent_{socket.gethostname()}_{os.getpid()}.log"
    handler = _LazyFileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("torch.distributed")
    # torch's logging set-up (at import) gives this logger a console handler of its own: replace it.
    for old in [h for h in log.handlers if type(h).__name__ == "_StderrHandler" or
                (isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler))]:
        log.removeHandler(old)
    log.addHandler(handler)
    log.propagate = False  # nor the "torch" logger's console handler above it
    return path


def _option(args: list[str], *names: str) -> str | None:
    """The value of torchrun option ``names`` in ``args`` (``--name=V`` or ``--name V``), or None."""
    for i, a in enumerate(args):
        if a == "-m" or not a.startswith("-"):  # the program and its arguments follow
            break
        for n in names:
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
            if a == n and i + 1 < len(args):
                return args[i + 1]
    return None


def stop_watch(args: list[str]) -> "StopWatch | None":
    """SIGINT and SIGTERM handled as ``subnetdp train launch.nproc=N`` handles them
    (:class:`~subnetdp.launchers.local.StopWatch`: the wait said aloud, a second signal passed on and
    waited for), unless the command line or ``PET_SIGNALS_TO_HANDLE`` chooses the agent's signals."""
    from subnetdp.launchers.local import StopWatch

    if _option(args, "--signals-to-handle", "--signals_to_handle") is not None or SIGNALS_ENV in os.environ:
        return None
    os.environ[SIGNALS_ENV] = "SIGHUP,SIGQUIT"  # the agent's default for the others; these two are the watch's
    nproc = _option(args, "--nproc-per-node", "--nproc_per_node")
    timeout = _option(args, "--shutdown-timeout", "--shutdown_timeout") or os.environ.get(SHUTDOWN_ENV, "30")
    return StopWatch(float(timeout), int(nproc) if nproc and nproc.isdigit() else None, key="torchrun --shutdown-timeout")


def main(argv: list[str] | None = None) -> int:
    from subnetdp.launchers.lifetime import PARENT_ENV

    os.environ.setdefault(SHARE_STORE_ENV, "1")
    os.environ[PARENT_ENV] = str(os.getpid())  # the workers' parent: they die with this agent
    quiet_native_warnings()  # before torch's first import below
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun

    args = sys.argv[1:] if argv is None else list(argv)
    route_agent_logs(args)  # after torch's imports, which set up its logging
    watch = stop_watch(args)
    try:
        with watch if watch is not None else contextlib.nullcontext():
            torchrun(argv)
    except SignalException as e:
        name = signal.Signals(int(e.sigval)).name
        if watch is not None and watch.gave_up():
            print(f"torchrun: {watch.verdict()}", file=sys.stderr, flush=True)
        elif watch is not None and watch.second:
            print(f"torchrun: stopped by a second {signal.Signals(watch.second).name}: the workers aborted at once, "
                  "without a checkpoint (resume=auto continues from the run's newest checkpoint)",
                  file=sys.stderr, flush=True)
        else:
            print(f"torchrun: stopped by {name}: the workers were passed the signal and stopped at a step boundary "
                  "(the run's newest checkpoint holds that step)", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        print(f"torchrun: no restart is left (--max-restarts): {describe_failures(e.failures)}", file=sys.stderr,
              flush=True)
        return 1
    except (RendezvousError, DistError) as e:
        print(f"torchrun: the rendezvous failed ({type(e).__name__}: {_first_line(e)}): the agent that hosts "
              "the rendezvous endpoint is gone or unreachable, or the nodes did not gather in time",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
