"""What a unit-keyed checkpoint holds (format 2): pieces, who writes them, and how a rank cuts its
tensors and optimizer state into pieces and fills them back, under any plan.

A *piece* is a parameter as the partition cuts it: a shared tensor whole, or one unit's slice of a
tensor (``name@dim:start:stop``; a block-level unit's tensors are whole). Its key never depends on
a rank's local layout (a rank holding neuron units 2 and 3 of a layer side by side in one narrower
tensor still writes two pieces), so a rank of any plan over the same partition finds every piece it
needs. Each piece is written once, with its optimizer state cut the same way
(``optim.exp_avg/KEY``, ``optim.momentum_buffer/KEY``; per-tensor scalars such as AdamW's step as
``optim_scalar.step/KEY``) and any local-steps outer state (``outer_anchor/KEY``,
``outer_momentum/KEY``). :func:`writers` chooses the writer among the piece's owners: largest
pieces first, each to the owner that has written the fewest bytes so far, so no rank writes much
more than 1/W of the model (shared tensors spread over all ranks).

With ``sync.mode=local_steps`` owners' copies differ (they train apart between synchronisations,
and their inner optimizer state is never averaged), so there every owner writes its own copy of
every piece it holds, the index lists the copies, and a resume with the same plan reads its own.

Resuming on another world size, coverage or masker (a *re-planned* resume) is the same code: the
new plan is made and validated as for a fresh run, then

- parameters, optimizer state and outer state: each rank reads exactly the pieces of its new units
  and of the shared tensors, from the files the manifest's index names (bit for bit the saved values;
  under local steps, the lowest-ranked old owner's copy);
- buffers (BatchNorm running statistics, per rank as in DDP): a rank whose plan and world size are
  the checkpoint's reads its own copy back; otherwise each buffer piece gets the mean of its old
  owners' copies (float buffers, summed in rank order then divided, as the union model's) or the
  lowest-ranked old owner's (integer buffers: ``num_batches_tracked``);
- step, learning-rate schedule and optimizer hyper-parameters carry over (every rank holds the same);
- the data position carries over by samples seen (:func:`carry_position`): the epoch, and within it
  the number of samples the whole world has drawn;
- RNG states: a rank of the same world size gets its own back; with another world size every rank
  re-seeds from ``seed + step`` (an old rank's stream has no counterpart in the new world).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from subnetdp.core.contracts import Partition
from subnetdp.core.errors import CheckpointError
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.pieces import Item, LocalIndex, global_items, item_key, piece_key  # noqa: F401 (their old home)
from subnetdp.train.checkpoints import files as ck

OPTIM = "optim."  # optimizer state of the piece's shape, cut like the parameter
SCALAR = "optim_scalar."  # per-tensor optimizer state (AdamW's step): stored whole with every piece


def partition_digest(partition: Partition) -> str:
    """A hash of how the model is cut into units and shared tensors: a resume must keep it."""
    units = [[u.id, [[s.name, s.dim, s.start, s.stop] for s in u.slices + u.buffers]] for u in partition.units]
    payload = json.dumps({"g": partition.granularity, "u": units, "s": partition.shared,
                          "b": partition.shared_buffers}, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _nbytes(it: Item, partition: Partition) -> int:
    return it.numel * partition.dtypes[it.name].itemsize


def writers(partition: Partition, plan: MaskPlan) -> dict[str, int]:
    """Piece key -> the rank that writes it: one of its owners, the bytes spread evenly.

    A pure function of the partition and the plan, so every rank (and the manifest) agrees on it.
    """
    items = global_items(partition, plan)
    load = [0] * plan.world_size
    out: dict[str, int] = {}
    for it in sorted(items, key=lambda it: -_nbytes(it, partition)):  # stable: ties keep the partition's order
        rank = min(it.owners, key=lambda r: (load[r], r))
        load[rank] += _nbytes(it, partition)
        out[item_key(it)] = rank
    return out


def piece_index(partition: Partition, plan: MaskPlan, per_owner: bool = False) -> dict[str, dict[str, Any]]:
    """The manifest's index: piece key -> file, writer, unit (None = shared), shape; with
    ``per_owner`` also ``copies`` (rank -> file): every owner wrote its own copy."""
    who = writers(partition, plan)
    out = {}
    for it in global_items(partition, plan):
        key = item_key(it)
        w = min(it.owners) if per_owner else who[key]
        out[key] = {"file": ck.pieces_file(w), "writer": w, "unit": it.unit, "shape": list(it.shape)}
        if per_owner:
            out[key]["copies"] = {str(r): ck.pieces_file(r) for r in it.owners}
    return out


def _cut(t: torch.Tensor, found: tuple[str, int | None, int, int]) -> torch.Tensor:
    _, dim, start, stop = found
    return t if dim is None else t.narrow(dim, start, stop - start)


def pieces_to_write(rank: int, partition: Partition, plan: MaskPlan, index: LocalIndex,
                    extra: dict[str, dict[str, torch.Tensor]],
                    optim_state: dict[str, dict[str, Any]], per_owner: bool = False,
                    values: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The views this rank writes: its pieces' values (from ``values``, the model's Stateful
    ``state_dict()["params"]`` keyed by piece; None: cut from ``index``), outer state (``extra``: prefix
    -> local name -> tensor of the parameter's local shape) and optimizer state (local name -> state dict).

    ``per_owner``: every owner writes its own copy of every piece it holds (owners' copies differ:
    ``sync.mode=local_steps`` trains them apart between synchronisations and never averages the
    inner optimizer state); otherwise only the piece's writer does.
    """
    who = writers(partition, plan)
    out: dict[str, torch.Tensor] = {}
    for it in global_items(partition, plan):
        key = item_key(it)
        if (rank not in it.owners) if per_owner else (who[key] != rank):
            continue
        found = index.find(it)
        if found is None:  # the plan says this rank owns it: the model and the plan disagree
            raise CheckpointError(f"rank {rank} writes {key} but does not hold it (model and plan disagree)")
        local = found[0]
        param = index.tensors[local]
        out[key] = (_cut(param, found) if values is None else values[key]).detach()
        for prefix, tensors in extra.items():
            if local in tensors:
                out[prefix + key] = _cut(tensors[local].detach(), found)
        for k, v in optim_state.get(local, {}).items():
            if not isinstance(v, torch.Tensor):
                continue  # None (SGD without momentum): absent is the same state
            if v.dim() > 0 and tuple(v.shape) == tuple(param.shape):
                out[f"{OPTIM}{k}/{key}"] = _cut(v.detach(), found)
            else:
                out[f"{SCALAR}{k}/{key}"] = v.detach()
    return out


def buffers_to_write(rank: int, partition: Partition, plan: MaskPlan, index: LocalIndex,
                     values: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """This rank's own copies of the buffer pieces it owns (its ``rank_{r}.safetensors``): from
    ``values`` (the model's Stateful ``state_dict()["buffers"]``) when given."""
    if values is not None:
        return {key: t.detach() for key, t in values.items()}
    out = {}
    for it in global_items(partition, plan, buffers=True):
        found = index.find(it) if rank in it.owners else None
        if found is not None:
            out[item_key(it)] = _cut(index.tensors[found[0]].detach(), found)
    return out


class PieceValues(Mapping[str, torch.Tensor]):
    """The values of the parameter pieces a rank holds, read from a checkpoint one at a time when the
    model's Stateful asks (no second copy of the model in memory). ``expect``: key -> the view it
    fills (its shape and dtype are checked, naming the file); ``rank``: read its own copies where every
    owner wrote one (the same plan and world size), None for the writer's."""

    def __init__(self, reader: "PieceReader", expect: Mapping[str, torch.Tensor], rank: int | None) -> None:
        self.reader, self.expect, self.rank = reader, expect, rank

    def __getitem__(self, key: str) -> torch.Tensor:
        dst = self.expect[key]
        return self.reader.get(key, shape=tuple(dst.shape), rank=self.rank, dtype=dst.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.expect)

    def __len__(self) -> int:
        return len(self.expect)


class PieceReader:
    """Reads pieces by key through the manifest's index, opening (and verifying) each file once."""

    def __init__(self, ckpt: Path, manifest: dict[str, Any]) -> None:
        self.ckpt, self.manifest = Path(ckpt), manifest
        self.index: dict[str, dict[str, Any]] = manifest["pieces"]
        self._files: dict[str, ck.TensorFile] = {}
        self._kinds: dict[str, dict[str, set[str]]] = {}

    def _open(self, name: str, identity: dict[str, str]) -> ck.TensorFile:
        if name not in self._files:
            self._files[name] = ck.TensorFile(ck.verify_file(self.ckpt, name, self.manifest), self.manifest, identity)
        return self._files[name]

    def _entry(self, key: str) -> dict[str, Any]:
        entry = self.index.get(key)
        if not isinstance(entry, dict) or "file" not in entry:
            raise CheckpointError(f"{self.ckpt / ck.MANIFEST}: indexes no piece {key}: the checkpoint is from a "
                                  "different model or partition (masker.granularity, masker.units_per_layer)")
        return entry

    def file_of(self, key: str, rank: int | None = None) -> ck.TensorFile:
        """The file holding ``key``: rank ``rank``'s own copy where every owner wrote one, else the writer's."""
        entry = self._entry(key)
        copies = entry.get("copies") or {}
        if rank is not None and str(rank) in copies:
            return self._open(str(copies[str(rank)]), {"writer": str(rank)})
        return self._open(str(entry["file"]), {"writer": str(entry.get("writer"))})

    def read_into(self, key: str, dst: torch.Tensor) -> None:
        """Piece ``key``'s value read straight into ``dst`` (the writer's copy)."""
        self.file_of(key).read_into(key, dst)

    def get(self, key: str, prefix: str = "", shape: tuple[int, ...] | None = None,
            rank: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        f = self.file_of(key, rank)
        t = f.get(prefix + key)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{f.path}: tensor {prefix + key} has shape {tuple(t.shape)}, this model needs "
                                  f"{tuple(shape)}: the checkpoint is from a different model")
        # copy_ would cast silently (a float64 piece into a float32 model loses bits); `eval` refuses
        # it too, so a resume never trains on values the checkpoint does not hold.
        if dtype is not None and t.dtype != dtype:
            raise CheckpointError(f"{f.path}: piece {prefix + key} is {str(t.dtype).removeprefix('torch.')}, this "
                                  f"model holds {str(dtype).removeprefix('torch.')}: the checkpoint is from a different "
                                  "model or was edited; convert it to the model's dtype or train in its dtype")
        return t

    def kinds(self, key: str, rank: int | None = None) -> dict[str, set[str]]:
        """The optimizer state stored with piece ``key``: {"optim": {...}, "scalar": {...}, "extra": {...}}."""
        f = self.file_of(key, rank)
        if f.path.name not in self._kinds:
            table: dict[str, set[str]] = {}
            for k in f.keys():
                if "/" in k:
                    kind, piece = k.split("/", 1)
                    table.setdefault(piece, set()).add(kind)
            self._kinds[f.path.name] = table
        found = self._kinds[f.path.name].get(key, set())
        return {"optim": {k[len(OPTIM):] for k in found if k.startswith(OPTIM)},
                "scalar": {k[len(SCALAR):] for k in found if k.startswith(SCALAR)},
                "extra": {k + "/" for k in found if not k.startswith((OPTIM, SCALAR))}}

    def rank_buffers(self, rank: int) -> ck.TensorFile:
        return self._open(ck.rank_files(rank)[0], {"rank": str(rank)})


@torch.no_grad()
def load_pieces(reader: PieceReader, rank: int, partition: Partition, plan: MaskPlan, index: LocalIndex,
                own: bool = False, fill: bool = True) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
    """Copy this rank's pieces' values into its tensors (``fill=False``: not; the model's Stateful takes
    them, :class:`PieceValues`); returns the optimizer state and the
    synchroniser's per-piece state (prefix -> local name -> tensor), each assembled per local
    parameter (full local shape), for the optimizer and the synchroniser to take.

    ``own`` (same plan and world size): where every owner wrote its copy, this rank's own; otherwise
    the writer's (the lowest-ranked old owner's)."""
    mine_only = rank if own else None
    # A reader of tensors this process holds (the survivors' pieces in memory) may lend a whole tensor's
    # optimizer state as it is; a file's are copied.
    lends = getattr(reader, "lends", None)
    state: dict[str, dict[str, torch.Tensor]] = {}
    kinds_of: dict[str, set[str]] = {}
    extra: dict[str, dict[str, torch.Tensor]] = {}
    for it in global_items(partition, plan):
        if rank not in it.owners:
            continue
        key, found = item_key(it), index.find(it)
        if found is None:  # the plan says this rank owns it: the model and the plan disagree
            raise CheckpointError(f"rank {rank} owns {key} but its model does not hold it (model and plan disagree)")
        local = found[0]
        param = index.tensors[local]
        dst = _cut(param, found)
        if fill:
            src = reader.get(key, shape=tuple(dst.shape), rank=mine_only, dtype=dst.dtype)
            if not _same_memory(src, dst):  # a live reader serves a rank's own pieces as views of its tensors
                dst.copy_(src)
        kinds = reader.kinds(key, mine_only)
        for prefix in kinds["extra"]:  # a tensor of its parameter's local shape, as the synchroniser keeps it
            held_extra = extra.setdefault(prefix, {})
            if local not in held_extra:
                held_extra[local] = torch.zeros(param.shape, dtype=param.dtype)
            _cut(held_extra[local], found).copy_(reader.get(key, prefix, tuple(dst.shape), mine_only))
        held = kinds["optim"] | {SCALAR + k for k in kinds["scalar"]}
        if local in kinds_of and kinds_of[local] != held:
            raise CheckpointError(f"{reader.file_of(key, mine_only).path}: piece {key} has optimizer state {sorted(held)}, "
                                  f"another piece of the same tensor {sorted(kinds_of[local])}: corrupted")
        kinds_of[local] = held
        mine = state.setdefault(local, {})
        for k in kinds["optim"]:
            value = reader.get(key, f"{OPTIM}{k}/", tuple(dst.shape), mine_only)
            if k not in mine:
                if (lends is not None and lends(key, f"{OPTIM}{k}/") and dst.shape == param.shape
                        and value.shape == param.shape and value.dtype == param.dtype):
                    mine[k] = value  # the whole tensor's state, as the reader holds it: taken, not copied
                    continue
                mine[k] = torch.zeros(param.shape, dtype=param.dtype)
            _cut(mine[k], found).copy_(value)
        for k in kinds["scalar"]:
            if k not in mine:  # the same on every piece of a tensor
                value = reader.get(key, f"{SCALAR}{k}/", rank=mine_only)
                # The optimizer keeps it as it is: a view of a buffer it came in would keep the whole buffer alive.
                mine[k] = value if lends is not None and lends(key, f"{SCALAR}{k}/") else value.clone()
    return {n: s for n, s in state.items() if s}, extra


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.device == b.device)


@torch.no_grad()
def load_buffers(reader: PieceReader, rank: int, partition: Partition, plan: MaskPlan, index: LocalIndex,
                 old_plan: MaskPlan, own: bool, present: Sequence[int] | None = None) -> None:
    """Fill this rank's buffer pieces (:func:`buffer_values`) in place."""
    values = buffer_values(reader, rank, partition, plan, index, old_plan, own, present)
    for it in global_items(partition, plan, buffers=True):
        found = index.find(it) if rank in it.owners else None
        if found is not None:
            _cut(index.tensors[found[0]], found).copy_(values[item_key(it)])


@torch.no_grad()
def buffer_values(reader: PieceReader, rank: int, partition: Partition, plan: MaskPlan, index: LocalIndex,
                  old_plan: MaskPlan, own: bool, present: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """This rank's buffer pieces, by key: its own copies (``own``: same plan and world size), otherwise
    the mean of the old owners' copies for float buffers and the lowest old owner's for the others;
    ``present``: the old ranks that wrote their buffers (the survivors of a lost worker), None for all."""
    keep = set(range(old_plan.world_size) if present is None else present)
    old_world = tuple(sorted(keep))
    out = {}
    for it in global_items(partition, plan, buffers=True):
        found = index.find(it) if rank in it.owners else None
        if found is None:
            continue
        dst = torch.empty_like(_cut(index.tensors[found[0]], found))
        sources = (rank,) if own else (tuple(r for r in old_plan.owners(it.unit) if r in keep)
                                       if it.unit is not None else old_world)
        read_buffer_mean(reader, item_key(it), sources, dst)
        out[item_key(it)] = dst
    return out


@torch.no_grad()
def read_buffer_mean(reader: PieceReader, key: str, owners: Sequence[int], dst: torch.Tensor) -> None:
    """``dst`` = the mean of ``owners``' copies of buffer ``key`` (summed in rank order, then divided,
    as the in-run all-reduce of the union's statistics does); an integer buffer from ``owners[0]``."""
    sources = tuple(owners) if dst.dtype.is_floating_point else tuple(owners)[:1]
    value = None
    for r in sources:
        f = reader.rank_buffers(r)
        t = f.get(key)
        if tuple(t.shape) != tuple(dst.shape):
            raise CheckpointError(f"{f.path}: tensor {key} has shape {tuple(t.shape)}, this model needs "
                                  f"{tuple(dst.shape)}: the checkpoint is from a different model")
        value = t.clone() if value is None else value.add_(t)
    if len(sources) > 1:
        value /= len(sources)
    dst.copy_(value)


def carry_position(state: dict[str, Any], old: tuple[int, int], new: tuple[int, int],
                   batches_per_epoch: int | None) -> dict[str, int]:
    """The loader position of a run with ``new`` = (world size, per-rank batch) resuming one saved
    at ``old``: the same epoch, and the first batch at or before the samples the old world had drawn
    in it (``floor(batch * B * W / (B' * W'))``: at most one new global batch is drawn again);
    past the new epoch's end, the next epoch's start."""
    if set(state) != {"epoch", "batch"}:
        raise CheckpointError(f"the data loader's position {sorted(state)} is not (epoch, batch): it cannot be "
                              "carried to another world size or batch size; resume with the old ones")
    epoch, seen = int(state["epoch"]), int(state["batch"]) * old[0] * old[1]
    batch = seen // (new[0] * new[1])
    if batches_per_epoch is not None and batch >= batches_per_epoch:
        epoch, batch = epoch + 1, 0
    return {"epoch": epoch, "batch": batch}
