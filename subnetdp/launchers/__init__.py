"""Where a process sits (rank, world size) and how local workers are started.

Only this package, ``subnetdp.plugins.comm`` and ``subnetdp.parallel`` import ``torch.distributed``.
"""

from __future__ import annotations

import os

from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import SubnetdpError


def _int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise SubnetdpError(f"environment variable {name}={value!r} is not an integer") from None


def detect() -> LaunchEnv:
    """Read rank and world size from a torchrun launch, or a single process when there is none."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int("RANK"), _int("WORLD_SIZE")
        local_rank = _int("LOCAL_RANK") if "LOCAL_RANK" in env else 0
        local_world = _int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        if not 0 <= rank < world:
            raise SubnetdpError(f"RANK={rank} is outside WORLD_SIZE={world}: the launcher's environment is inconsistent")
        return LaunchEnv(rank, world, local_rank, local_world, "torchrun")
    return LaunchEnv()
