"""How the communicators find their peers: mpi4py on demand, and ``MASTER_ADDR`` / ``MASTER_PORT``
for ``torch.distributed``'s ``env://`` where the launcher left them unset.

torchrun sets both itself. Under mpirun, rank 0 picks a free port and its address and broadcasts
both over MPI (mpi4py); under srun, every rank derives the same values from the job. Only the
communicators need this, so it lives beside them (``plugins/comm`` may import ``torch.distributed``
and ``mpi4py``); the launchers only read which process is which (:func:`subnetdp.launchers.detect`).
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any, Callable

from subnetdp import ConfigError, LaunchEnv, SubnetdpError


def import_mpi(key: str = "comm.name", value: str = "mpi",
               alternative: str = "or use comm.name=gloo under torchrun") -> Any:
    """``mpi4py.MPI`` (initialising MPI), or a :class:`ConfigError` saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ConfigError(key, value, f"needs mpi4py and an MPI library, which do not import here ({e})",
                          f"pip install 'subnetdp[mpi]' (mpi4py and the mpich wheel), {alternative}") from None
    except RuntimeError as e:  # mpi4py found no usable libmpi
        raise ConfigError(key, value, f"mpi4py cannot load an MPI library: {e}",
                          "pip install mpich (or point mpi4py at your MPI), or use comm.name=gloo") from None
    return MPI


def broadcast_from_rank0(make: Callable[[], Any]) -> Any:
    """``make()`` evaluated on rank 0 of ``MPI.COMM_WORLD`` and broadcast to every rank.

    Collective over ``MPI.COMM_WORLD``: every rank calls it.
    """
    MPI = import_mpi("launcher", "mpirun", "or set MASTER_ADDR and MASTER_PORT for every rank yourself")
    world = MPI.COMM_WORLD
    value = make() if world.Get_rank() == 0 else None
    # collective: every rank reaches this.
    return world.bcast(value, root=0)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[003-004,010],cpu1"`` -> ``"gpu003"``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise SubnetdpError(f"cannot read SLURM's node list {nodelist!r}: set MASTER_ADDR yourself")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; no fixed ports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def rendezvous(env: LaunchEnv) -> None:
    """Set ``MASTER_ADDR`` / ``MASTER_PORT`` for ``torch.distributed`` ``env://`` when unset.

    torchrun sets them itself. Under mpirun, rank 0 picks a free port and its address and
    broadcasts both over MPI (mpi4py). Under srun, every rank derives the same values from the job:
    the first host of the step's node list and a port from the job id.
    """
    if env.world_size == 1 or ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        return
    if env.launcher == "mpirun":
        def mine() -> tuple[str, str]:
            host = "127.0.0.1" if env.local_world_size == env.world_size else socket.gethostname()
            return os.environ.get("MASTER_ADDR", host), os.environ.get("MASTER_PORT", str(free_port()))

        # collective: every rank reaches this; rank 0's address and port win.
        addr, port = broadcast_from_rank0(mine)
    elif env.launcher == "srun":
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        addr = os.environ.get("MASTER_ADDR", first_slurm_host(nodes))
        port = os.environ.get("MASTER_PORT", str(15000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))
    else:
        raise SubnetdpError(f"MASTER_ADDR and MASTER_PORT are not set for a {env.world_size}-process "
                            f"{env.launcher} launch: set both (torchrun does) or use comm.init_method")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, port
