"""The ``torch.distributed`` communicators' shared code (``gloo``, ``nccl``; and FSDP's groups).

:class:`TorchDistCommunicator` creates the process group at :meth:`~TorchDistCommunicator.init`,
one sub-group per owner set (entered by every rank, in the same order), and counts every
all-reduce's payload; a subclass names its ``backend`` and ``device``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import threading
import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from subnetdp import Communicator, Handle, PeerLost, SubnetdpError
from subnetdp.plugins.comm._rendezvous import rendezvous
from subnetdp.plugins.comm.peers import (HOST_KEY, LEFT_KEY, is_peer_gone, is_timeout, arrival_error,
                                         dead_on_this_host, ranks_named, round_prefix, stalled_peers)
from subnetdp.plugins.comm.regroup import (DEAD_KEY, JOIN_KEY, MarkWatch, Membership, agree, announce, await_join,
                                           form_group, form_world, gather_members, join_decision, joined_membership,
                                           release, wait_or_regroup)

#: Set by the supervisor (``launchers/supervisor.py``) in every worker it starts: the launcher's
#: store outlives the workers and marks the dead, so a collective watches it and a survivor goes on.
SUPERVISED_ENV = "SUBNETDP_SUPERVISED"
#: Set by the supervisor in a replacement it starts after a death: its worker id (``launchers/supervisor.py``).
JOIN_ENV = "SUBNETDP_JOIN_ID"


class WorkHandle(Handle):
    """Wraps a ``torch.distributed`` work object."""

    def __init__(self, work: Any, comm: "TorchDistCommunicator | None" = None, group: tuple[int, ...] = ()) -> None:
        self.work, self.comm, self.group = work, comm, group

    def wait(self) -> None:
        if self.work is not None:
            if self.comm is None:
                self.work.wait()
            else:
                self.comm._guarded("all_reduce", self.group, lambda: self.comm._finish(self.work, "all_reduce"))


_ABANDON_TAG = 0x5DB  # a point-to-point tag nothing sends on (the heal's messages use tags 0 and 1)


def _pair(key: Any) -> tuple[int, int]:
    """A ``send_recv`` key as (peer, tag): a rank alone is its tag 0."""
    return (int(key), 0) if not isinstance(key, tuple) else (int(key[0]), int(key[1]))


class _WaitedAside:
    """Point-to-point works waited for on a thread of their own, read as one work that ``wait_or_regroup``
    can watch: gloo's report completion only once waited for (``is_completed`` stays False until then).

    A wait given up on (a peer lost) must not leave the thread blocked in gloo: aborting or shutting down
    the group does not wake a pending receive (it waits out ``comm.timeout_s``), and a process that exits
    normally meanwhile aborts (``terminate called without an active exception``, SIGABRT: measured here,
    torch 2.14.1). :meth:`abandon` ends it.
    """

    def __init__(self, works: Sequence[Any]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._wait, args=(list(works),), name="subnetdp-send-recv", daemon=True)
        self._thread.start()

    def _wait(self, works: list[Any]) -> None:
        try:
            for work in works:
                work.wait()
        except BaseException as e:  # handed to the waiting thread, which names the lost peer (_guarded)
            self._error = e

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def abandon(self, pg: Any, peers: Sequence[int]) -> None:
        """End the thread's wait now (the group is given up: the survivors re-form without it). A receive
        that times out makes gloo close every pair of the group's context, which fails every pending wait
        at once; no one ever sends on its tag."""
        for peer in peers:
            if not self._thread.is_alive():
                return
            try:
                pg.recv([torch.empty(1, dtype=torch.uint8)], peer, _ABANDON_TAG).wait(datetime.timedelta(milliseconds=1))
            except Exception:  # the timeout that closes the pairs (or a pair already closed): what is wanted
                pass
            self._thread.join(timeout=1.0)

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


class TorchDistCommunicator(Communicator):
    """Shared code of the ``torch.distributed`` backends; subclasses set ``backend``."""

    backend = "gloo"
    supports_fsdp = True

    def __init__(self, cfg: Any, env: Any) -> None:
        super().__init__(cfg, env)
        self._groups: dict[tuple[int, ...], Any] = {}
        self._stalls: dict[str, int] = {}  # failed collectives per world (membership): each gets its own keys
        self._marks = MarkWatch()  # what the store held when a collective's wait last looked
        self._retiring: list[threading.Thread] = []  # threads dropping the groups of worlds left behind (_retire)
        self._job_store: Any = None  # the launcher's store, unprefixed: where the supervisor marks the dead
        self._origin: tuple[int, ...] = ()  # after a re-formation: the job's first rank of each rank of now
        self._membership: Membership | None = None
        self._joined: dict | None = None  # a replacement: the decision it joined under
        self._arriving: Membership | None = None  # a replacement until it forms the world with the members

    def init(self) -> None:
        # collective: every rank reaches this; it creates the world process group.
        timeout = self.cfg.timeout_s
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout), **self._init_kwargs()}
        init_method = self.cfg.init_method
        elastic = os.environ.get("TORCHELASTIC_RESTART_COUNT") is not None
        if self.world_size == 1 and init_method == "env://":
            kwargs["store"] = dist.HashStore()
        elif self.replacement:
            self._join(timeout)
            return
        elif elastic and init_method == "env://":
            # torchrun keeps one agent store across restarts of the group, and the keys the process
            # group writes carry no attempt number: a restarted rank could read a dead peer's
            # address. A prefix per round keeps every round's keys apart.
            store, _, _ = next(dist.rendezvous(init_method, self.rank, self.world_size, timeout=kwargs["timeout"]))
            if os.environ.get(SUPERVISED_ENV) == "1":
                self._job_store = store
            kwargs["store"] = dist.PrefixStore(round_prefix(store, self.rank), store)
        else:
            if init_method == "env://":
                rendezvous(self.env)  # mpirun / srun: MASTER_ADDR and MASTER_PORT from rank 0
            kwargs["init_method"] = init_method
        try:
            dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size, **kwargs)
        except (dist.DistError, RuntimeError, ValueError) as e:
            raise SubnetdpError(arrival_error(self, init_method, timeout, e)) from None
        self._groups[self.world] = dist.group.WORLD
        try:  # who is who: when a connection closes, a rank of this host is looked at, not waited for
            dist.distributed_c10d._get_default_store().set(f"{HOST_KEY}/{self.rank}",
                                                          f"{os.uname().nodename} {os.getpid()}")
        except Exception:
            pass

    def _init_kwargs(self) -> dict[str, Any]:
        """Extra ``init_process_group`` arguments of a backend (NCCL binds its device)."""
        return {}

    def new_group(self, ranks: Sequence[int]) -> None:
        key = tuple(sorted(ranks))
        if key in self._groups or self._arriving is not None:  # a replacement makes its groups once arrived
            return
        if self._membership is not None:
            # After a re-formation only the group's members make it (named by the job's first ranks).
            # collective: every member of the group reaches this.
            workers = [self._origin[r] for r in key]
            if self.rank in key:  # a dead member ends the wait at once, not at gloo's rendezvous timeout
                gather_members(self._job_store, self._membership, workers, self.cfg.timeout_s, "forming an owner group")
            pg = form_group(self._job_store, self._membership, workers, self.cfg.timeout_s)
            if pg is not None:
                self._groups[key] = pg
            return
        # collective: every rank creates every group, in the same order, member or not. Owner groups
        # get comm.timeout_s too (torch's default would be 30 minutes for a stalled peer).
        self._groups[key] = dist.new_group(list(key), backend=self.backend,
                                           timeout=datetime.timedelta(seconds=self.cfg.timeout_s))

    def _join(self, timeout: float) -> None:
        """A replacement: announce itself in the job's store, wait for the members' decision, and form
        the world of W with them (no world of its own is ever made). # collective: with every member."""
        self._job_store, _, _ = next(dist.rendezvous("env://", self.rank, self.world_size,
                                                     timeout=datetime.timedelta(seconds=timeout)))
        me = int(os.environ[JOIN_ENV])
        announce(self._job_store, me, self.rank)
        decided = await_join(self._job_store, me)
        if decided is None:
            raise SubnetdpError(f"rank {self.rank} (a replacement) did not join: the job ended before the members "
                                "reached a step boundary it could join at")
        self._joined = decided
        # The world is formed at arrive(), once this process has built all it can alone (its model, its
        # optimizer): the members wait for it there, so nothing it does alone is in their pause.
        self._arriving = joined_membership(decided, me)

    def arrive(self) -> None:
        """A replacement: form the world of W with the members at the join step. Owner groups asked for
        before it (:meth:`new_group`) are made afterwards, in the members' order, by the join itself.
        # collective: every member (in :meth:`grow`) and the newcomer reach this."""
        m, self._arriving = self._arriving, None
        if m is not None:
            self._become(m, self.cfg.timeout_s)

    def _retire(self) -> None:
        """Abort the groups of today's world and let them go off the critical path: a re-formed group is
        torch's object alone, and one with work pending on a dead peer blocks in its destructor until
        that work times out (comm.timeout_s: measured, a second re-formation waited 55 s for it). A
        daemon thread holds the last references (the groups torch registered keep theirs anyway)."""
        old = list({id(g): g for g in self._groups.values()}.values())
        for i in range(len(old)):  # by index: no loop variable keeps a group alive in this frame
            release(old[i])
        self._groups = {}
        retiring = threading.Thread(target=old.clear, name="subnetdp-retired-groups", daemon=True)
        retiring.start()
        self._retiring.append(retiring)

    def _become(self, m: Membership, timeout: float) -> None:
        """Answer ``m``'s rank and world from now on, in a world formed under its prefix (collective).

        The members check in at the store first (``gather_members``), as before a re-formed world: a member
        or the newcomer marked dead meanwhile ends every member's wait at once (:class:`PeerLost`), where
        gloo's own rendezvous would wait ``timeout`` for it."""
        # collective: every member of m reaches this.
        gather_members(self._job_store, m, m.members, timeout, "forming the world of the join")
        world = form_world(self._job_store, m, timeout)
        self._membership, self._origin = m, m.members
        self.env = dataclasses.replace(self.env, rank=m.rank, world_size=m.world_size)
        self._groups = {self.world: world}

    @property
    def replacement(self) -> bool:
        """Whether this process replaces a dead worker (started by the supervisor to join at a step boundary)."""
        return bool(os.environ.get(JOIN_ENV)) and os.environ.get(SUPERVISED_ENV) == "1"

    @property
    def joined(self) -> dict | None:
        """A replacement: the members' decision it joined under (the step, the plan as it stood), else None."""
        return self._joined

    @property
    def origin(self) -> tuple[int, ...]:
        """The worker id of each rank of now (the job's first ranks, then replacements' ids)."""
        return self._origin or tuple(range(self.world_size))

    def join_waiting(self) -> bool:
        """Whether a replacement has announced itself and waits to join."""
        return self._job_store is not None and self._job_store.check([f"{JOIN_KEY}/next"])

    def join_due(self, step: int, last_step: int, can_grow: bool, extra: dict | None = None) -> dict | None:
        """At the boundary after ``step``: the join every member makes now, or None (one store ``check``
        a step while no replacement waits; :func:`regroup.join_decision`)."""
        if self._job_store is None or self._membership is None:
            return None
        decided = join_decision(self._job_store, step, last_step, self._membership.generation + 1,
                                self._origin, can_grow, extra)
        return decided if decided is not None and int(decided["step"]) == step else None

    def grow(self, decided: dict) -> Membership:
        """Take the newcomer of ``decided`` into the world: the old groups are released and the world of
        W formed under the join's own prefix; owner groups are made again by :meth:`new_group`.
        # collective: every member and the newcomer reach this."""
        self._retire()
        old = self._origin[self.rank]
        m = joined_membership(decided, old)
        self._become(m, self.cfg.timeout_s)
        if m.rank == 0:  # every member is past the decision (the world formed): the next check is one round trip
            self._job_store.delete_key(f"{JOIN_KEY}/next")
        return m

    @property
    def can_regroup(self) -> bool:
        """Whether :meth:`regroup` can re-form the world (the workers run under subnetdp's supervisor)."""
        return self._job_store is not None

    def regroup(self, last_step: int) -> Membership:
        """Go on without the lost peers: agree with the survivors, re-form the world under a fresh prefix.

        Only under a supervisor that hosts the job's store (``launchers/supervisor.py``): the old
        groups are aborted (which also wakes a survivor blocked two hops from the dead rank), the
        survivors agree on the members and the step they all finished (:func:`regroup.agree`), and
        this communicator answers the new rank and world size from then on. Owner groups are made
        again by :meth:`new_group` (only their members enter). Returns the agreement.
        # collective: every survivor reaches this.
        """
        if self._job_store is None:
            raise SubnetdpError(f"comm.name={self.cfg.name}: going on in-process needs the supervisor's store "
                                "(launchers/supervisor.py; no launch command starts workers under it yet: docs/inprocess.md)")
        origin = self._origin or tuple(range(self.world_size))
        self._retire()
        generation = (self._membership.generation if self._membership else 0) + 1
        timeout = self.cfg.timeout_s
        try:
            m = agree(self._job_store, origin[self.rank], origin, [], generation, last_step, timeout)
        except dist.DistNetworkError as e:  # not a member lost: the one place every survivor meets is gone
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
            raise SubnetdpError(f"the job's store is gone ({why}): the supervisor that hosts it (node 0's, over "
                                "several nodes) died") from None
        # From the agreement on, this is the membership: when a member dies before the world forms, the
        # next re-formation is the next generation, among these members (the agreed keys are never reused).
        self._membership, self._origin = m, m.members
        self.env = dataclasses.replace(self.env, rank=m.rank, world_size=m.world_size)
        gather_members(self._job_store, m, m.members, timeout, f"forming the world of re-formation {generation}")
        self._groups = {self.world: form_world(self._job_store, m, timeout)}
        return m

    def _finish(self, work: Any, what: str) -> None:
        """Wait for ``work``; under the supervisor, give up as soon as the store says a peer is gone.

        A ring collective blocks a member on its neighbour, not on the dead rank: without the
        store's marks a survivor two hops away would wait out ``comm.timeout_s`` and miss the
        survivors' agreement.
        """
        if self._job_store is None:
            work.wait()
            return
        origin = self._origin or tuple(range(self.world_size))
        generation = (self._membership.generation if self._membership else 0) + 1
        if not wait_or_regroup(work, self._job_store, origin, generation, self._marks):
            # Woken by another survivor's registration, the supervisor's mark may be a reap (20 ms) behind.
            deadline = time.monotonic() + 0.5
            while True:
                dead = [r for r, w in enumerate(origin) if self._job_store.check([f"{DEAD_KEY}/{w}"])]  # today's ranks
                if dead or time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
            who = f"{ranks_named([origin[r] for r in dead])} died" if dead else "a peer is gone"
            raise PeerLost(f"{who} (the supervisor's store said so during {what})", dead)

    def _guarded(self, what: str, group: Sequence[int] | None, call: Any) -> Any:
        """Run a collective; when a peer died or stopped answering, raise :class:`PeerLost` naming it.

        Every member that sees the failure checks in at the world's store; a member that does not
        within a grace period is the one that is gone (it died, or it is not waiting in the collective).
        """
        try:
            return call()
        except (dist.DistError, RuntimeError) as e:
            timeout = is_timeout(e)
            if not timeout and not is_peer_gone(e):
                raise
            members = tuple(range(self.world_size)) if group is None else tuple(group)
            # The store's keys and the messages name the job's first ranks (the same across re-formations);
            # the error's ``lost`` is in today's numbering, the one the state's plan is in.
            ids = self.origin
            job, me = tuple(ids[r] for r in members), ids[self.rank]
            # Keyed by the world every member agreed on, never by a count of this process's own failures: a
            # survivor that learnt of the last death from the store (``_finish``) counted none, another that
            # met it here one, and a shared counter would have split their check-ins in the next world.
            world = self._membership.prefix if self._membership else "first"
            self._stalls[world] = self._stalls.get(world, 0) + 1
            key = f"subnetdp/stall/{world}/{self._stalls[world]}"
            dead: list[int] = []
            try:
                store = dist.distributed_c10d._get_default_store()
                store.set(f"{LEFT_KEY}/{me}", "peer lost")  # before anyone can see this rank exit
                grace = max(2.0, min(10.0, self.cfg.timeout_s / 10))
                if timeout:
                    silent = stalled_peers(store, me, job, key, grace)
                else:  # a connection closed: a process of this host is looked at, one elsewhere asked
                    dead, elsewhere = dead_on_this_host(store, job, wait_s=min(grace, 2.0))
                    silent = sorted(dead + stalled_peers(store, me, job, key, grace, [r for r in elsewhere if r != me]))
            except Exception:  # the store went with the job (it lived in a dead rank): say what is known
                silent = []
            names = ranks_named(silent) if silent else None
            lost = [members[job.index(w)] for w in silent]
            # The library's own text (gloo's ends in "GLHF!") stays in the chain, for the rank's log.
            if not timeout:
                if not silent:
                    who = "a peer is gone"
                elif set(silent) <= set(dead):
                    who = f"{names} died"
                else:
                    who = f"{names} {'is' if len(silent) == 1 else 'are'} gone"
                raise PeerLost(f"{who} (the connection closed during {what} over ranks {job})", lost) from e
            who = f"{names} stopped answering" if names else "a peer stopped answering (every other member timed out too)"
            raise PeerLost(f"{who}: rank {me} timed out after comm.timeout_s={self.cfg.timeout_s:g} s "
                           f"waiting in {what} over ranks {job} — look at the log of "
                           f"{names or 'the slowest rank'} (a crash, a hang, or a much slower step), or raise "
                           "comm.timeout_s", lost) from e

    def _pg(self, group: Sequence[int] | None) -> Any:
        key = self.world if group is None else tuple(group)
        try:
            return self._groups[key]
        except KeyError:
            raise RuntimeError(f"no process group for ranks {key}: groups must be created at set-up") from None

    def all_reduce(self, tensor: torch.Tensor, group: Sequence[int], async_op: bool = False) -> Handle:
        key = tuple(group)
        self.bytes.add(key, tensor.numel() * tensor.element_size())
        pg = self._pg(key)
        if self._membership is not None:  # a re-formed group is torch's object alone: its own methods
            work = self._guarded("all_reduce", key, lambda: pg.allreduce([tensor]))
        elif self._job_store is not None:  # supervised: every wait watches the store (_finish)
            work = self._guarded("all_reduce", key, lambda: dist.all_reduce(tensor, group=pg, async_op=True))
        else:
            work = self._guarded("all_reduce", key, lambda: dist.all_reduce(tensor, group=pg, async_op=async_op))
            return WorkHandle(work, self, key) if async_op else WorkHandle(None)
        handle = WorkHandle(work, self, key)
        if async_op:
            return handle
        handle.wait()
        return WorkHandle(None)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Sequence[int] | None = None) -> None:
        key = self.world if group is None else tuple(group)
        self.bytes.add(key, tensor.numel() * tensor.element_size())  # the payload every member hands over
        pg = self._pg(group)
        if self._membership is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = key.index(src), 0
            self._guarded("broadcast", group, lambda: pg.broadcast([tensor], opts).wait())
            return
        self._guarded("broadcast", group, lambda: dist.broadcast(tensor, src=src, group=pg))

    def send_recv(self, sends: Mapping[Any, torch.Tensor], recvs: Mapping[Any, torch.Tensor]) -> None:
        """Point to point over the world: ``sends[r]`` to rank ``r``, ``recvs[r]`` filled from rank ``r``, all
        posted before any is waited for (no order of the pairs can block); each receiver names the size its
        sender sends. A key ``(r, tag)`` instead of ``r`` tells apart several messages of one pair (tag 0 is
        ``r``'s). The heal of a re-formation (``train/continuation.py``) sends each piece to its gainers only."""
        # collective: every rank named in a pair (its sender and its receiver) reaches this.
        pg = self._pg(None)  # the world's own methods (world ranks), as after a re-formation
        for tensor in sends.values():
            self.bytes.add(self.world, tensor.numel() * tensor.element_size())  # what this rank hands over
        works = [self._guarded("send", None, lambda t=t, d=d: pg.send([t], *_pair(d))) for d, t in sends.items()]
        works += [self._guarded("recv", None, lambda t=t, r=r: pg.recv([t], *_pair(r))) for r, t in recvs.items()]
        if self._job_store is None:  # a dead peer of a pair closes the connection, a stalled one hits the timeout
            for work in works:
                self._guarded("send_recv", None, work.wait)
            return
        # Supervised, the heal's waits watch the store as every other wait does (_finish): a peer marked dead
        # (a node lost whole, whose connections never close) or another survivor registering for the next
        # re-formation ends the wait within a poll, not at comm.timeout_s.
        waited = _WaitedAside(works)
        try:
            self._guarded("send_recv", None, lambda: self._finish(waited, "send_recv"))
        finally:
            # nothing left to wait for when it returned or failed by itself
            waited.abandon(pg, sorted({_pair(k)[0] for k in [*recvs, *sends]}))

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self._watched:
            # Re-formed groups are torch's objects alone; supervised, every wait must watch the store (a
            # survivor two hops from a dead rank in torch's blocking gather would wait out comm.timeout_s
            # and miss the survivors' agreement: measured, a death inside the optimizer update left one out).
            return self._gather_pickled(obj)
        out: list[Any] = [None] * self.world_size
        self._guarded("all_gather_object", None, lambda: dist.all_gather_object(out, obj))
        return out

    @property
    def _watched(self) -> bool:
        """Whether gathers and barriers go through watched all-reduces (re-formed, or under the supervisor)."""
        return self._membership is not None or self._job_store is not None

    def _gather_pickled(self, obj: Any) -> list[Any]:
        """``all_gather_object`` through two watched all-reduces: the lengths first, then the padded bytes."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.zeros(self.world_size, dtype=torch.int64)
        sizes[self.rank] = data.numel()
        self.all_reduce(sizes, self.world)  # collective: every rank of the world
        buf = torch.zeros(self.world_size, int(sizes.max()), dtype=torch.uint8)
        buf[self.rank, :data.numel()] = data
        self.all_reduce(buf, self.world)  # collective: every rank of the world (one row each, the rest zeros)
        return [pickle.loads(buf[r, :int(sizes[r])].numpy().tobytes()) for r in range(self.world_size)]

    def barrier(self) -> None:
        if self._watched:  # as all_gather_object
            self.all_reduce(torch.zeros(1), self.world)  # collective: every rank of the world
            return
        self._guarded("barrier", None, dist.barrier)

    def shutdown(self) -> None:
        # A process that exits while a retired group's destructor runs on its thread aborts (SIGABRT,
        # "terminate called without an active exception": measured, a member leaving at once after a join
        # that failed). The destructor ends by itself, at the latest when its pending work times out.
        for retiring in self._retiring:
            retiring.join(timeout=self.cfg.timeout_s)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # aborted by a re-formation: nothing left to destroy
                pass
        self._groups.clear()
