"""Survivors of a SIGKILLed worker re-form the world in-process: real processes, a real kill.

The store lives in this test's process (the supervisor's place), so it outlives the worker that
dies. Rank 2 is killed inside the world's averaging (its all-reduce already posted) or right after
it (inside the update): the survivors must not exit, must agree on the same members and commit
step, and must average and heal over the new groups, a healed unit bit-identical to its owner's.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from subnetdp.launchers.supervisor import host_store, supervise
from subnetdp.plugins.comm.regroup import agree, form_group, form_world, release, wait_or_regroup

WORLD, VICTIM, KILL_STEP = 4, 2, 3


def _worker(rank: int, port: int, where: str, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    world = dist.ProcessGroupGloo(dist.PrefixStore("start", store), rank, WORLD, datetime.timedelta(seconds=20))
    torch.manual_seed(1234 + rank)
    unit = torch.randn(1000)  # a unit rank 1 co-owns with the victim
    last, lost_at = -1, None
    for step in range(KILL_STEP + 2):
        t = torch.full((4,), float(rank + 1))
        work = world.allreduce([t])
        if rank == VICTIM and step == KILL_STEP and where == "averaging":
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)  # inside the collective: posted, never finished
        try:
            finished = wait_or_regroup(work, store, range(WORLD), generation=1)
        except (dist.DistError, RuntimeError):
            finished = False
        if not finished:
            lost_at = step
            break
        if rank == VICTIM and step == KILL_STEP and where == "update":
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)  # the averaging finished everywhere; the update did not
        last = step
    assert lost_at is not None, "the death was never seen"
    seen = time.time()
    release(world)  # wakes the survivors not next to the dead rank
    m = agree(store, rank, range(WORLD), [], generation=1, last_step=last, timeout_s=60)
    new_world = form_world(store, m, 20)
    ones = torch.ones(3)
    new_world.allreduce([ones]).wait()
    regrouped = time.time()
    # heal: the unit rank 1 co-owned with the victim gains rank 3 as a new owner, over the network
    group = form_group(store, m, (1, 3), 20)
    healed = unit.clone() if rank == 1 else torch.zeros(1000) if rank == 3 else None
    if group is not None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0  # rank 1, the surviving owner, is the group's first member
        group.broadcast([healed], opts).wait()
    torch.save({"members": m.members, "rank": m.rank, "steps": m.last_steps, "commit": m.commit_step,
                "consistent": m.consistent, "sum": ones.tolist(), "lost_at": lost_at,
                "seen": seen, "regrouped": regrouped, "killed": float(store.get("killed_at")),
                "unit": unit if rank == 1 else None, "healed": healed if rank == 3 else None}, out)


@pytest.mark.parametrize("where", ["averaging", "update"])
def test_survivors_regroup_in_process(where, tmp_path):
    store = host_store(30)  # this process is the supervisor: it outlives every worker
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"{r}.pt") for r in range(WORLD)]
    procs = [ctx.Process(target=_worker, args=(r, store.port, where, outs[r])) for r in range(WORLD)]
    for p in procs:
        p.start()
    supervise(store, dict(enumerate(procs)), 120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert procs[VICTIM].exitcode == -signal.SIGKILL
    survivors = [r for r in range(WORLD) if r != VICTIM]
    assert [procs[r].exitcode for r in survivors] == [0, 0, 0], "a survivor exited instead of going on"
    res = {r: torch.load(outs[r], weights_only=False) for r in survivors}
    expected_last = KILL_STEP - 1 if where == "averaging" else KILL_STEP
    steps = res[0]["steps"]
    for i, r in enumerate(survivors):
        assert res[r]["members"] == (0, 1, 3) and res[r]["steps"] == steps  # the same agreement everywhere
        assert res[r]["rank"] == i  # renumbered in old-rank order
        assert res[r]["commit"] == expected_last
        assert res[r]["sum"] == [3.0, 3.0, 3.0]  # the new world averages over the three survivors
        assert steps[i] == res[r]["lost_at"] - 1  # each reported the last step it finished, no other
    if where == "update":  # past the commit point: every survivor finished the step
        assert all(res[r]["consistent"] for r in survivors) and steps == (KILL_STEP,) * 3
    else:  # killed inside the collective after posting it: a survivor may have received the whole
        # result (docs/checkpoints.md, the rare case), never more than one step ahead; then the
        # agreement must say so (consistent is False) and the in-process path is not taken
        assert set(steps) <= {expected_last, expected_last + 1}
        assert all(res[r]["consistent"] == (len(set(steps)) == 1) for r in survivors)
    assert torch.equal(res[3]["healed"], res[1]["unit"])
    for r in survivors:  # figures for docs/inprocess.md (printed with -s, never asserted)
        print(f"[{where}] rank {r}: kill->seen {res[r]['seen'] - res[r]['killed']:.3f} s, "
              f"seen->regrouped {res[r]['regrouped'] - res[r]['seen']:.3f} s")  # the new owner holds the unit bit for bit
