"""A supervisor for in-process continuation: it hosts the job's store and reaps, never restarts.

torchrun's agent answers a worker's death by stopping every worker and starting them again. For
the survivors to go on in-process (docs/inprocess.md) the process that hosts the store must
outlive every worker and leave the survivors running: this one does, and tells them whom it reaped.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import torch.distributed as dist

#: + /<rank>: a reaped worker. Read by ``plugins/comm/regroup.py`` (the same literal: a plugin
#: imports only the public API), so the survivors need not wait out a timeout for a dead process.
DEAD_KEY = "subnetdp/dead"
#: + /closed: the job ended, a replacement still waiting to join leaves (``plugins/comm/regroup.py``, the same literal).
JOIN_KEY = "subnetdp/join"
#: A replacement's worker id (``plugins/comm/torch_dist.py``, the same literal): ids are never reused, so a
#: replacement's store keys (its death mark) are its own, not the dead worker's it replaces.
JOIN_ENV = "SUBNETDP_JOIN_ID"


def host_store(timeout_s: float, host: str = "127.0.0.1", port: int = 0) -> Any:
    """The job's ``TCPStore``, served from this process (port 0: a free one, ``store.port``)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _exitcode(proc: Any) -> int | None:
    """A ``subprocess.Popen``'s or a ``multiprocessing.Process``'s exit code, None while it runs."""
    return proc.poll() if hasattr(proc, "poll") else proc.exitcode


def supervise(store: Any, workers: dict[int, Any], timeout_s: float, poll_s: float = 0.02,
              replace: Callable[[int], tuple[int, Any] | None] | None = None) -> dict[int, int | None]:
    """Watch ``workers`` (worker id -> process) until all ended or ``timeout_s``; return their exit codes.

    A worker that ends with a non-zero code is marked dead in the store at once and nobody else is
    touched: the survivors re-form among themselves. ``replace(id)``, when given, may start a
    replacement for it (returns its new id and process, added to ``workers``; it joins the survivors
    at a step boundary: docs/inprocess.md). A running worker the survivors marked (left out of their
    agreement: it stalled) is killed. When every worker but the replacements has ended, a replacement
    still waiting to join is told the job closed. Workers still running at the timeout are left to
    the caller (it decides whether to kill them).
    """
    marked: set[int] = set()
    spares: set[int] = set()
    closed = False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = {r: _exitcode(p) for r, p in workers.items()}
        for r, code in codes.items():
            if code not in (None, 0) and r not in marked:
                store.set(f"{DEAD_KEY}/{r}", f"exit {code}")
                marked.add(r)
                new = replace(r) if replace is not None else None
                if new is not None:
                    workers[new[0]] = new[1]
                    spares.add(new[0])
            elif code is None and r not in marked and store.check([f"{DEAD_KEY}/{r}"]):
                # The survivors went on without it (it stalled past the agreement): stop it for good,
                # so it cannot write into their run or hold the job open.
                workers[r].kill()
                marked.add(r)
        if spares and not closed and all(c is not None for r, c in codes.items() if r not in spares):
            store.set(f"{JOIN_KEY}/closed", "the job ended")  # a replacement still waiting leaves
            closed = True
        if all(c is not None for c in codes.values()) and len(codes) == len(workers):
            # A replacement that never joined left because the job ended (one line): no failure of the job.
            return {r: 0 if r in spares and not store.check([f"{JOIN_KEY}/{r}/decided"]) else c for r, c in codes.items()}
        time.sleep(poll_s)
    return {r: _exitcode(p) for r, p in workers.items()}


#: Set in every worker the supervisor starts (read by ``plugins/comm/torch_dist.py``, the same literal).
SUPERVISED_ENV = "SUBNETDP_SUPERVISED"


def launch_supervised(nproc: int, argv: Sequence[str], timeout_s: float = 600.0, replacements: int = 0) -> int:
    """``launch.on_failure=continue``: run ``python -m subnetdp <argv>`` in ``nproc`` workers under this process.

    This process hosts the job's store (the workers reach it as torchrun's workers reach the
    agent's: ``TORCHELASTIC_USE_AGENT_STORE``), marks a worker that dies, and restarts nobody, so
    the survivors can go on in-process (docs/inprocess.md). Returns 0 when every worker that was
    not reaped dead ended well, else the first non-zero exit code. ``replacements``: how many dead
    workers in all are replaced by a fresh worker that joins the survivors (``launch.replace``).
    """
    from subnetdp.launchers.lifetime import PARENT_ENV

    store = host_store(timeout_s)
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            SUPERVISED_ENV: "1", PARENT_ENV: str(os.getpid())}
    base.setdefault("OMP_NUM_THREADS", "1")
    def start(rank: int, extra: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "subnetdp", *argv],
                                env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank), **extra}, start_new_session=True)

    workers: dict[int, Any] = {r: start(r, {}) for r in range(nproc)}
    slot = {r: r for r in range(nproc)}  # worker id -> the rank it holds at W
    left = [int(replacements)]

    def replace(dead: int) -> tuple[int, Any] | None:
        if left[0] <= 0:
            return None
        left[0] -= 1
        new = max(slot) + 1
        slot[new] = slot[dead]
        print(f"subnetdp supervisor: worker {dead} (rank {slot[dead]}) died; starting a replacement "
              f"({left[0]} more left) that joins the survivors at a step boundary", flush=True)
        return new, start(slot[new], {JOIN_ENV: str(new)})

    def pass_on(signum: int, _frame: Any) -> None:
        # A stop (SIGINT, SIGTERM) is the workers' to honour: they checkpoint at the next step boundary.
        # A second one kills them at once, as the local launcher does.
        for p in workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL if signalled else signum)
        signalled.append(signum)

    signalled: list[int] = []
    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = supervise(store, workers, float("inf"), replace=replace)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in workers.values():  # an interrupted supervisor leaves no worker behind
            if p.poll() is None:
                p.kill()
                p.wait()
    survivors = [c for c in codes.values() if c is not None and c >= 0]  # a signal's death is the reaped one's
    bad = [c for c in survivors if c != 0]
    if len(survivors) == len(codes) and not bad:
        return 0
    return bad[0] if bad else (0 if survivors else 1)
