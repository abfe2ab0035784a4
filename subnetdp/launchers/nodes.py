"""A job over several nodes: one torchrun agent per node, meeting at a c10d rendezvous endpoint.

The job's shape is config (``launch.nodes``, ``launch.min_nodes``, ``launch.max_restarts``,
``launch.rdzv_endpoint``, ``launch.rdzv_id``, ``launch.rdzv_conf``); ``subnetdp launch`` also takes
torchrun's own option names (``--nnodes MIN:MAX``, ...) and writes them into those keys. The agent
of the node whose address is the endpoint hosts the rendezvous store, so that node starts first and
stays up (on one machine: the agent that binds the port first).

``launch.min_nodes < launch.nodes`` makes the job elastic: a node that leaves (its agent and workers
die) fails the survivors' collectives, and their agents restart the worker group at the smaller world
(``--max-restarts`` counts it); a node that joins makes every agent stop its workers with SIGTERM,
which they obey at the next step boundary with a checkpoint (:mod:`subnetdp.train.stopping`), and
restart them at the larger world (not counted). Either way ``resume=auto`` continues from the newest
checkpoint on the new plan, which is why an elastic or restartable job needs it.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import Any

from subnetdp.core.errors import ConfigError
from subnetdp.core.plan import check_nodes

NODE_OPTIONS = {"nnodes": None, "max_restarts": "launch.max_restarts", "rdzv_endpoint": "launch.rdzv_endpoint",
                "rdzv_id": "launch.rdzv_id", "rdzv_conf": "launch.rdzv_conf"}  # option -> key (nnodes: two)


@dataclass(frozen=True)
class Nodes:
    """How many nodes a job spans and how their torchrun agents meet (one node: ``--standalone``).

    Attributes:
        min_nodes, max_nodes: equal for a fixed job; ``MIN < MAX``: elastic.
        endpoint: ``HOST:PORT`` of the c10d rendezvous.
        run_id: the rendezvous id, the same on every node.
        node_rank: ``0`` on the endpoint's node (its agent hosts the store), ``>= 1`` elsewhere;
            ``None`` lets torchrun tell by the host name.
        max_restarts: worker-group restarts after a failure (a node that leaves counts; one that
            joins does not).
        rdzv_conf: torchrun's ``--rdzv-conf`` (``key=value,...``: ``last_call_timeout``, ...).
    """

    min_nodes: int = 1
    max_nodes: int = 1
    endpoint: str = ""
    run_id: str = ""
    node_rank: int | None = None
    max_restarts: int = 0
    rdzv_conf: str = ""

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes

    @property
    def several(self) -> bool:
        return self.max_nodes > 1

    @property
    def spec(self) -> str:
        """torchrun's ``--nnodes``: ``2`` or ``1:4``."""
        return f"{self.min_nodes}:{self.max_nodes}" if self.elastic else str(self.max_nodes)

    def worlds(self, nproc: int) -> list[int]:
        """Every world size the job can run at, ``nproc`` ranks per node."""
        return [n * nproc for n in range(self.min_nodes, self.max_nodes + 1)]

    def conf_for(self, node_rank: int | None) -> str:
        """``--rdzv-conf`` of one node: the user's settings and, with a node rank, who hosts the store."""
        parts = [p for p in self.rdzv_conf.split(",") if p.strip()]
        if node_rank is not None:
            parts.append(f"is_host={1 if node_rank == 0 else 0}")
        return ",".join(parts)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    if m is None:
        raise ConfigError("--nnodes", text, "is not N or MIN:MAX", "e.g. --nnodes 2, or --nnodes 1:4 (elastic)")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if not 1 <= lo <= hi:
        raise ConfigError("--nnodes", text, "needs 1 <= MIN <= MAX", "e.g. --nnodes 1:4")
    return lo, hi


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a job over several nodes (torchrun's names; each sets a ``launch.*`` key)."""
    g = parser.add_argument_group("several nodes (torchrun agents meeting at a c10d rendezvous)")
    g.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                   help="nodes of the job (launch.nodes, launch.min_nodes); MIN:MAX is elastic (needs resume=auto)")
    g.add_argument("--node-rank", type=int, default=None, metavar="R",
                   help="0 on the node of --rdzv-endpoint (its agent hosts the rendezvous), 1.. on the others")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="where the agents meet (launch.rdzv_endpoint)")
    g.add_argument("--rdzv-id", default=None, metavar="ID", help="the job's rendezvous id (launch.rdzv_id)")
    g.add_argument("--rdzv-conf", default=None, metavar="K=V,...",
                   help="torchrun's rendezvous settings, e.g. last_call_timeout=30 (launch.rdzv_conf)")
    g.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="restarts of the worker group after a failure or a lost node (launch.max_restarts)")


def node_overrides(ns: argparse.Namespace) -> list[str]:
    """The ``launch.*`` overrides that ``subnetdp launch``'s node options stand for."""
    out = []
    if ns.nnodes is not None:
        lo, hi = parse_nnodes(ns.nnodes)
        out += [f"launch.nodes={hi}", f"launch.min_nodes={lo}"]
    for option, key in NODE_OPTIONS.items():
        value = getattr(ns, option)
        if key and value is not None:
            out.append(f"{key}={value}")
    return out


def check_config(cfg: Any) -> None:
    """``launch.min_nodes <= launch.nodes``; a restartable job (elastic or ``launch.max_restarts``) resumes
    (``resume=auto``); a multi-node job names its run; the endpoint is ``HOST:PORT``."""
    launch = cfg.launch
    nodes, low = int(launch.nodes), int(launch.min_nodes) or int(launch.nodes)
    if low > nodes:
        raise ConfigError("launch.min_nodes", low, f"is more than launch.nodes={nodes}",
                          f"use launch.min_nodes={nodes} or less (0: a fixed job of launch.nodes)")
    restarts = int(launch.max_restarts)
    if (low < nodes or restarts) and cfg.resume == "never":
        why = f"launch.min_nodes={low} < launch.nodes={nodes}" if low < nodes else f"launch.max_restarts={restarts}"
        raise ConfigError("resume", "never", f"a worker group that torchrun restarts ({why}) would start again "
                          "from step 0", "add resume=auto (it continues from the newest checkpoint, on the new world size)")
    if nodes > 1 and not cfg.run.name:
        raise ConfigError("run.name", "", f"a job over launch.nodes={nodes} writes one run directory that every "
                          "node and every restart must name alike (a made-up name carries each node's clock)",
                          "set run.name=NAME")
    endpoint = str(launch.rdzv_endpoint)
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("launch.rdzv_endpoint", endpoint, "is not HOST:PORT with a port in 1..65535",
                              "e.g. launch.rdzv_endpoint=node001:29500")


def nodes_of(cfg: Any, launcher: str, node_rank: int | None = None) -> Nodes:
    """:class:`Nodes` of a composed config (checked by :func:`check_config`) for ``launcher``."""
    launch = cfg.launch
    hi = int(launch.nodes)
    lo = int(launch.min_nodes) or hi
    nodes = Nodes(lo, hi, str(launch.rdzv_endpoint), str(launch.rdzv_id), node_rank, int(launch.max_restarts),
                  str(launch.rdzv_conf))
    if node_rank is not None and not 0 <= node_rank < hi:
        raise ConfigError("--node-rank", node_rank, f"is outside launch.nodes={hi}",
                          f"use 0 on the node of the rendezvous endpoint and 1..{hi - 1} on the others")
    if not nodes.several:
        return nodes
    if launcher == "mpirun":
        raise ConfigError("launch.nodes", hi, "is for torchrun and srun; mpirun places its ranks itself",
                          "give mpirun all ranks (--nproc TOTAL) and its hosts: --launcher-args='--hostfile FILE'")
    if launcher == "srun":
        if nodes.elastic:
            raise ConfigError("launch.min_nodes", lo, "an elastic job needs torchrun's agents", "use --launcher torchrun")
        return nodes
    if not nodes.endpoint:
        raise ConfigError("launch.rdzv_endpoint", "", f"the torchrun agents of {nodes.spec} nodes meet at an endpoint",
                          "pass --rdzv-endpoint HOST:PORT: a free port on the node started first (--node-rank 0)")
    return Nodes(lo, hi, nodes.endpoint, nodes.run_id or f"subnetdp-{cfg.run.name}", node_rank,
                 nodes.max_restarts, nodes.rdzv_conf)


def plan_nodes(cfg: Any, world_size: int, environ: Any = None) -> int:
    """The nodes the plan of ``world_size`` ranks spreads owners over (the masker's input, never read
    by the masker itself): ``masker.nodes`` when given, else what torchrun tells its workers
    (``WORLD_SIZE / LOCAL_WORLD_SIZE``, ranks numbered node after node), else one node.

    With FSDP the plan is over the replicas, so the nodes must also split them; a node count found
    in the environment that does not (a replica spanning nodes) plans as one node.
    """
    replicas = world_size // cfg.fsdp.shard_size
    if cfg.masker.nodes is not None:
        check_nodes(cfg.masker.nodes, world_size)
        return check_nodes(cfg.masker.nodes, replicas, "masker.nodes (over the fsdp.shard_size replicas)")
    env = os.environ if environ is None else environ
    try:
        total, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return 1
    if total != world_size or local < 1 or total % local or replicas % (total // local):
        return 1
    return total // local
