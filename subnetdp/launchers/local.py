"""Start N local workers through torch's elastic launcher (what ``torchrun --standalone`` does)."""

from __future__ import annotations

import os
import sys
import uuid
from typing import Sequence

from subnetdp.core.errors import SubnetdpError

SHUTDOWN_TIMEOUT_S = 120  # after a signal: time for the workers to finish the step and checkpoint it


def launch_local(nproc: int, argv: Sequence[str], max_restarts: int = 0) -> int:
    """Run ``python -m subnetdp <argv>`` in ``nproc`` local workers; return 0 when all succeed.

    The rendezvous binds a free port on localhost (no fixed port), as ``torchrun --standalone``.
    Each worker runs in a session of its own and dies with this process
    (:mod:`subnetdp.launchers.lifetime`). SIGINT or SIGTERM here is passed on once to every
    worker, which stops at the next step boundary with a checkpoint; the workers get
    ``SHUTDOWN_TIMEOUT_S`` for that before they are killed. Returns 128 + the signal then.
    """
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from subnetdp.launchers.lifetime import PARENT_ENV

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_configs={"rank": 0},
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[PARENT_ENV] = str(os.getpid())  # a worker whose launcher is already gone exits at once
    # The workers say what a signal did; the elastic agent's own warnings about it would repeat it.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "subnetdp", *argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        failures = "; ".join(f"rank {r}: exit code {f.exitcode}" for r, f in sorted(e.failures.items()))
        raise SubnetdpError(f"a worker failed ({failures}); its error is printed above") from None
    return 0
