"""The gloo communicator goes on in-process after a SIGKILLed peer: real processes, a real kill.

The store lives in this test's process, as under the supervisor (``launchers/supervisor.py``); the
workers join it as torchrun's workers join the agent's. Rank 2 dies right after a step's world
all-reduce: every survivor meets the loss as ``PeerLost``, :meth:`regroup` renumbers it, and the
same communicator object then averages over the new world and over owner groups made for the
survivors' plan (``MaskPlan.without``), broadcasts a unit to its new owner bit for bit and gathers
objects, all under the new ranks. Last, a heal's point-to-point messages with a peer lost without a
closed connection (a node lost whole): the receiver learns it from the store's mark, not at the timeout;
and the world of a join whose newcomer was marked dead: the members learn it from the mark too.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import threading
import time

import torch
from omegaconf import OmegaConf

from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import PeerLost
from subnetdp.core.plan import MaskPlan
from subnetdp.launchers.supervisor import host_store, supervise
from subnetdp.plugins.comm.gloo import GlooCommunicator
from subnetdp.plugins.comm.regroup import DEAD_KEY

WORLD, VICTIM, KILL_STEP = 4, 2, 3
PLAN = MaskPlan(4, [[0, 1, 4], [2, 3, 5], [0, 2, 4], [1, 3, 5]], 6)  # C = 0.5: two owners per unit


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
                       "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1",
                       "SUBNETDP_SUPERVISED": "1"})
    torch.set_num_threads(1)
    cfg = OmegaConf.create({"name": "gloo", "init_method": "env://", "timeout_s": 20.0})
    comm = GlooCommunicator(cfg, LaunchEnv(rank, WORLD, rank, WORLD, "test"))
    comm.init()
    for owners in PLAN.owner_sets()[:-1]:
        comm.new_group(owners)  # collective: every rank, member or not
    last, lost = 0, None
    for step in range(1, KILL_STEP + 3):
        try:
            comm.all_reduce(torch.ones(4), comm.world)
        except PeerLost as e:
            lost = str(e)
            break
        last = step
        if rank == VICTIM and step == KILL_STEP:
            comm._job_store.set("killed_at", repr(time.time()))  # for the figures printed below
            os.kill(os.getpid(), signal.SIGKILL)  # after the step's world reduction: the commit point passed
    m = comm.regroup(last)  # collective: every survivor
    plan = PLAN.without(m.members, min_owners=2)
    for owners in plan.owner_sets()[:-1]:
        comm.new_group(owners)  # collective: every member of each group
    world_sum = torch.full((2,), float(m.old_rank + 1))
    comm.all_reduce(world_sum, comm.world)
    regrouped = time.time()  # the first collective finished on the re-formed world
    sums = {}
    for owners in plan.owner_sets()[:-1]:
        if comm.rank in owners:
            t = torch.full((1,), float(m.old_rank + 1))
            comm.all_reduce(t, owners, async_op=True).wait()
            sums[owners] = float(t)
    # heal: unit 0's surviving owner (old rank 0) hands it to the unit's new owner over the network
    torch.manual_seed(7)
    unit = torch.randn(1000) if m.old_rank == 0 else torch.zeros(1000)
    comm.broadcast(unit, m.new_rank(0))
    gathered = comm.all_gather_object({"old": m.old_rank})
    comm.barrier()
    heal = _heal_with_a_peer_lost_whole(comm, m)
    if m.old_rank != 3:
        heal.update(_join_of_a_newcomer_that_died(comm, m))
    torch.save({"lost": lost, "last": last, "members": m.members, "commit": m.commit_step,
                "consistent": m.consistent, "rank": comm.rank, "world": comm.world_size,
                "world_sum": world_sum.tolist(), "sums": sums, "unit": unit, "gathered": gathered,
                "owned": plan.owned, "seconds": regrouped - float(comm._job_store.get("killed_at")), **heal}, out)
    comm.shutdown()


def _heal_with_a_peer_lost_whole(comm: GlooCommunicator, m) -> dict:
    """The heal's point-to-point messages (``send_recv``) while a peer is lost without closing a connection.

    Old rank 3 stands for a worker of a node lost whole (the machine gone: no connection closes, nobody
    reaps it): it never posts its message to rank 0, and is marked dead in the store, as the supervisor
    that finds its node's beat silent marks it (``launchers/liveness.py``). Rank 0's wait must end at that
    mark, as every other supervised wait does, not at comm.timeout_s (20 s); rank 0's own message to
    rank 1 arrives whole, and no wait of rank 0's is left inside gloo.
    # collective: every survivor.
    """
    store = comm._job_store
    wait = datetime.timedelta(seconds=60)  # past rank 0's comm.timeout_s, were its wait unwatched
    if m.old_rank == 3:
        # Marked once rank 1 has its message: a mark ends every survivor's wait, finished or not (they all
        # agree again next), so rank 1 could otherwise raise too.
        store.wait(["heal_received"], wait)
        store.set(f"{DEAD_KEY}/3", "node 1 lost (no beat)")  # its connections stay open until rank 0 is done
        store.wait(["heal_ended"], wait)
        return {}
    message = torch.arange(256, dtype=torch.uint8)
    if m.old_rank == 1:
        got = torch.zeros(256, dtype=torch.uint8)
        comm.send_recv({}, {0: got})
        store.set("heal_received", "1")
        return {"heal_got": got}
    t0 = time.monotonic()
    try:
        comm.send_recv({1: message}, {2: torch.zeros(256, dtype=torch.uint8)})
        return {"heal_error": None}
    except PeerLost as e:
        # Nothing of it still waits inside gloo (a process exiting meanwhile would abort), though rank 3 is still there.
        left = [t.name for t in threading.enumerate() if t.name == "subnetdp-send-recv"]
        return {"heal_error": str(e), "heal_lost": e.lost, "heal_seconds": time.monotonic() - t0, "heal_left": left}
    finally:
        store.set("heal_ended", "1")


def _join_of_a_newcomer_that_died(comm: GlooCommunicator, m) -> dict:
    """The world of a join (``grow``) with a replacement (worker 4) the supervisor marked dead before it came:
    the members' wait ends at the mark, not at gloo's rendezvous timeout (comm.timeout_s, 20 s).
    # collective: old ranks 0 and 1."""
    comm._job_store.set(f"{DEAD_KEY}/4", "exit 1")  # as the supervisor marks a replacement that died
    decided = {"world": [0, 1], "id": 4, "slot": 2, "generation": m.generation + 1, "step": 9}
    t0 = time.monotonic()
    try:
        comm.grow(decided)
        return {"join_error": None}
    except PeerLost as e:
        return {"join_error": str(e), "join_lost": e.lost, "join_seconds": time.monotonic() - t0}


def test_communicator_regroups_after_a_sigkill(tmp_path):
    store = host_store(30)  # this process is the supervisor: it outlives every worker
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"{r}.pt") for r in range(WORLD)]
    procs = [ctx.Process(target=_worker, args=(r, store.port, outs[r])) for r in range(WORLD)]
    for p in procs:
        p.start()
    # Old rank 3's node is lost whole in the heal below: no supervisor here reaps it (nor kills it when marked).
    supervise(store, {r: p for r, p in enumerate(procs) if r != 3}, 150)
    procs[3].join(60)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert procs[VICTIM].exitcode == -signal.SIGKILL
    survivors = [0, 1, 3]
    assert [procs[r].exitcode for r in survivors] == [0, 0, 0], "a survivor exited instead of going on"
    res = {r: torch.load(outs[r], weights_only=False) for r in survivors}
    expected = PLAN.without(survivors, min_owners=2)
    torch.manual_seed(7)
    unit = torch.randn(1000)
    for new, old in enumerate(survivors):
        r = res[old]
        assert r["lost"] is not None and r["last"] == KILL_STEP  # each met the loss as PeerLost, at the same step
        assert r["members"] == (0, 1, 3) and r["commit"] == KILL_STEP and r["consistent"]
        assert (r["rank"], r["world"]) == (new, 3)  # the same object answers the new rank and world size
        assert r["world_sum"] == [7.0, 7.0]  # 1 + 2 + 4: the three survivors, the dead rank's 3 absent
        assert r["owned"] == expected.owned
        for owners, total in r["sums"].items():  # each owner group of the new plan sums its own members
            assert total == sum(survivors[o] + 1 for o in owners)
        assert set(r["sums"]) == {o for o in expected.owner_sets()[:-1] if new in o}
        assert torch.equal(r["unit"], unit)  # bit for bit on every survivor, the unit's new owner included
        assert r["gathered"] == [{"old": o} for o in survivors]
    # The heal's messages watch the store: rank 0 learns that rank 3 is gone from its mark, long before
    # comm.timeout_s (20 s) would end its receive, and rank 1 got rank 0's message whole.
    heal = res[0]
    assert heal["heal_error"] and heal["heal_error"].startswith("rank 3 died (the supervisor's store said so during "
                                                                "send_recv)"), heal["heal_error"]
    assert heal["heal_lost"] == [2] and heal["heal_seconds"] < 5, heal  # today's rank of old rank 3
    assert heal["heal_left"] == [], heal
    assert torch.equal(res[1]["heal_got"], torch.arange(256, dtype=torch.uint8))
    for old in (0, 1):  # a join's world watches the store too: a newcomer marked dead ends the members' wait
        r = res[old]
        assert r["join_error"] == "rank 4 died (the supervisor's store said so before forming the world of the join)", r
        assert r["join_lost"] == [2] and r["join_seconds"] < 5, r
    for old in survivors:  # figures for docs/inprocess.md (printed with -s, never asserted)
        print(f"rank {old}: kill -> first all-reduce on the re-formed world {res[old]['seconds']:.3f} s")
    print(f"rank 0: a peer marked dead -> PeerLost in the heal's send_recv {heal['heal_seconds']:.3f} s")
