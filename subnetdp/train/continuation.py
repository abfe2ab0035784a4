"""Going on in-process after a peer dies (``launch.on_failure=continue``; docs/inprocess.md).

The workers run under subnetdp's supervisor, which restarts nobody. When a collective fails because a
peer died (or stopped answering), every survivor calls :func:`go_on`: the survivors agree on who goes
on and from which step (the communicator's ``regroup``), the world and its owner groups are formed
again among them, and the training state re-plans through its one path (``TrainState.regroup``):

- **units**: ``plan.without(members, masker.min_owners)``: every unit keeps its surviving owners, a unit
  left below ``masker.min_owners`` gains the survivor with the fewest units, which receives the unit's
  values and optimizer state from a surviving owner over the network (never from disk);
- **buffers** (BatchNorm statistics): each piece the mean of its surviving owners' copies;
- **data**: the sampler is split again over the survivors at the step they all finished, by samples
  seen, and every rank re-seeds from ``seed + step``; the global batch becomes the survivors' batches;
- **learning rate and optimizer**: carried over unchanged.

These are the rules of a resume from the survivors' files on exactly the survivors
(:meth:`~subnetdp.train.checkpoints.checkpointer.Checkpointer.start`), so going on in-process from
step S trains the same values, bit for bit, as writing the survivors' files at S and restarting on
them. When a rule cannot hold (the survivors stand one step apart, a unit lost every owner, local steps,
FSDP shards, re-drawn plans, backward masking), the survivors take today's path: they write their
files and leave, and a restart resumes from them.

Everything that crosses the network happens before the state changes (:func:`_reform`): another death
amid the re-formation leaves every survivor at the step they all finished, and they agree again
without it (docs/inprocess.md, "A second death during the re-formation").
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from subnetdp.core.contracts import RunContext
from subnetdp.core.errors import PeerLost, SubnetdpError
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.pieces import LocalIndex, global_items
from subnetdp.sdp.variants import regime_of
from subnetdp.train import faults
from subnetdp.train.checkpoints import units
from subnetdp.train.stateful import local_names

if TYPE_CHECKING:
    from subnetdp.train.checkpoints.checkpointer import Checkpointer
    from subnetdp.train.state import Holding, TrainState


@dataclasses.dataclass(frozen=True)
class Continued:
    """What the loop needs to go on after :func:`go_on`: the context in the survivors' numbering, the
    step every survivor finished, the loader position as it ended in the old world, and what it cost."""

    context: RunContext
    step: int
    position: dict[str, int]
    old_world: int
    members: tuple[int, ...]
    seconds: float
    gained: int  # pieces that moved to a new owner over the network
    run: Any = None  # a newcomer's: the run id and lineage it goes on with, as ``Checkpointer.adopt`` reads them
    said: Any = None  # a join's: what every rank tells the next world's reporter (``Reporter.said``), in rank order


class Handover(NamedTuple):
    """What the next world's checkpointer adopts of the last one's (``Checkpointer.adopt``): the run goes
    on under its id and lineage, with the losses no row holds yet and the last checkpoint it saved."""

    run_id: str
    lineage: list[dict[str, Any]]
    unlogged: Any  # checkpoints.unlogged.Unlogged
    last_saved: Any  # Path | None

    @classmethod
    def of(cls, ckpt: Any) -> "Handover":
        return cls(ckpt.run_id, ckpt.lineage, ckpt.unlogged, ckpt.last_saved)


class WentOn(Exception):
    """The world was re-formed in-process (a death, or a join): the loop trains on from ``continued``.

    ``ckpt``: the checkpointer whose run the next world's adopts (its :class:`Handover` is all that is
    kept: the checkpointer itself holds the segment's model, which the loop would otherwise keep alive
    beside the new one for the whole next segment); ``counted``: what the reporter and meter of the world
    before counted (``report.Counted``: what was consumed, bytes by owner group in worker ids); ``full``:
    the W-rank plan the job had before any death (a join returns to it)."""

    def __init__(self, continued: Continued, ckpt: Any, counted: Any, full: MaskPlan) -> None:
        super().__init__(f"going on from step {continued.step}")
        self.continued, self.ckpt, self.counted, self.full = continued, Handover.of(ckpt), counted, full

    def without_frames(self) -> "WentOn":
        """This, without the frames it was raised through (and the failure it was raised from): they
        hold the segment's locals, among them the model the re-plan replaced, which the loop would
        otherwise keep alive (its values and optimizer state) for the rest of the run."""
        self.__traceback__ = self.__context__ = self.__cause__ = None
        return self


def why_not(ctx: RunContext, state: "TrainState", ckpt: "Checkpointer") -> Optional[str]:
    """Why this run cannot go on in-process (None: it can). The same on every rank but the last item."""
    cfg = ctx.cfg
    if not getattr(ctx.comm, "can_regroup", False):
        return "the workers do not run under subnetdp's supervisor (launch.on_failure=continue)"
    if state.synchronizer.owners_diverge:
        return "owners' copies differ between synchronisations (sync.mode=local_steps)"
    if state.parallel.sharded:
        return "fsdp.shard_size > 1"
    if cfg.masker.resample_every > 0:
        return f"masker.resample_every={cfg.masker.resample_every}"
    if regime_of(cfg.masker).refreshes:
        return "backward masking (every rank holds every unit)"
    if ckpt.boundary is None:
        return "no step had finished yet"
    return None


class _Copies:
    """One old rank's buffer copies, as :func:`units.read_buffer_mean` reads a rank's file."""

    def __init__(self, rank: int, tensors: dict[str, torch.Tensor]) -> None:
        self.path, self.tensors = f"rank {rank}'s buffers (in memory)", tensors

    def get(self, key: str) -> torch.Tensor:
        return self.tensors[key]


class LiveReader:
    """The survivors' pieces in memory, read as :class:`units.PieceReader` reads a checkpoint's files.

    ``pieces``: this rank's own pieces under the renumbered plan (values and optimizer state, keyed as
    a checkpoint keys them), to which :meth:`exchange` adds the pieces it gains; ``buffers``: its own
    buffer copies, to which :meth:`exchange` adds the co-owners' copies it needs for their mean.
    """

    def __init__(self, rank: int, pieces: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        self.rank, self.pieces = rank, {}
        self.names: dict[str, list[str]] = {}  # piece key -> its value's and its optimizer state's names
        for name, t in pieces.items():
            self._add(name, t)
        # What load_pieces may take as it is: views of this rank's live tensors, and the optimizer state it
        # receives whole in a message of its own (``exchange``: nothing else is in that buffer).
        self.lendable = set(self.pieces)
        self.copies: dict[int, dict[str, torch.Tensor]] = {rank: dict(buffers)}
        self.moved = 0  # bytes every rank sent in the last exchange, the same figure on every rank

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.pieces:
            self.names.setdefault(name.split("/", 1)[-1], []).append(name)
        self.pieces[name] = tensor

    def get(self, key: str, prefix: str = "", shape: Any = None, rank: Any = None, dtype: Any = None) -> torch.Tensor:
        return self.pieces[prefix + key]

    def lends(self, key: str, prefix: str = "") -> bool:
        """Whether :func:`units.load_pieces` may take this tensor as it is rather than copy it: a view of
        this rank's own optimizer state, which the re-plan drops, or of a message that holds only whole
        tensors' optimizer state (any other received tensor is a view of a buffer it would keep alive)."""
        return prefix + key in self.lendable

    def kinds(self, key: str, rank: Any = None) -> dict[str, set[str]]:
        found = {n.split("/", 1)[0] for n in self.names.get(key, ()) if "/" in n}
        return {"optim": {k[len(units.OPTIM):] for k in found if k.startswith(units.OPTIM)},
                "scalar": {k[len(units.SCALAR):] for k in found if k.startswith(units.SCALAR)},
                "extra": set()}

    def rank_buffers(self, rank: int) -> _Copies:
        return _Copies(rank, self.copies.setdefault(rank, {}))

    def file_of(self, key: str, rank: Any = None) -> Any:
        return _Copies(self.rank, {})

    def exchange(self, state: "TrainState", before: MaskPlan, after: MaskPlan, absent: Any = (),
                 also: Any = None) -> tuple[int, list[Any]]:
        """Every piece a rank gains comes from one of its surviving owners (they hold it bit for bit: the
        one with the least to send so far, so a newcomer's share comes from every member at once), and
        every buffer copy a new holder's mean needs from its owner: one message per (source, receiver)
        pair, the pieces and copies it carries packed in global order into one buffer (``_pack``), sent
        point to point. A rank that gains nothing receives nothing; a source stages at most the bytes it
        sends (one buffer per receiver); a receiver's buffer holds only what it gains, and its pieces stay
        views of it. ``absent``: ranks of ``before`` that hold nothing yet (a newcomer): they gain the
        shared tensors too and are nobody's source. ``also``: anything else every rank should see of this
        one (it rides in the gather of what the pieces hold). Returns the pieces that changed hands and
        every rank's ``also``; ``moved`` the bytes sent by all ranks. Collective: every member, with the
        same plans."""
        comm, partition, rank, absent = state.context.comm, state.partition, self.rank, set(absent)
        sends: dict[str, list[tuple[str, tuple[int, ...], str]]] = {}
        moving, load = [], {}  # load: source -> bytes of values it sends so far (the same figures on every rank)
        for it in global_items(partition, before):
            owners = [r for r in it.owners if r not in absent]
            gainers = set(after.owners(it.unit)) - set(owners) if it.unit is not None else absent
            if not gainers:
                continue
            key, src = units.item_key(it), min(owners, key=lambda r: (load.get(r, 0), r))
            load[src] = load.get(src, 0) + _span(it.shape, partition.dtypes[it.name]) * len(gainers)
            # Whole: the receiver keeps its optimizer state as it arrives (lane 1 of the messages, below).
            moving.append((key, src, sorted(gainers), tuple(it.shape) == tuple(partition.shapes[it.name])))
            if rank == src:
                sends[key] = [(n, tuple(self.pieces[n].shape), str(self.pieces[n].dtype).removeprefix("torch."))
                              for n in self.names.get(key, ())]
        gathered = comm.all_gather_object((sends, also))  # collective: what each source's pieces hold
        table: dict[str, Any] = {k: v for part, _ in gathered for k, v in part.items()}
        messages = _Messages(rank)
        for key, src, gainers, whole in moving:
            for name, shape, dtype in table[key]:
                # A whole tensor's optimizer state travels in a message of its own (lane 1), which the
                # receiver's optimizer keeps as it is: no copy into new memory, no other bytes kept alive.
                lane = int(whole and name.startswith(units.OPTIM))
                for dst in gainers:
                    messages.add(src, dst, ("piece", name, lane), shape, getattr(torch, dtype),
                                 lambda n=name: self.pieces[n], lane)
        for it in global_items(partition, before, buffers=True):
            holders = set(after.owners(it.unit)) if it.unit is not None else set(it.owners)
            owners = [r for r in it.owners if r not in absent]
            # The mean of float buffers reads every owner's copy, an integer buffer the lowest owner's.
            sources = owners if partition.dtypes[it.name].is_floating_point else owners[:1]
            key = units.item_key(it)
            for src in sources:
                for dst in sorted(holders - {src}):  # only a holder other than the source reads this copy
                    messages.add(src, dst, ("copy", src, key), it.shape, partition.dtypes[it.name],
                                 lambda k=key: self.copies[rank][k])
        for tag, t in messages.swap(comm):  # collective: every source and every receiver of a piece or a copy
            if tag[0] == "piece":
                self._add(tag[1], t)
                if tag[2]:
                    self.lendable.add(tag[1])
            else:
                self.copies.setdefault(tag[1], {})[tag[2]] = t
        self.moved = messages.nbytes
        return len(moving), [a for _, a in gathered]


_ALIGN = 64  # bytes: each packed tensor starts aligned, so a view of it in the buffer has any dtype's alignment


def _span(shape: Any, dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


class _Messages:
    """The messages of one exchange, as every rank computes them alike (same plans, same table): per
    (source, receiver) pair and lane, its tensors in global order. This rank packs what it sends into one
    buffer per receiver and lane and receives one buffer per source and lane; the received tensors are
    views of it. Lane 1 holds whole tensors' optimizer state alone (its receiver keeps it as it is)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.nbytes = rank, 0
        self.out: dict[tuple[int, int], list[Any]] = {}  # (receiver, lane) -> tensors to send (read when packed)
        self.into: dict[tuple[int, int], list[tuple[Any, Any, torch.dtype, int]]] = {}  # (source, lane) -> (tag, shape, dtype, offset)
        self.size: dict[tuple[int, int], int] = {}  # (source, lane) -> bytes of the buffer received from it

    def add(self, src: int, dst: int, tag: Any, shape: Any, dtype: torch.dtype, read: Any, lane: int = 0) -> None:
        span = _span(shape, dtype)
        self.nbytes += span
        if self.rank == src:
            self.out.setdefault((dst, lane), []).append(read)
        if self.rank == dst:
            at = self.size.get((src, lane), 0)
            self.into.setdefault((src, lane), []).append((tag, tuple(shape), dtype, at))
            self.size[(src, lane)] = at + -(-span // _ALIGN) * _ALIGN

    def swap(self, comm: Any) -> list[tuple[Any, torch.Tensor]]:
        """Send and receive every message (collective: every rank in a pair); the received tensors, in order."""
        staged = {to: _pack([read() for read in reads], comm.device) for to, reads in self.out.items()}
        buffers = {by: torch.empty(n, dtype=torch.uint8, device=comm.device) for by, n in self.size.items()}
        if staged or buffers:
            comm.send_recv(staged, buffers)  # collective: the ranks of every pair; the lane is the message's tag
        staged.clear()  # a source's staging goes before anything else is built
        got = []
        for src, items in sorted(self.into.items()):
            for tag, shape, dtype, at in items:
                got.append((tag, buffers[src][at:at + _span(shape, dtype)].view(dtype).reshape(shape)))
        return got


def _pack(tensors: list[torch.Tensor], device: Any) -> torch.Tensor:
    spans = [t.numel() * t.element_size() for t in tensors]
    flat = torch.empty(sum(-(-n // _ALIGN) * _ALIGN for n in spans), dtype=torch.uint8, device=device)
    at = 0
    for t, n in zip(tensors, spans):
        flat[at:at + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        at += -(-n // _ALIGN) * _ALIGN
    return flat


class SurvivorsPieces:
    """The survivors as a :class:`~subnetdp.train.state.PieceSource`: this rank's pieces as the step
    every survivor finished ended, and its co-owners' over the re-formed world.

    ``absent``: ranks that join with nothing (newcomers, :mod:`subnetdp.train.rejoin`). Then the
    step, the optimizer's hyper-parameters, the schedule and the loader position travel too, from the
    lowest member that holds them (``step=None``: this rank is a newcomer and holds none).
    """

    trained_rates = None  # the values were trained under the plan before the change

    def __init__(self, reader: LiveReader, before: MaskPlan, step: Optional[int], state: "TrainState",
                 absent: tuple[int, ...] = (), position: Optional[dict[str, int]] = None,
                 run: Optional[dict[str, Any]] = None, said: Any = None) -> None:
        self.reader, self.before, self.step, self.gained = reader, before, step, 0
        self.absent, self.position, self.run = absent, position, run  # run: the checkpoints' run id and lineage
        self.said: Any = said  # what this rank tells the next world's reporter; after fetch, every rank's
        self.fetched = False
        # What the old optimizer and schedule carry over (hyper-parameters, the schedule's position);
        # each parameter's state comes with its pieces.
        old = state.stateful()
        self.optimizer = {k: v for k, v in old["optimizer"].state_dict().items() if k != "params"}
        self.schedule = old["scheduler"].state_dict() if old["scheduler"] is not None else None

    def fetch(self, state: "TrainState", after: MaskPlan) -> None:
        """Everything that crosses the network, before the state changes (a join calls it first, so a
        newcomer lost in the middle leaves the members' state as it was). Collective: every member."""
        if self.fetched:
            return
        comm = state.context.comm
        with comm.bytes.phase("heal"):
            # A join's newcomer also learns where the run stands, from the members' (all alike).
            mine = None if not self.absent or self.step is None else (self.step, self.optimizer, self.schedule,
                                                                          self.position, self.run)
            # collective; what the next world's reporter needs of every rank rides along (a join's)
            self.gained, theirs = self.reader.exchange(state, self.before, after, self.absent, also=(mine, self.said))
            if self.absent:
                self.step, self.optimizer, self.schedule, self.position, self.run = next(m for m, _ in theirs if m is not None)
            self.said = [said for _, said in theirs] if all(said is not None for _, said in theirs) else None
        self.fetched = True

    def load(self, state: "TrainState", previous: Optional["Holding"]) -> int:
        reader, rank = self.reader, state.context.comm.rank
        self.fetch(state, state.plan)  # collective unless fetched before
        assert self.step is not None
        present = [r for r in range(self.before.world_size) if r not in self.absent] if self.absent else None
        states = state.stateful()
        with torch.no_grad():
            index = LocalIndex(state.model, state.pmap)
            optim_state, outer = units.load_pieces(reader, rank, state.partition, state.plan, index)  # type: ignore[arg-type]
            units.load_buffers(reader, rank, state.partition, state.plan, index, self.before, own=False,  # type: ignore[arg-type]
                               present=present)
            states["sync"].load_state_dict({"step": self.step, "pieces": outer, "rank": {}})
        states["optimizer"].load_state_dict({**self.optimizer, "params": optim_state})
        if self.schedule is not None:
            states["scheduler"].load_state_dict(self.schedule)
        return self.step



def held_pieces(state: "TrainState", rank: int, plan: MaskPlan) -> tuple[dict, dict]:
    """The pieces (values and optimizer state, per owner) and buffers ``rank`` holds under ``plan``, as
    views of the live model and optimizer: what a :class:`LiveReader` serves when the world changes."""
    index = LocalIndex(state.model, state.pmap)
    params = [p for g in state.optimizer.param_groups for p in g["params"]]
    optim_state = {n: state.optimizer.state[p] for n, p in zip(local_names(state.model, state.optimizer), params)}
    pieces = units.pieces_to_write(rank, state.partition, plan, index, {}, optim_state, per_owner=True)
    return pieces, units.buffers_to_write(rank, state.partition, plan, index)

class _CannotGoOn(Exception):
    """The survivors agreed, but cannot go on in-process (the message says why): today's path."""


def _reform(ctx: RunContext, state: "TrainState", last: int, origin: tuple[int, ...],
            plan: MaskPlan) -> tuple[Any, ...]:
    """Every network part of going on, before the state changes: the agreement and the world
    (``comm.regroup``), the owner groups of the new plan, and the heal's messages. A death amid them
    leaves this survivor's state as it was at ``last``, so the survivors can agree again without the
    dead (the same discipline as a join's ``rejoin._meet``). Collective among the survivors.

    Returns ``(membership, before, after, source)``. Raises :class:`_CannotGoOn` when the survivors
    agreed but cannot go on, :class:`SubnetdpError` when this survivor was left out, and
    :class:`PeerLost` or ``RuntimeError`` when another member was lost on the way.
    """
    comm, cfg, worker = ctx.comm, ctx.cfg, origin[ctx.comm.rank]
    faults.reform_fault(last, worker, "agree", ctx.run_dir)  # test-only
    m = comm.regroup(last)  # collective: every survivor agrees on the members and the step
    if not m.consistent:
        raise _CannotGoOn(f"the survivors finished different steps {dict(zip(m.members, m.last_steps))} "
                          "(a death inside the step's last collective)")
    try:
        ranks = [origin.index(i) for i in m.members]  # the members as ranks of the plan as it stands
        before = plan.without(ranks)
        after = plan.without(ranks, cfg.masker.min_owners)
    except (SubnetdpError, ValueError) as e:
        raise _CannotGoOn(str(e)) from None
    # collective: the survivors prove they stand on the same plan. They can differ only when a death ended
    # the last re-formation after some of them had finished it and re-planned: going on from two plans
    # would pair pieces that do not match.
    plans = comm.all_gather_object(before.digest())
    if len(set(plans)) != 1:
        raise _CannotGoOn(f"the survivors hold different plans ({dict(zip(m.members, plans))}: a death ended "
                          "the last re-formation after some of them had re-planned)")
    faults.reform_fault(last, worker, "groups", ctx.run_dir)  # test-only
    for group in sorted(after.owner_sets()):
        comm.new_group(group)  # collective: every member of the group (the re-plan finds them made)
    faults.reform_fault(last, worker, "heal", ctx.run_dir)  # test-only
    # Views of the old model and optimizer, alive until the new model is filled.
    source = SurvivorsPieces(LiveReader(m.rank, *held_pieces(state, m.rank, before)), before, last, state)
    source.fetch(state, after)  # collective: the messages carrying every piece that gains an owner
    return m, before, after, source


def go_on(ctx: RunContext, state: "TrainState", ckpt: "Checkpointer", lost: PeerLost,
          plan: Optional[MaskPlan] = None) -> Continued | PeerLost:
    """Re-form the world without the lost ranks and re-plan the state in it, or (one line says why) the
    error to take today's path with. Collective among the survivors. ``plan``: the state's plan in the
    communicator's numbering, when they differ (a failed join's world of W: the newcomer's slot holds nothing).

    Another death amid the re-formation (the agreement, the world, the owner groups, the heal's
    broadcasts) finds the state unchanged (:func:`_reform` changes nothing): the survivors agree again,
    a new generation without the dead, and go on when every unit still has an owner. Returned errors
    name the ranks the state's plan knows dead (none after a second death: who it was is not known in
    the plan's numbering, so every survivor keeps every piece it holds)."""
    start = time.monotonic()
    reason = why_not(ctx, state, ckpt)
    if reason is not None:
        if getattr(ctx.comm, "can_regroup", False):
            print(f"subnetdp: rank {ctx.rank}: not going on in-process: {reason}", flush=True)
        return lost
    comm = ctx.comm
    last, ended = ckpt.rewind()  # the step every survivor finished here, its buffers as it ended
    position = ended[0] if ended is not None else ckpt.loader.state_dict()
    old_world, old_rank = comm.world_size, comm.rank
    origin = tuple(getattr(comm, "origin", range(old_world)))  # worker ids of today's ranks (a replacement's is new)
    leave_with, tries = lost, []
    # Each failed re-formation leaves at least the dead out of the next: at most one try per member.
    for _ in range(old_world - 1):
        try:
            m, before, after, source = _reform(ctx, state, last, origin, plan or state.plan)
            break
        except _CannotGoOn as e:
            print(f"subnetdp: rank {old_rank}: not going on in-process: {e}", flush=True)
            return leave_with
        except PeerLost as e:  # before SubnetdpError: a PeerLost is one
            tries.append(e)
        except SubnetdpError as e:  # left out by the agreement (it stalled), or no supervisor's store
            print(f"subnetdp: rank {old_rank}: not going on in-process: the survivors did not re-form ({e})",
                  flush=True)
            return leave_with
        except RuntimeError as e:  # a process group that did not form: a member gone meanwhile
            tries.append(e)
        print(f"subnetdp: rank {old_rank}: another worker was lost while the survivors re-formed the world to go on "
              f"from step {last} ({tries[-1]}); the survivors agree again without it (re-formation "
              f"{len(tries) + 1})", flush=True)
        leave_with = PeerLost(f"{lost}, then another worker during the re-formation ({tries[-1]})")
    else:
        print(f"subnetdp: rank {old_rank}: not going on in-process: {len(tries)} re-formations failed", flush=True)
        return leave_with
    new_ctx = dataclasses.replace(ctx, env=comm.env)
    state.regroup(new_ctx, before, after, source)  # no network left: the groups are made, the pieces here
    seconds = time.monotonic() - start
    if m.rank == 0:
        again = f", after {len(tries)} re-formation(s) that lost another worker" if tries else ""
        print(f"subnetdp: {lost}; the {m.world_size} survivors (old ranks {list(m.members)}) go on in-process "
              f"from step {last}: {source.gained} piece(s) gained an owner over the network "
              f"({source.reader.moved / 2**20:.2f} MiB of values, optimizer state and buffers sent), "
              f"re-formed in {seconds:.2f} s{again}",
              flush=True)
    return Continued(new_ctx, last, dict(position), old_world, m.members, seconds, source.gained)


def position_in(continued: Continued, loader: Any, batch_size: int) -> dict[str, int]:
    """The new world's loader position: the old one carried over by samples seen, as a resume on another
    world size carries it (:func:`units.carry_position`)."""
    return units.carry_position(continued.position, (continued.old_world, batch_size),
                                (continued.context.comm.world_size, batch_size), loader.batches_per_epoch)
