"""A supervisor for in-process continuation: it hosts the job's store and reaps, never restarts.

torchrun's agent answers a worker's death by stopping every worker and starting them again. For
the survivors to go on in-process (docs/inprocess.md) the process that hosts the store must
outlive every worker and leave the survivors running: this one does, and tells them whom it reaped.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Mapping

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
    touched: the survivors re-form among themselves. Workers still running at the timeout are left
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
        if all(c is not None for c in codes.values()):
            return codes
        time.sleep(poll_s)
    return {r: _exitcode(p) for r, p in workers.items()}
