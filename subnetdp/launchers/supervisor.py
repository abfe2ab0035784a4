"""A supervisor for in-process continuation: it hosts the job's store and reaps, never restarts.

torchrun's agent answers a worker's death by stopping every worker and starting them again. For
the survivors to go on in-process (docs/inprocess.md) the process that hosts the store must
outlive every worker and leave the survivors running: this one does, and tells them whom it reaped.

Over several nodes there is one supervisor per node (:class:`Place`): node 0's serves the job's
store at ``launch.rdzv_endpoint``, the others are its clients; each starts its node's workers with
their global ranks and reaps them, and each beats in the store and marks the workers of a node that
went silent (:mod:`subnetdp.launchers.liveness`), so a node lost whole is marked like a dead worker.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch.distributed as dist

from subnetdp.core.errors import ConfigError
from subnetdp.launchers.liveness import Liveness

#: + /<rank>: a reaped worker. Read by ``plugins/comm/regroup.py`` (the same literal: a plugin
#: imports only the public API), so the survivors need not wait out a timeout for a dead process.
DEAD_KEY = "subnetdp/dead"
#: + /closed: the job ended, a replacement still waiting to join leaves (``plugins/comm/regroup.py``, the same literal).
JOIN_KEY = "subnetdp/join"
#: A replacement's worker id (``plugins/comm/torch_dist.py``, the same literal): ids are never reused, so a
#: replacement's store keys (its death mark) are its own, not the dead worker's it replaces.
JOIN_ENV = "SUBNETDP_JOIN_ID"


def host_store(timeout_s: float, host: str = "127.0.0.1", port: int = 0) -> Any:
    """The job's ``TCPStore``, served from this process (port 0: a free one, ``store.port``)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _exitcode(proc: Any) -> int | None:
    """A ``subprocess.Popen``'s or a ``multiprocessing.Process``'s exit code, None while it runs."""
    return proc.poll() if hasattr(proc, "poll") else proc.exitcode


def supervise(store: Any, workers: dict[int, Any], timeout_s: float, poll_s: float = 0.02,
              replace: Callable[[int], tuple[int, Any] | None] | None = None,
              liveness: Liveness | None = None) -> dict[int, int | None]:
    """Watch ``workers`` (worker id -> process) until all ended or ``timeout_s``; return their exit codes.

    A worker that ends with a non-zero code is marked dead in the store at once and nobody else is
    touched: the survivors re-form among themselves. ``replace(id)``, when given, may start a
    replacement for it (returns its new id and process, added to ``workers``; it joins the survivors
    at a step boundary: docs/inprocess.md). A running worker the survivors marked (left out of their
    agreement: it stalled) is killed. When every worker but the replacements has ended, a replacement
    still waiting to join is told the job closed. Workers still running at the timeout are left to
    the caller (it decides whether to kill them). ``liveness`` (several nodes): this node beats and
    marks the workers of a node found lost, every poll. A store that fails (its host, node 0's
    supervisor, is gone) is used no more: the workers find it gone too and take the restart path;
    this one only reaps them.
    """
    marked: set[int] = set()
    spares: set[int] = set()
    closed = False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = {r: _exitcode(p) for r, p in workers.items()}
        try:
            if store is not None:
                closed = _tend(store, workers, codes, marked, spares, closed, replace, liveness)
        except (RuntimeError, OSError) as e:  # torch's DistNetworkError is a RuntimeError
            print(f"subnetdp supervisor: the job's store is gone ({str(e).splitlines()[0][:120]}): its host, "
                  "node 0's supervisor, died; the workers here take the restart path", flush=True)
            store = None
            if liveness is not None:
                liveness.stop()  # no more beats nor watching: each call on the dead store fails anew
        if all(c is not None for c in codes.values()) and len(codes) == len(workers):
            # A replacement that never joined left because the job ended (one line): no failure of the job.
            joined = (lambda r: True) if store is None else (lambda r: store.check([f"{JOIN_KEY}/{r}/decided"]))
            return {r: 0 if r in spares and not joined(r) else c for r, c in codes.items()}
        time.sleep(poll_s)
    return {r: _exitcode(p) for r, p in workers.items()}


def _tend(store: Any, workers: dict[int, Any], codes: dict[int, int | None], marked: set[int], spares: set[int],
          closed: bool, replace: Callable[[int], tuple[int, Any] | None] | None, liveness: Liveness | None) -> bool:
    """One poll's store work of :func:`supervise`; returns whether the waiting replacements were told the job closed."""
    for r, code in codes.items():
        if code not in (None, 0) and r not in marked:
            store.set(f"{DEAD_KEY}/{r}", f"exit {code}")
            marked.add(r)
            new = replace(r) if replace is not None else None
            if new is not None:
                workers[new[0]] = new[1]
                spares.add(new[0])
        elif code is None and r not in marked and store.check([f"{DEAD_KEY}/{r}"]):
            # The survivors went on without it (it stalled past the agreement, or its node was taken
            # for lost): stop it for good, so it cannot write into their run or hold the job open.
            workers[r].kill()
            marked.add(r)
    if liveness is not None:
        for n in liveness.tick():
            print(f"subnetdp supervisor: node {n} lost (no beat for {liveness.silence_s:g} s): its workers "
                  f"{liveness.workers_of[n]} are marked dead, the survivors go on without them", flush=True)
    if spares and not closed and all(c is not None for r, c in codes.items() if r not in spares):
        store.set(f"{JOIN_KEY}/closed", "the job ended")  # a replacement still waiting leaves
        closed = True
    return closed


def _leave(store: Any, liveness: Liveness, place: Place, stopped: Callable[[], bool], poll_s: float = 0.02) -> None:
    """This node's workers ended. Node 0 hosts the store: it stays until every other node ended or was
    lost (their workers may still need the store), or it is told to stop (SIGINT, SIGTERM); another
    node says it ended, so nobody marks it lost."""
    try:
        liveness.done()
        # A node that never arrived is not waited for: its workers could not have met these (a start-up timeout).
        while place.node == 0 and liveness.pending() and not stopped():
            liveness.tick()
            time.sleep(poll_s)
    except (RuntimeError, OSError):  # the store's host is gone: nothing left to tell anyone
        pass


#: Set in every worker the supervisor starts (read by ``plugins/comm/torch_dist.py``, the same literal).
SUPERVISED_ENV = "SUBNETDP_SUPERVISED"


@dataclass(frozen=True)
class Place:
    """Where this supervisor's workers sit in a job over several nodes (one node: the defaults).

    Node 0 hosts the job's store at ``host:port`` (the endpoint); the others reach it as clients.
    Worker ids are the global ranks: node ``n`` starts ranks ``n * nproc ... n * nproc + nproc - 1``.
    """

    nodes: int = 1
    node: int = 0
    host: str = "127.0.0.1"
    port: int = 0  # node 0: 0 picks a free one (one node)
    run_id: str = ""


def place_of(cfg: Any) -> Place:
    """This node of a supervised job over ``launch.nodes`` (``subnetdp train ... launch.on_failure=continue``).

    Refuses, in one line naming the key, what cannot work: the supervisor is the only launcher that
    lets survivors go on, so several nodes without ``on_failure=continue`` belong to ``subnetdp launch``;
    an elastic job and replacements are torchrun's and one node's; a node needs the endpoint of node 0's store.
    """
    from subnetdp.launchers.nodes import check_config

    launch, nodes, node = cfg.launch, int(cfg.launch.nodes), int(cfg.launch.node_rank)
    if node >= nodes:
        raise ConfigError("launch.node_rank", node, f"is outside launch.nodes={nodes}",
                          f"use 0 on the node of launch.rdzv_endpoint and 1..{nodes - 1} on the others")
    if launch.on_failure != "continue":
        raise ConfigError("launch.nodes", nodes, "with subnetdp train starts this node's workers under subnetdp's "
                          "supervisor, which only serves launch.on_failure=continue",
                          "add launch.on_failure=continue, or start a job that restarts over several nodes with "
                          f"subnetdp launch --nnodes {nodes} --node-rank R --rdzv-endpoint HOST:PORT")
    if int(launch.min_nodes) not in (0, nodes):
        raise ConfigError("launch.min_nodes", int(launch.min_nodes), "makes an elastic job, whose nodes torchrun's "
                          "agents restart; survivors going on in-process (launch.on_failure=continue) need no "
                          "smallest world", "remove launch.min_nodes (0)")
    if int(launch.replace):
        raise ConfigError("launch.replace", int(launch.replace), f"replaces dead workers on one node only, not "
                          f"over launch.nodes={nodes}", "set launch.replace=0 (the survivors go on at the smaller world)")
    if not str(launch.rdzv_endpoint):
        raise ConfigError("launch.rdzv_endpoint", "", f"the supervisors of launch.nodes={nodes} meet at the job's "
                          "store, which node 0's supervisor serves there",
                          "set launch.rdzv_endpoint=HOST:PORT: a free port on node 0 (start it first)")
    check_config(cfg)  # the endpoint's form, run.name
    host, _, port = str(launch.rdzv_endpoint).rpartition(":")
    return Place(nodes, node, host, int(port), str(launch.rdzv_id) or f"subnetdp-{cfg.run.name}")


def check_supervised(on_failure: str, launcher: str) -> None:
    """``launch.on_failure=continue`` where no subnetdp supervisor starts the workers: refused in one line.

    torchrun's agent restarts every worker of its node when one dies (and over several nodes every
    node's), mpirun ends the job (no ULFM here): neither leaves survivors to go on.
    """
    if on_failure != "continue" or os.environ.get(SUPERVISED_ENV) == "1":
        return
    raise ConfigError("launch.on_failure", "continue", f"needs the workers started by subnetdp's supervisor, but "
                      f"{launcher} starts them (it restarts or ends every worker when one dies)",
                      "start them with subnetdp train RECIPE launch.nproc=N launch.on_failure=continue (over several "
                      "nodes add launch.nodes=N launch.node_rank=R launch.rdzv_endpoint=HOST:PORT on each), "
                      "or use launch.on_failure=restart")


def _store_of(place: Place, timeout_s: float) -> Any:
    """The job's store: served here on node 0, reached as a client elsewhere (waiting up to ``timeout_s``)."""
    try:
        if place.node == 0:
            return host_store(timeout_s, place.host, place.port)
        return dist.TCPStore(place.host, place.port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        what = ("cannot be served from this node (node 0)" if place.node == 0 else
                f"did not answer within comm.timeout_s={timeout_s:g} s")
        fix = ("choose a free port on this node" if place.node == 0 else
               "start node 0 (launch.node_rank=0, the endpoint's node) first, with the same launch.rdzv_endpoint")
        raise ConfigError("launch.rdzv_endpoint", f"{place.host}:{place.port}", f"the job's store {what} ({first})",
                          fix) from None


@contextlib.contextmanager
def _native_stderr_to(path: Path | None) -> Iterator[int | None]:
    """While supervising, this process's C++ side writes to ``path``; yields the console's descriptor.

    torch's ``TCPStore`` client writes a warning and its C++ backtrace straight to file descriptor 2
    before it raises (15 lines when node 0, the store's host, dies under another node's supervisor):
    the console keeps the one line this supervisor says about it, the log the rest, as the workers'
    C++ side goes to ``logs/rank_R.stderr`` (``train/failures.route_native_stderr``). Python's
    ``sys.stderr`` and the workers (started with the yielded descriptor) keep the console.
    """
    if path is None:
        yield None
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sys.stderr.flush()
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        yield None  # the console keeps it all: better noisy than silent
        return
    console, python_stderr = os.dup(2), sys.stderr
    os.dup2(target, 2)
    os.close(target)
    sys.stderr = open(os.dup(console), "w", buffering=1, encoding=getattr(python_stderr, "encoding", None) or "utf-8",
                      errors="backslashreplace")
    try:
        yield console
    finally:
        sys.stderr.close()
        sys.stderr = python_stderr
        os.dup2(console, 2)
        os.close(console)


def launch_supervised(nproc: int, argv: Sequence[str], timeout_s: float = 600.0, replacements: int = 0,
                      place: Place = Place(), native_log: Path | None = None) -> int:
    """``launch.on_failure=continue``: run ``python -m subnetdp <argv>`` in ``nproc`` workers under this process.

    This process hosts the job's store (the workers reach it as torchrun's workers reach the
    agent's: ``TORCHELASTIC_USE_AGENT_STORE``), marks a worker that dies, and restarts nobody, so
    the survivors can go on in-process (docs/inprocess.md). Returns 0 when every worker that was
    not reaped dead ended well, else the first non-zero exit code. ``replacements``: how many dead
    workers in all are replaced by a fresh worker that joins the survivors (``launch.replace``).
    ``place``: this node of a job over several (node 0 hosts the store, the others join it; each
    beats and watches the others: :mod:`subnetdp.launchers.liveness`). ``native_log``: where this
    process's C++ side writes while it supervises (:func:`_native_stderr_to`; None: the console).
    """
    with _native_stderr_to(native_log) as console:
        return _supervised(nproc, argv, timeout_s, replacements, place, console)


def _supervised(nproc: int, argv: Sequence[str], timeout_s: float, replacements: int, place: Place,
                console: int | None) -> int:
    from subnetdp.launchers.lifetime import PARENT_ENV

    store = _store_of(place, timeout_s)
    world, first = place.nodes * nproc, place.node * nproc
    base = {**os.environ, "MASTER_ADDR": place.host, "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(place.node), SUPERVISED_ENV: "1", PARENT_ENV: str(os.getpid())}
    if place.run_id:  # every node's workers are one job's (the run directory's lock names it: runlock.job_id)
        base["TORCHELASTIC_RUN_ID"] = place.run_id
    base.setdefault("OMP_NUM_THREADS", "1")
    def start(rank: int, extra: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "subnetdp", *argv],
                                env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank - first), **extra},
                                start_new_session=True, stderr=console)

    workers: dict[int, Any] = {r: start(r, {}) for r in range(first, first + nproc)}
    liveness = None
    if place.nodes > 1:
        liveness = Liveness(store, place.node, {n: list(range(n * nproc, (n + 1) * nproc)) for n in range(place.nodes)},
                            DEAD_KEY)
    slot = {r: r for r in range(nproc)}  # worker id -> the rank it holds at W
    left = [int(replacements)]

    def replace(dead: int) -> tuple[int, Any] | None:
        if left[0] <= 0:
            return None
        left[0] -= 1
        new = max(slot) + 1
        slot[new] = slot[dead]
        print(f"subnetdp supervisor: worker {dead} (rank {slot[dead]}) died; starting a replacement "
              f"({left[0]} more left) that joins the survivors at a step boundary", flush=True)
        return new, start(slot[new], {JOIN_ENV: str(new)})

    def pass_on(signum: int, _frame: Any) -> None:
        # A stop (SIGINT, SIGTERM) is the workers' to honour: they checkpoint at the next step boundary.
        # A second one kills them at once, as the local launcher does.
        for p in workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL if signalled else signum)
        signalled.append(signum)

    signalled: list[int] = []
    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = supervise(store, workers, float("inf"), replace=replace, liveness=liveness)
        if liveness is not None:
            _leave(store, liveness, place, lambda: bool(signalled))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in workers.values():  # an interrupted supervisor leaves no worker behind
            if p.poll() is None:
                p.kill()
                p.wait()
    survivors = [c for c in codes.values() if c is not None and c >= 0]  # a signal's death is the reaped one's
    bad = [c for c in survivors if c != 0]
    if len(survivors) == len(codes) and not bad:
        return 0
    return bad[0] if bad else (0 if survivors else 1)
