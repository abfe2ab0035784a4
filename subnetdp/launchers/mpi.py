"""mpi4py, imported on demand with a clear error, and the one collective launchers need from it."""

from __future__ import annotations

from typing import Any, Callable

from subnetdp.core.errors import ConfigError


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
