"""A replacement rejoins the survivors: the world grows back to W (``launch.replace``; docs/inprocess.md).

After a death the supervisor (``launchers/supervisor.py``) starts a replacement in the dead worker's
place. It announces itself in the job's store and waits; the members look for it at every step
boundary (one store ``check``) and agree, all of them, on the boundary they take it in at
(:func:`~subnetdp.plugins.comm.regroup.join_decision`). There the world and every owner group are
formed again with the newcomer under the join's own store prefix, and the state re-plans through its
one path (``TrainState.regroup``) back to the W-rank plan the job had before the death:

- **units**: the newcomer holds exactly the units of the rank it replaces; every unit it owns comes
  from one of the unit's current owners, values and optimizer state, point to point (never from disk),
  and the shared tensors from the members. A unit that gained an owner at W-1
  (``masker.min_owners``) loses it again: the W-rank plan is the one every unit was trained under
  before the death, so the run is again the job it was (a stop at the join step resumed at W);
- **buffers**: each piece the mean of its current owners' copies, on every holder alike;
- **data**: the sampler is split again over W by samples seen, every rank re-seeds from
  ``seed + step``; the newcomer receives the step, the schedule, the optimizer's hyper-parameters and
  the loader position from the lowest member.

The newcomer builds its model on ``meta`` (set-up), so every tensor it trains with came over the network
(one left unfilled is an error: ``TrainState``'s poison check).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Optional

from subnetdp.core.contracts import RunContext
from subnetdp.core.errors import PeerLost, SubnetdpError
from subnetdp.core.plan import MaskPlan
from subnetdp.train import faults
from subnetdp.train.checkpoints.unlogged import Unlogged
from subnetdp.train.continuation import Continued, Handover, LiveReader, SurvivorsPieces, WentOn, held_pieces

if TYPE_CHECKING:
    from subnetdp.train.checkpoints.checkpointer import Checkpointer
    from subnetdp.train.state import TrainState


def warm_up(cfg: Any, rank: int, world_size: int, data: Any, adapter: Any, spec: Any, partition: Any,
            plan: MaskPlan, device: Any) -> None:
    """A replacement's one-time costs, paid before it announces itself rather than while the members
    wait for its first step: reading the data set, a fresh process's first forward and backward
    (2-6 s here, measured) and the reporter's imports. Nothing of it is kept; the host RNGs are
    re-seeded at the join."""
    import torch
    import torch.utils.tensorboard  # noqa: F401  (the reporter's first import: 0.2 s, measured)

    from subnetdp.sdp.construct import empty_local

    batch = next(iter(data.train_loader(rank, world_size, cfg.train.batch_size)))
    model, _ = empty_local(adapter, spec, plan.owned[rank], partition, cfg.masker, device)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.zero_()
    model.train()
    adapter.training_loss(model, tuple(t.to(device) for t in batch)).backward()


def with_newcomer(plan: MaskPlan, slot: int) -> MaskPlan:
    """``plan`` at W-1 as it stands, numbered at W: the newcomer at ``slot`` holds nothing yet."""
    return MaskPlan(plan.world_size + 1, [*plan.owned[:slot], [], *plan.owned[slot:]], plan.num_units)


def join_due(ctx: RunContext, state: "TrainState", step: int, full: MaskPlan) -> dict[str, Any] | None:
    """The join every member makes at the boundary after ``step``, or None (no replacement waits).

    Only a world one short of the W-rank plan grows back; the proposal carries the plan as it stands and
    the W-rank plan, so the newcomer iterates the same pieces as the members and builds the plan they
    return to (not its config's: a job resumed on another plan returns to that one)."""
    due = getattr(ctx.comm, "join_due", None)
    if due is None:
        return None
    can_grow = ctx.comm.world_size == full.world_size - 1
    faults.await_join(step, ctx.comm.join_waiting, ctx.cfg.comm.timeout_s)  # test-only
    return due(step, ctx.steps, can_grow, {"plan": state.plan.owned, "full": full.owned})


class JoinFailed(PeerLost):
    """The world could not grow (the newcomer or a member was lost during the join): the members' state
    is as it was at the join step, and they go on in-process without the newcomer as after a death
    (``continuation.go_on``), or take the restart path when they cannot. ``plan``: the state's plan in the
    communicator's numbering now (the world of W, the newcomer's slot holding nothing, once it formed)."""

    def __init__(self, message: str, lost: Any, plan: MaskPlan) -> None:
        super().__init__(message, lost)
        self.plan = plan


def _meet(ctx: RunContext, source: SurvivorsPieces, full: MaskPlan, state: "TrainState", step: int) -> None:
    """Every network part of a join, before any state changes: the owner groups of ``full`` (made here,
    in one order, so the re-plan finds them made), then the heal's messages. Collective: every member
    and the newcomer."""
    for ranks in sorted(full.owner_sets()):
        ctx.comm.new_group(ranks)  # collective: every member of the group
    faults.fault_point(faults.KILL_IN_JOIN, step, ctx.rank, ctx.run_dir)  # test-only
    source.fetch(_Renumbered(ctx, state), full)  # collective: the messages carrying every piece the newcomer gains


class _Renumbered:
    """What :meth:`LiveReader.exchange` reads of the training state, in the grown world's numbering
    (the state itself still stands in the old one until the re-plan)."""

    def __init__(self, ctx: RunContext, state: "TrainState") -> None:
        self.context, self.partition = ctx, state.partition


def grow(ctx: RunContext, state: "TrainState", ckpt: "Checkpointer", decided: dict[str, Any],
         full: MaskPlan, said: Any = None) -> Continued:
    """A member: take the newcomer in at this boundary and go back to the W-rank plan ``full``. ``said``:
    what this rank tells the next world's reporter (``Reporter.said``), carried by the heal's gather.
    Collective: every member and the newcomer. Raises :class:`JoinFailed` (one line) when it could not."""
    start, comm = time.monotonic(), ctx.comm
    old_world, slot, step = comm.world_size, int(decided["slot"]), int(decided["step"])
    before = with_newcomer(state.plan, slot)
    try:
        m = comm.grow(decided)  # collective: the world of W under the join's own prefix
        new_ctx = dataclasses.replace(ctx, env=comm.env)
        position = dict(ckpt.loader.state_dict())
        reader = LiveReader(m.rank, *held_pieces(state, m.rank, before))
        source = SurvivorsPieces(reader, before, step, state, absent=(slot,), position=position,
                                 run={"run_id": ckpt.run_id, "lineage": ckpt.lineage}, said=said)
        _meet(new_ctx, source, full, state, step)  # collective
    except (PeerLost, SubnetdpError, RuntimeError) as e:
        lost = e.lost if isinstance(e, PeerLost) else []
        print(f"subnetdp: rank {ctx.rank}: the replacement for rank {slot} did not join after step {step} ({e}); "
              "the members keep their state of that step and go on without it", flush=True)
        # The world of W formed (the communicator answers its numbering) or it did not (the old one's).
        plan = before if comm.world_size == old_world + 1 else state.plan
        raise JoinFailed(f"a join after step {step} failed: {e}", lost, plan) from e
    state.regroup(new_ctx, before, full, source)  # no network left: the groups are made, the pieces here
    seconds = time.monotonic() - start
    if m.rank == 0:
        print(f"subnetdp: a replacement joined as rank {slot} after step {step}: the world is {m.world_size} again "
              f"(the plan it had before the death); {source.gained} piece(s) sent to it over the network "
              f"({source.reader.moved / 2**20:.2f} MiB of values, optimizer state and buffers), "
              f"in {seconds:.2f} s", flush=True)
    return Continued(new_ctx, step, position, old_world, m.members, seconds, source.gained, said=source.said)


def grown(ctx: RunContext, state: "TrainState", ckpt: "Checkpointer", decided: dict[str, Any], full: MaskPlan,
          reporter: Any) -> WentOn:
    """A member's join after the step just trained (:func:`grow`), as the loop raises it: the next world
    goes on from it with what this world's ``reporter`` counted. Collective: every member and the newcomer."""
    counted = reporter.counted(ctx, state.step)
    return WentOn(grow(ctx, state, ckpt, decided, full, reporter.said(counted, ckpt, state)), ckpt, counted, full)


def join(ctx: RunContext, state: "TrainState") -> Optional[Continued]:
    """The newcomer (its communicator joined the world at set-up, its model is on ``meta``): receive
    every piece it owns under the W-rank plan, and where the run stands, from the members. None for
    any other worker. Collective: with every member's :func:`grow`."""
    start, comm = time.monotonic(), ctx.comm
    decided = getattr(comm, "joined", None)
    if decided is None:
        return None
    comm.arrive()  # collective: the world of W, with the members' grow
    slot = int(decided["slot"])
    before = with_newcomer(MaskPlan(comm.world_size - 1, decided["plan"], state.plan.num_units), slot)
    # It tells the reporters nothing (it consumed nothing, owes no loss): the members' counts go on.
    source = SurvivorsPieces(LiveReader(comm.rank, {}, {}), before, None, state, absent=(slot,), said=(None, []))
    _meet(ctx, source, state.plan, state, int(decided["step"]))  # collective: with the members' _meet
    state.regroup(ctx, before, state.plan, source)
    assert source.step is not None and source.position is not None and source.run is not None
    # What Checkpointer.adopt takes of the members' checkpointer: the run goes on under its id and lineage.
    run = Handover(source.run["run_id"], source.run["lineage"], Unlogged(), None)
    return Continued(ctx, source.step, source.position, comm.world_size - 1, comm.origin,
                     time.monotonic() - start, source.gained, run, source.said)
