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
from typing import Any, Mapping, Sequence

import torch.distributed as dist

#: + /<rank>: a reaped worker. Read by ``plugins/comm/regroup.py`` (the same literal: a plugin
#: imports only the public API), so the survivors need not wait out a timeout for a dead process.
DEAD_KEY = "subnetdp/dead"


def host_store(timeout_s: float, host: str = "127.0.0.1", port: int = 0) -> Any:
    """The job's ``TCPStore``, served from this process (port 0: a free one, ``store.port``)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _exitcode(proc: Any) -> int | None:
    """A ``subprocess.Popen``'s or a ``multiprocessing.Process``'s exit code, None while it runs."""
    return proc.poll() if hasattr(proc, "poll") else proc.exitcode


def supervise(store: Any, workers: Mapping[int, Any], timeout_s: float, poll_s: float = 0.02) -> dict[int, int | None]:
    """Watch ``workers`` (rank -> process) until all ended or ``timeout_s``; return their exit codes.

    A worker that ends with a non-zero code is marked dead in the store at once and nobody else is
    touched: the survivors re-form among themselves. A running worker the survivors marked (left out
    of their agreement: it stalled) is killed. Workers still running at the timeout are left
    to the caller (it decides whether to kill them).
    """
    marked: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = {r: _exitcode(p) for r, p in workers.items()}
        for r, code in codes.items():
            if code not in (None, 0) and r not in marked:
                store.set(f"{DEAD_KEY}/{r}", f"exit {code}")
                marked.add(r)
            elif code is None and r not in marked and store.check([f"{DEAD_KEY}/{r}"]):
                # The survivors went on without it (it stalled past the agreement): stop it for good,
                # so it cannot write into their run or hold the job open.
                workers[r].kill()
                marked.add(r)
        if all(c is not None for c in codes.values()):
            return codes
        time.sleep(poll_s)
    return {r: _exitcode(p) for r, p in workers.items()}


#: Set in every worker the supervisor starts (read by ``plugins/comm/torch_dist.py``, the same literal).
SUPERVISED_ENV = "SUBNETDP_SUPERVISED"


def launch_supervised(nproc: int, argv: Sequence[str], timeout_s: float = 600.0) -> int:
    """``launch.on_failure=continue``: run ``python -m subnetdp <argv>`` in ``nproc`` workers under this process.

    This process hosts the job's store (the workers reach it as torchrun's workers reach the
    agent's: ``TORCHELASTIC_USE_AGENT_STORE``), marks a worker that dies, and restarts nobody, so
    the survivors can go on in-process (docs/inprocess.md). Returns 0 when every worker that was
    not reaped dead ended well, else the first non-zero exit code.
    """
    from subnetdp.launchers.lifetime import PARENT_ENV

    store = host_store(timeout_s)
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            SUPERVISED_ENV: "1", PARENT_ENV: str(os.getpid())}
    base.setdefault("OMP_NUM_THREADS", "1")
    workers = {r: subprocess.Popen([sys.executable, "-m", "subnetdp", *argv],
                                   env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, start_new_session=True)
               for r in range(nproc)}

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
        codes = supervise(store, workers, float("inf"))
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
