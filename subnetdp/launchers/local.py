"""Start N local workers through torch's elastic launcher (what ``torchrun --standalone`` does).

After SIGINT or SIGTERM the launcher passes the signal to every worker, which stops at the next step
boundary with a checkpoint, and waits ``launch.stop_timeout_s`` for them before it kills them. A
worker that cannot reach the boundary (stopped with SIGSTOP, hung in a device, waiting in a
collective for such a peer) would make that wait silent; :class:`StopWatch` says, while it lasts,
which workers are still running and in what state, and, when the launcher gives up, which ones it
killed and why they did not stop.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from subnetdp.core.errors import SubnetdpError
from subnetdp.launchers.failures import describe_failures
from subnetdp.launchers.signals import Handlers

SHUTDOWN_TIMEOUT_S = 120  # after a signal: time for the workers to finish the step and checkpoint it
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SECOND_SIGNAL_WAIT_S = 2.0  # after a second signal: how long the workers get to abort on it (they exit at once)
# What a worker's process state (/proc/PID/stat) tells about why it has not stopped.
_STATES = {
    "T": "stopped (state T: SIGSTOP, SIGTSTP or a debugger), so it cannot reach the step boundary",
    "t": "stopped by a debugger (state t), so it cannot reach the step boundary",
    "D": "in uninterruptible sleep (state D: a hung device, driver or file system)",
    "S": "waiting (state S), most likely in a collective for a rank that does not answer",
    "R": "running (state R): its step or checkpoint takes longer",
}


def _say(text: str) -> None:
    # os.write: also safe from a signal handler and from the watching thread.
    os.write(sys.stderr.fileno(), f"subnetdp: {text}\n".encode())


def worker_states(parent: int) -> dict[int, tuple[int, str]]:
    """Rank -> (pid, process state letter) of the live workers ``parent`` started (Linux; else empty)."""
    found: dict[int, tuple[int, str]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent or fields[0] in ("Z", "X"):
                continue
            env = dict(item.split("=", 1) for item in (d / "environ").read_text(errors="replace").split("\0")
                       if "=" in item)
        except (OSError, IndexError, ValueError):
            continue
        if env.get("RANK", "").isdigit():
            found[int(env["RANK"])] = (int(d.name), fields[0])
    return found


def describe(states: dict[int, tuple[int, str]]) -> str:
    """``rank 1 (pid 123) is stopped (...); rank 0 (pid 122) is waiting (...)``: stopped ones first."""
    order = sorted(states, key=lambda r: ("TtDSR".find(states[r][1]) % 6, r))
    return "; ".join(f"rank {r} (pid {states[r][0]}) is {_STATES.get(states[r][1], f'in state {states[r][1]}')}"
                     for r in order)


class StopWatch:
    """The launcher's own handling of SIGINT/SIGTERM: what torch's elastic agent does, said aloud.

    Installed instead of the agent's handler (``TORCHELASTIC_SIGNALS_TO_HANDLE`` leaves SIGINT and
    SIGTERM to it), it raises the agent's ``SignalException`` as the agent's own handler does, so the
    agent passes the signal on and waits ``timeout_s``. Meanwhile a thread reports the workers that
    are still running; :meth:`gave_up` tells whether the wait ran out, and :meth:`verdict` the line
    that says so.
    """

    def __init__(self, timeout_s: float, nproc: int | None, key: str = "launch.stop_timeout_s") -> None:
        self.timeout_s, self.nproc, self.key = float(timeout_s), nproc, key  # key: what sets the wait
        self.signum = 0
        self.second = 0  # the second signal, when one came (the workers then abort without a checkpoint)
        self.started = 0.0
        self.last: dict[int, tuple[int, str]] = {}
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._handlers = Handlers(_STOP_SIGNALS, self._handle)

    def __enter__(self) -> "StopWatch":
        self._handlers.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(5)
        self._handlers.__exit__(*exc)

    def _handle(self, signum: int, frame: Any) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if not self.signum:
            self.signum, self.started = signum, time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="subnetdp-stop-watch", daemon=True)
            self._thread.start()
        else:
            self.second = signum
            # The agent ends its interrupted wait with SIGTERM to the workers. Passed on first, the
            # signal reaches them before it, but a worker may still act on the SIGTERM first (a signal
            # delivered to one of its other threads waits for the main thread), and would report the
            # person's second Ctrl-C as SIGTERM. So wait, briefly, for them to abort on this one.
            workers = worker_states(os.getpid())
            for pid, _ in workers.values():
                try:
                    os.kill(pid, signum)
                except OSError:  # already gone
                    pass
            deadline = time.monotonic() + SECOND_SIGNAL_WAIT_S
            while workers and time.monotonic() < deadline:
                time.sleep(0.02)
                workers = worker_states(os.getpid())  # exited ones are zombies until reaped: not listed
        sig = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)

    def _watch(self) -> None:
        """Report the workers still running: first after a few seconds, then every 30 s."""
        first = min(10.0, self.timeout_s / 3)
        next_report = self.started + first
        while not self._done.wait(0.5):
            states = worker_states(os.getpid())
            if states:
                self.last = states
            now = time.monotonic()
            if now >= next_report and states:
                left = max(0.0, self.timeout_s - (now - self.started))
                of = f" of {self.nproc}" if self.nproc else ""
                _say(f"{signal.Signals(self.signum).name} {now - self.started:.0f} s ago: waiting for {len(states)}{of} "
                     f"workers to finish their step and checkpoint: {describe(states)}; they are killed "
                     f"in {left:.0f} s ({self.key}={self.timeout_s:g}; a second signal stops them at once)")
                next_report = now + 30.0

    def gave_up(self) -> bool:
        return bool(self.signum) and time.monotonic() - self.started >= self.timeout_s

    def verdict(self) -> str:
        """The one line for a wait that ran out: who was killed and why they had not stopped."""
        who = describe(self.last) if self.last else "the workers still running"
        return (f"gave up waiting {self.timeout_s:g} s ({self.key}) after {signal.Signals(self.signum).name} "
                f"for the workers to stop at a step boundary: {who}; killed them (SIGKILL): this step was not "
                "saved, the run's newest checkpoint is where resume=auto continues")


def launch_local(nproc: int, argv: Sequence[str], max_restarts: int = 0,
                 stop_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> int:
    """Run ``python -m subnetdp <argv>`` in ``nproc`` local workers; return 0 when all succeed.

    The rendezvous binds a free port on localhost (no fixed port), as ``torchrun --standalone``.
    Each worker runs in a session of its own and dies with this process
    (:mod:`subnetdp.launchers.lifetime`). SIGINT or SIGTERM here is passed on once to every
    worker, which stops at the next step boundary with a checkpoint; the workers get
    ``stop_timeout_s`` for that before they are killed (:class:`StopWatch` says what the wait is
    for). Returns 128 + the signal then.
    """
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from subnetdp.launchers.lifetime import PARENT_ENV

    # SIGINT and SIGTERM are the StopWatch's; the agent keeps its handlers of the others. The agent
    # installs its handlers after the StopWatch's, so it must be told to leave these two alone (torch
    # releases without signals_to_handle install all four: the wait is then a silent one).
    signals = ({"signals_to_handle": "SIGHUP,SIGQUIT"}
               if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)} else {})
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_configs={"rank": 0},
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
        shutdown_timeout=max(1, int(round(stop_timeout_s))), **signals,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[PARENT_ENV] = str(os.getpid())  # a worker whose launcher is already gone exits at once
    # The workers say what a signal did; the elastic agent's own warnings about it would repeat it,
    # and so would its error line about each failed worker (the line below names them).
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    with StopWatch(stop_timeout_s, nproc) as watch:
        try:
            elastic_launch(config, entrypoint=sys.executable)("-m", "subnetdp", *argv)
        except SignalException as e:
            if watch.gave_up():
                _say(watch.verdict())
            return 128 + int(e.sigval)
        except ChildFailedError as e:
            raise SubnetdpError(describe_failures(e.failures)) from None
    return 0
