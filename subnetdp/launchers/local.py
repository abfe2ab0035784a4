"""Start N local workers through torch's elastic launcher (what ``torchrun --standalone`` does)."""

from __future__ import annotations

import os
import sys
import uuid
from typing import Sequence

from subnetdp.core.errors import SubnetdpError


def launch_local(nproc: int, argv: Sequence[str], max_restarts: int = 0) -> int:
    """Run ``python -m subnetdp <argv>`` in ``nproc`` local workers; return 0 when all succeed.

    The rendezvous binds a free port on localhost (no fixed port), as ``torchrun --standalone``.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_configs={"rank": 0},
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "subnetdp", *argv)
    except ChildFailedError as e:
        failures = "; ".join(f"rank {r}: exit code {f.exitcode}" for r, f in sorted(e.failures.items()))
        raise SubnetdpError(f"a worker failed ({failures}); its error is printed above") from None
    return 0
