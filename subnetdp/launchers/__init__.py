"""Where a process sits (rank, world size) and how local workers are started.

:func:`detect` reads the environment a launcher leaves behind:

- ``torchrun`` (and ``subnetdp train launch.nproc=N``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``;
- ``mpirun`` of Open MPI: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
- ``mpirun`` / ``mpiexec`` of MPICH (Hydra): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
  ``MPI_LOCALNRANKS``;
- SLURM ``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (or ``SLURM_NTASKS``), ``SLURM_LOCALID``,
  ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_NODEID``. Only inside a job step (``SLURM_STEP_ID`` set): a
  batch script itself is one process, whatever ``SLURM_NTASKS`` says.

The first family found wins, in that order, so ``torchrun`` started inside an ``srun`` step reads
torchrun's ranks. The ``MASTER_ADDR`` / ``MASTER_PORT`` that mpirun and srun do not set are the
communicators' business (``subnetdp.plugins.comm._rendezvous``): a launcher only says which process is which.

Only this package, ``subnetdp.plugins.comm`` and ``subnetdp.parallel`` import ``torch.distributed``
or ``mpi4py``.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import SubnetdpError

# launcher -> (rank, world size, local rank, local world size) variables
FAMILIES: dict[str, tuple[str, str, str, str]] = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "mpirun": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpirun:mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise SubnetdpError(f"environment variable {name}={value!r} is not an integer: "
                            "the launcher's environment is inconsistent") from None


def _checked(launcher: str, names: tuple[str, str, str, str], rank: int, world: int, local_rank: int,
             local_world: int) -> LaunchEnv:
    r, w, lr, lw = names
    if world < 1:
        raise SubnetdpError(f"{w}={world}: a world needs at least one process ({launcher} launch)")
    if not 0 <= rank < world:
        raise SubnetdpError(f"{r}={rank} is outside {w}={world}: the {launcher} environment is inconsistent")
    if not 0 <= local_rank < local_world or local_world > world:
        raise SubnetdpError(f"{lr}={local_rank} with {lw}={local_world} does not fit {w}={world}: "
                            f"the {launcher} environment is inconsistent")
    return LaunchEnv(rank, world, local_rank, local_world, launcher.split(":")[0])


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from SLURM's compressed list, e.g. ``"2(x3),1"`` -> 2, 2, 2, 1."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise SubnetdpError(f"cannot read SLURM's task list {tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise SubnetdpError(f"SLURM_NODEID={node_id} is outside the task list {tasks_per_node!r}")
    return counts[node_id]


def _slurm(env: Mapping[str, str]) -> LaunchEnv:
    world_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if world_var not in env:
        raise SubnetdpError("srun set SLURM_PROCID but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS: "
                            "the srun environment is inconsistent")
    rank, world = _int(env, "SLURM_PROCID"), _int(env, world_var)
    local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node and "SLURM_NODEID" in env:
        local_world = slurm_tasks_on_node(per_node, _int(env, "SLURM_NODEID"))
    else:
        local_world = world
    names = ("SLURM_PROCID", world_var, "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE")
    return _checked("srun", names, rank, world, local_rank, local_world)


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Rank and world size from torchrun, mpirun (Open MPI, MPICH) or srun; one process when none."""
    env = os.environ if environ is None else environ
    for launcher, names in FAMILIES.items():
        r, w, lr, lw = names
        if r in env and w in env:
            rank, world = _int(env, r), _int(env, w)
            local_rank = _int(env, lr) if lr in env else 0
            local_world = _int(env, lw) if lw in env else world
            return _checked(launcher, names, rank, world, local_rank, local_world)
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return _slurm(env)
    return LaunchEnv()
