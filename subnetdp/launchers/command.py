"""``subnetdp launch``: start a recipe under torchrun, mpirun or srun, printing the exact command.

The command runs the same Python as the caller (``sys.executable``), so workers import the same
``subnetdp`` and plugins. ``mpirun`` is the one installed beside that Python (the ``mpich`` wheel
puts it in the virtual environment's ``bin``): an MPI program started by another MPI's ``mpirun``
crashes, so a different one must be named explicitly with ``--mpirun``.

A job over several nodes (:class:`~subnetdp.launchers.nodes.Nodes`) runs one torchrun agent per
node; ``subnetdp launch`` prints the command of every node and runs this node's.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Sequence

from subnetdp.core.errors import ConfigError, SubnetdpError
from subnetdp.launchers.kinds import LAUNCHERS as KINDS, launcher_named
from subnetdp.launchers.lifetime import run_child_launcher
from subnetdp.launchers.nodes import Nodes

LAUNCHERS = tuple(KINDS)


def venv_mpirun() -> Path:
    """The ``mpirun`` beside ``sys.executable`` (the one of the MPI mpi4py was built against)."""
    return Path(sys.executable).parent / "mpirun"


def launch_command(launcher: str, nproc: int, train_args: Sequence[str], mpirun: str | None = None,
                   extra: Sequence[str] = (), nodes: Nodes = Nodes(), node_rank: int | None = None) -> list[str]:
    """The argv that starts ``nproc`` workers of ``subnetdp train <train_args>`` on this node.

    Args:
        launcher: ``torchrun``, ``mpirun`` or ``srun``.
        nproc: number of processes (per node).
        train_args: the recipe and ``key=value`` overrides.
        mpirun: path of the ``mpirun`` to use (default: the one beside ``sys.executable``).
        extra: launcher options put before the program (e.g. ``--oversubscribe`` for Open MPI).
        nodes: the nodes of the job (default: this one alone).
        node_rank: the node whose command this is (default: ``nodes.node_rank``).
    """
    launcher_named(launcher)
    if nproc < 1:
        raise ConfigError("--nproc", nproc, "must be >= 1")
    if launcher == "torchrun":
        # torchrun itself (torch.distributed.run), without relying on the script being on PATH, ending
        # on a signal or a failure with one line instead of a traceback (launchers/torchrun.py).
        if nodes.several:
            rank = nodes.node_rank if node_rank is None else node_rank
            conf = nodes.conf_for(rank)
            where = [f"--nnodes={nodes.spec}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={nodes.endpoint}", f"--rdzv-id={nodes.run_id}",
                     *([f"--rdzv-conf={conf}"] if conf else [])]
        else:
            where = ["--standalone", f"--nproc-per-node={nproc}"]
        restarts = [f"--max-restarts={nodes.max_restarts}"] if nodes.max_restarts else []
        return [sys.executable, "-m", "subnetdp.launchers.torchrun", *where, *restarts, *extra,
                "-m", "subnetdp", "train", *train_args]
    program = [sys.executable, "-m", "subnetdp", "train", *train_args]
    if launcher == "mpirun":
        exe = Path(mpirun) if mpirun else venv_mpirun()
        if not exe.exists() and shutil.which(str(exe)) is None:
            raise ConfigError("--launcher", "mpirun", f"{exe} does not exist",
                              "pip install 'subnetdp[mpi]' (the mpich wheel puts mpirun beside python), "
                              "or pass --mpirun PATH")
        return [str(exe), "-n", str(nproc), *extra, *program]
    exe = shutil.which("srun") or "srun"
    if nodes.several:
        return [exe, f"--nodes={nodes.max_nodes}", f"--ntasks={nodes.max_nodes * nproc}",
                f"--ntasks-per-node={nproc}", *extra, *program]
    return [exe, f"--ntasks={nproc}", *extra, *program]


def node_lines(launcher: str, nproc: int, train_args: Sequence[str], extra: Sequence[str], nodes: Nodes) -> list[str]:
    """What the nodes of a torchrun job over several nodes run: a comment line, then the command, per kind of node."""
    if nodes.node_rank is None:
        return [f"# on each of the {nodes.spec} nodes (start the one of {nodes.endpoint} first: its agent hosts the "
                "rendezvous):", shlex.join(launch_command(launcher, nproc, train_args, None, extra, nodes))]
    others = "node 1" if nodes.max_nodes == 2 else f"nodes 1-{nodes.max_nodes - 1}"
    return [f"# node 0, the host of {nodes.endpoint} (start it first):",
            shlex.join(launch_command(launcher, nproc, train_args, None, extra, nodes, 0)),
            f"# {others}:", shlex.join(launch_command(launcher, nproc, train_args, None, extra, nodes, 1))]


def run_launch(launcher: str, nproc: int, train_args: Sequence[str], mpirun: str | None = None,
               extra: Sequence[str] = (), dry_run: bool = False, nodes: Nodes = Nodes()) -> int:
    """Print the command (and, over several torchrun nodes, every node's), then run it unless ``dry_run``."""
    cmd = launch_command(launcher, nproc, train_args, mpirun, extra, nodes)
    if nodes.several and launcher == "torchrun":
        print("\n".join(node_lines(launcher, nproc, train_args, extra, nodes)), flush=True)
    else:
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
