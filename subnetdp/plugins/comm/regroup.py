"""Re-forming the world in-process after a peer is lost: membership, commit step, fresh process groups.

The survivors of a failed collective meet at the job's ``TCPStore`` (hosted by the supervisor, a
process that outlives every worker: docs/inprocess.md), agree on who is still there and on the last
step they all finished, and build a new world and new owner groups under a fresh store prefix. No
process restarts and no rendezvous of torch's elastic agent is involved: the agent would tear every
worker down. The agreement is one ``compare_set`` on the store (the store serialises it: the first
proposal wins and every survivor reads the same one), so no survivor can adopt another membership.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch.distributed as dist

from subnetdp import PeerLost, SubnetdpError

REGROUP_KEY = "subnetdp/regroup"  # + /<generation>/...: one set of keys per re-formation
#: + /<old rank>: written by the supervisor when it reaps a worker (``launchers/supervisor.py``, the
#: same literal: a plugin imports only the public API), so no survivor waits out a timeout for it
DEAD_KEY = "subnetdp/dead"


@dataclass(frozen=True)
class Membership:
    """What every survivor agreed on: who goes on, under which ranks, from which step."""

    generation: int
    members: tuple[int, ...]  # old ranks that go on, ascending; the new rank of members[i] is i
    last_steps: tuple[int, ...]  # the last finished step each member reported, in members' order
    old_rank: int
    space: str = REGROUP_KEY  # a join forms its world under its own keys (JOIN_KEY/<id>): never a death's

    @property
    def rank(self) -> int:
        return self.members.index(self.old_rank)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def commit_step(self) -> int:
        """The step every survivor finished: the one they all continue from."""
        return min(self.last_steps)

    @property
    def consistent(self) -> bool:
        """Whether every survivor stands at the same step (docs/checkpoints.md: they can be one apart)."""
        return len(set(self.last_steps)) == 1

    @property
    def prefix(self) -> str:
        return f"{self.space}/{self.generation}"

    def new_rank(self, old: int) -> int:
        return self.members.index(old)


class MarkWatch:
    """Whether the store holds a mark for a world, looked up in one round trip while nothing changes.

    A supervised worker waits in every collective of every step (docs/inprocess.md, "What watching
    costs"): looking up each of the 2W mark keys at every poll cost more than the step's own work on
    this loaded machine. The store's key count changes when any key is added (a death mark, a
    registration, a joiner's announcement) or removed, so while it stands still no mark can have
    appeared; when it moves the marks are looked up once.
    """

    def __init__(self) -> None:
        self.count: int | None = None  # the store's key count when it last held none of the marks looked for

    def marked(self, store: Any, marks: Sequence[str]) -> bool:
        count = store.num_keys()
        if count == self.count:
            return False
        if any(store.check([k]) for k in marks):
            return True
        self.count = count
        return False


def wait_or_regroup(work: Any, store: Any, world: Sequence[int], generation: int, watch: MarkWatch | None = None,
                    poll_s: float = 0.0005, look_s: float = 0.02) -> bool:
    """Wait for ``work``; True when it finished, False as soon as a re-formation is under way.

    A ring all-reduce blocks a member on its neighbour, not on the dead rank: a survivor two hops
    away would see nothing until ``comm.timeout_s`` (20 s of a 20 s timeout, measured). It watches
    the store instead: the supervisor's death mark or another survivor's registration for this
    generation ends its wait. The work is polled every ``poll_s`` (the wait's added latency), the
    store looked at every ``look_s`` of waiting (a death's added latency), in one round trip while
    nothing changed there (:class:`MarkWatch`). A failed work raises from ``wait`` as before. A
    store that fails (its host, node 0's supervisor, died with that node's workers) is watched no
    more: the work then ends by itself (a closed connection at once, a stall at ``comm.timeout_s``),
    and the failure takes the restart path, as the re-formation needs the store.
    """
    marks = [f"{DEAD_KEY}/{r}" for r in world] + [f"{REGROUP_KEY}/{generation}/alive/{r}" for r in world]
    watch = watch if watch is not None else MarkWatch()
    look = time.monotonic() + look_s
    while not work.is_completed():
        if time.monotonic() >= look:
            try:
                if watch.marked(store, marks):
                    return False
            except (RuntimeError, OSError):  # torch's DistNetworkError: the store's host is gone
                break
            look = time.monotonic() + look_s
        time.sleep(poll_s)
    work.wait()
    return True


def release(old: Any) -> None:
    """Abort this survivor's old process group: its pending work is abandoned, its sockets closed."""
    try:
        old.abort()
    except Exception:  # already broken or gone: nothing left to release
        pass


def agree(store: Any, old_rank: int, old_world: Sequence[int], lost: Sequence[int], generation: int,
          last_step: int, timeout_s: float) -> Membership:
    """Agree with the other survivors on the new membership (every survivor calls this).

    Each survivor registers itself with its last finished step. The first survivor to see every
    member either registered or reaped by the supervisor (``launchers/supervisor.py``), or ``timeout_s`` pass (a
    stalled member), proposes the members registered at that moment;
    ``compare_set`` keeps the first proposal, so all survivors adopt the same one. A survivor that
    registers after the decision is not in it: it raises, and must leave (its units have co-owners).
    """
    prefix = f"{REGROUP_KEY}/{generation}"
    store.set(f"{prefix}/alive/{old_rank}", str(int(last_step)))
    deadline = time.monotonic() + timeout_s
    waiting = [r for r in old_world if r not in set(lost)]
    while waiting and time.monotonic() < deadline:
        waiting = [r for r in waiting if not store.check([f"{prefix}/alive/{r}"])
                   and not store.check([f"{DEAD_KEY}/{r}"])]
        time.sleep(0.01)
    present = [r for r in old_world if store.check([f"{prefix}/alive/{r}"])]
    steps = [int(store.get(f"{prefix}/alive/{r}")) for r in present]
    proposal = json.dumps({"members": present, "steps": steps})
    decided = json.loads(store.compare_set(f"{prefix}/decided", "", proposal))
    members, steps = tuple(decided["members"]), tuple(decided["steps"])
    for r in old_world:  # a member left out (one that stalled) is the supervisor's to stop: it must not come back
        if r not in members and not store.check([f"{DEAD_KEY}/{r}"]):
            store.set(f"{DEAD_KEY}/{r}", f"left out of re-formation {generation}")
    unaccounted = [r for r in waiting if r not in members]
    if unaccounted and members and old_rank == members[0]:
        # Nothing said these ranks were gone: no supervisor reaped them (a stall, or a node whose loss no
        # supervisor saw), so every survivor waited out the agreement's timeout for them.
        print(f"subnetdp: re-formation {generation}: rank(s) {unaccounted} neither checked in nor were marked dead "
              f"by a supervisor within comm.timeout_s={timeout_s:g} s; the survivors go on without them", flush=True)
    if old_rank not in members:
        raise SubnetdpError(f"rank {old_rank} reached the re-formation {generation} after the survivors "
                            f"{list(members)} had agreed without it; it leaves (its units have co-owners)")
    return Membership(generation, members, steps, old_rank)


def form_world(store: Any, membership: Membership, timeout_s: float) -> Any:
    """A gloo process group of the survivors under the re-formation's own prefix (~6 ms here).

    # collective: every survivor of the membership reaches this.
    """
    pg_store = dist.PrefixStore(f"{membership.prefix}/world", store)
    return dist.ProcessGroupGloo(pg_store, membership.rank, membership.world_size,
                                 datetime.timedelta(seconds=timeout_s))


def form_group(store: Any, membership: Membership, owners_old: Sequence[int], timeout_s: float) -> Any:
    """The process group of one owner group, named by its members' old ranks, among its survivors.

    Only the group's surviving members call it (a ProcessGroupGloo is made by its members alone,
    unlike ``dist.new_group``, which every rank of the world must enter). Returns ``None`` for a
    caller outside the group.
    # collective: every surviving owner of this group reaches this.
    """
    # In the order given (the new ranks' order): after a join a newcomer's id is higher than the ranks around it.
    alive = [r for r in owners_old if r in membership.members]
    if membership.old_rank not in alive:
        return None
    key = "-".join(map(str, alive))
    pg_store = dist.PrefixStore(f"{membership.prefix}/group/{key}", store)
    return dist.ProcessGroupGloo(pg_store, alive.index(membership.old_rank), len(alive),
                                 datetime.timedelta(seconds=timeout_s))


def _named(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def gather_members(store: Any, membership: Membership, workers: Sequence[int], timeout_s: float, what: str,
                   poll_s: float = 0.005) -> None:
    """Before a process group of ``workers`` (old ranks) forms: every member checks in at the store and
    waits for the others, and a member the supervisor marks dead meanwhile ends the wait at once
    (:class:`PeerLost`, its ``lost`` in the membership's ranks), where gloo's own rendezvous would wait
    ``timeout_s`` for it (measured: 20 s of a 20 s timeout, a second death before the owner groups).
    A member that never comes (it stalled) ends it at ``timeout_s``.
    # collective: every member of ``workers`` reaches this.
    """
    key = f"{membership.prefix}/here/{'-'.join(map(str, workers))}"
    store.set(f"{key}/{membership.old_rank}", "1")
    waiting, deadline = [w for w in workers if w != membership.old_rank], time.monotonic() + timeout_s
    while True:
        dead = [w for w in workers if store.check([f"{DEAD_KEY}/{w}"])]
        if dead:
            raise PeerLost(f"{_named(dead)} died (the supervisor's store said so before {what})",
                           [membership.members.index(w) for w in dead])
        waiting = [w for w in waiting if not store.check([f"{key}/{w}"])]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise PeerLost(f"{_named(waiting)} did not come to {what} within {timeout_s:g} s",
                           [membership.members.index(w) for w in waiting])
        time.sleep(poll_s)


JOIN_KEY = "subnetdp/join"  # /next: the replacement waiting; /<id>/decided: the step it joins at; /closed: the job ended


def announce(store: Any, worker_id: int, slot: int) -> None:
    """A replacement says it waits to join in the dead worker's place ``slot`` (its rank at W)."""
    store.set(f"{JOIN_KEY}/next", json.dumps({"id": int(worker_id), "slot": int(slot)}))


def join_decision(store: Any, step: int, last_step: int, generation: int, world: Sequence[int],
                  can_grow: bool, extra: dict | None = None) -> dict | None:
    """A member at the boundary after ``step``: the join decided for this world, or None.

    One ``check`` of the store per step when no replacement waits. The first member to see one
    proposes the boundary after the next step (``compare_set`` keeps the first proposal): a member
    can be at most one boundary behind another (each step ends in a world reduction), so every
    member meets the decision at that boundary at the latest, and none is a step ahead. A decision
    made for another world (a death came between) is void for everyone alike. ``extra`` rides in the
    proposal (what the newcomer needs to know before it forms the world with the members).
    """
    if not store.check([f"{JOIN_KEY}/next"]):
        return None
    ask = json.loads(store.get(f"{JOIN_KEY}/next"))
    key = f"{JOIN_KEY}/{ask['id']}/decided"
    if not store.check([key]):
        if not can_grow or step + 1 >= last_step or any(store.check([f"{DEAD_KEY}/{r}"]) for r in world):
            return None  # nothing to grow back to, too late in the run, or a death is being handled
        proposal = json.dumps({**(extra or {}), "step": step + 1, "generation": generation, "world": list(world), **ask})
        store.compare_set(key, "", proposal)
    decided = json.loads(store.get(key))
    if decided["generation"] != generation or decided["world"] != list(world):
        return None
    return decided


def joined_membership(decided: dict, old_rank: int) -> Membership:
    """The world a join forms: the members in their ranks' order, the newcomer in the place it fills."""
    members = list(decided["world"])
    members.insert(int(decided["slot"]), int(decided["id"]))
    return Membership(int(decided["generation"]), tuple(members), (int(decided["step"]),) * len(members), old_rank,
                      space=f"{JOIN_KEY}/{decided['id']}")


def await_join(store: Any, worker_id: int, poll_s: float = 0.05) -> dict | None:
    """The newcomer: wait for the members' decision (None: the job ended first, ``JOIN_KEY/closed``)."""
    key = f"{JOIN_KEY}/{worker_id}/decided"
    while not store.check([key]):
        if store.check([f"{JOIN_KEY}/closed"]):
            return None
        time.sleep(poll_s)
    return json.loads(store.get(key))
