"""``subnetdp launch``: start a recipe under torchrun, mpirun or srun, printing the exact command.

The command runs the same Python as the caller (``sys.executable``), so workers import the same
``subnetdp`` and plugins. ``mpirun`` is the one installed beside that Python (the ``mpich`` wheel
puts it in the virtual environment's ``bin``): an MPI program started by another MPI's ``mpirun``
crashes, so a different one must be named explicitly with ``--mpirun``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Sequence

from subnetdp.core.errors import ConfigError, SubnetdpError
from subnetdp.launchers.lifetime import run_child_launcher

LAUNCHERS = ("torchrun", "mpirun", "srun")


def venv_mpirun() -> Path:
    """The ``mpirun`` beside ``sys.executable`` (the one of the MPI mpi4py was built against)."""
    return Path(sys.executable).parent / "mpirun"


def launch_command(launcher: str, nproc: int, train_args: Sequence[str], mpirun: str | None = None,
                   extra: Sequence[str] = ()) -> list[str]:
    """The argv that starts ``nproc`` workers of ``subnetdp train <train_args>`` on this node.

    Args:
        launcher: ``torchrun``, ``mpirun`` or ``srun``.
        nproc: number of processes.
        train_args: the recipe and ``key=value`` overrides.
        mpirun: path of the ``mpirun`` to use (default: the one beside ``sys.executable``).
        extra: launcher options put before the program (e.g. ``--oversubscribe`` for Open MPI).
    """
    if launcher not in LAUNCHERS:
        raise ConfigError("--launcher", launcher, f"valid choices: {', '.join(LAUNCHERS)}")
    if nproc < 1:
        raise ConfigError("--nproc", nproc, "must be >= 1")
    if launcher == "torchrun":
        # torchrun itself (torch.distributed.run), without relying on the script being on PATH, ending
        # on a signal with one line instead of a traceback (launchers/torchrun.py).
        return [sys.executable, "-m", "subnetdp.launchers.torchrun", "--standalone", f"--nproc-per-node={nproc}",
                *extra, "-m", "subnetdp", "train", *train_args]
    program = [sys.executable, "-m", "subnetdp", "train", *train_args]
    if launcher == "mpirun":
        exe = Path(mpirun) if mpirun else venv_mpirun()
        if not exe.exists() and shutil.which(str(exe)) is None:
            raise ConfigError("--launcher", "mpirun", f"{exe} does not exist",
                              "pip install 'subnetdp[mpi]' (the mpich wheel puts mpirun beside python), "
                              "or pass --mpirun PATH")
        return [str(exe), "-n", str(nproc), *extra, *program]
    exe = shutil.which("srun") or "srun"
    return [exe, f"--ntasks={nproc}", *extra, *program]


def run_launch(launcher: str, nproc: int, train_args: Sequence[str], mpirun: str | None = None,
               extra: Sequence[str] = (), dry_run: bool = False) -> int:
    """Print the command, then run it (unless ``dry_run``); return its exit status."""
    cmd = launch_command(launcher, nproc, train_args, mpirun, extra)
    print(shlex.join(cmd), flush=True)
    if dry_run:
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # the framework sets torch's own thread count per rank
    try:
        # The launcher dies with this process; its workers die with it (lifetime.py).
        return run_child_launcher(cmd, env)
    except FileNotFoundError as e:
        raise SubnetdpError(f"cannot start {cmd[0]}: {e}") from None
