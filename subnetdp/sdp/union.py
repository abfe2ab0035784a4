"""The union model: every unit from one of its owners, evaluated on every rank without being assembled.

:func:`evaluate_union` (what the loop calls) streams it: :class:`StreamedUnion` keeps the full model
as a ``meta`` skeleton and fetches each unit's parameters from ``min(owners)`` just before the module
holding them runs, so no rank holds more than its own subnetwork, one block's unit parameters, the
buffers and the evaluation batch's activations. :func:`assemble_union` builds the whole union on
rank 0, for what needs it in one process: the gradient-alignment probe (it runs backward through the
union) and the lm-eval downstream tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_map

from subnetdp.core.contracts import (Communicator, DataModule, DataSpec, ModelAdapter, ParamMap, Partition,
                                     TensorSlice)
from subnetdp.sdp.pieces import Item, LocalIndex, global_items
from subnetdp.sdp.variants import regime_of
from subnetdp.sdp.branches import regularizers_off
from subnetdp.core.plan import MaskPlan


@torch.no_grad()
def assemble_union(adapter: ModelAdapter, spec: DataSpec, seed: int, partition: Partition, plan: MaskPlan,
                   model: nn.Module, pmap: ParamMap, comm: Communicator) -> nn.Module | None:
    """Rank 0 gets the full model: parameters from ``min(owners)``, float buffers averaged among owners.

    Works piece by piece (:func:`~subnetdp.sdp.pieces.global_items`), so neuron-level slices held in
    different local layouts land at their global coordinates. Collective: every rank calls it.
    Returns the union model (on CPU) on rank 0, None elsewhere. The ranks' own copies are untouched.
    """
    rank = comm.rank
    index = LocalIndex(model, pmap)
    device = next(model.parameters()).device
    union = None
    if rank == 0:
        from subnetdp.sdp.construct import meta_model, to_empty

        union = meta_model(adapter, spec)  # structure only: every tensor is filled from the owners below
        to_empty(union, "cpu")
    target: dict[str, torch.Tensor] = {}
    if union is not None:
        target = dict(union.named_parameters())
        target.update(dict(union.named_buffers()))

    def fetch(item: Item, average: bool) -> None:
        owners = item.owners
        dtype = partition.dtypes[item.name]
        mine = index.view(item).detach() if rank in owners and index.holds(item) else None
        if average:
            # collective: every rank reaches this; non-owners contribute zeros.
            buf = mine.clone() if mine is not None else torch.zeros(item.shape, dtype=dtype, device=device)
            comm.all_reduce(buf, comm.world).wait()
            buf /= len(owners)
        elif rank == 0 and mine is not None:
            buf = mine
        else:
            buf = mine.contiguous().clone() if mine is not None else torch.empty(item.shape, dtype=dtype, device=device)
            if owners[0] != 0:
                # collective: every rank reaches this for pieces rank 0 does not own.
                comm.broadcast(buf, owners[0])
        if union is not None:
            t = target[item.name]
            dst = t if item.dim is None else t.narrow(item.dim, item.start, item.stop - item.start)
            dst.copy_(buf.to(t.dtype).cpu())

    for item in global_items(partition, plan):
        fetch(item, average=False)
    for item in global_items(partition, plan, buffers=True):
        fetch(item, average=partition.dtypes[item.name].is_floating_point)
    return union


def branch_keep_rates(partition: Partition, plan: MaskPlan) -> dict[str, float]:
    """Block name -> training keep rate ``k(u) / W`` of each block-level unit held by fewer than all ranks.

    With forward masking a rank's forward runs a block only if it owns it, so ``k(u) / W`` is the
    fraction of the global batch whose forward had the block: the keep rate stochastic depth would
    call it. ``eval.block_union=rescaled`` multiplies each residual branch of the union model by it.
    """
    if partition.granularity != "block":
        return {}
    world = plan.world_size
    rates = {u.name: len(plan.owners(u.id)) / world for u in partition.units}
    return {name: r for name, r in rates.items() if r < 1.0}


def union_branch_scales(cfg: Any, partition: Partition, plan: MaskPlan) -> dict[str, float]:
    """The scales ``eval.block_union`` applies to the union model: the keep rates for ``rescaled``
    with block-level forward masking, else none (x1, neuron level, backward masking: those train
    every branch in every forward, or rescale neurons in training already)."""
    if cfg.eval.block_union != "rescaled" or not regime_of(cfg.masker).drops_branches:
        return {}
    return branch_keep_rates(partition, plan)


def scalable_branches(adapter: ModelAdapter, spec: DataSpec,
                      scales: Mapping[str, float]) -> tuple[dict[str, float], list[str]]:
    """(the scales the adapter can fold in, the blocks it cannot: it names no output layer for them).

    An adapter without :meth:`~subnetdp.ModelAdapter.branch_output_layers` (the default returns none)
    evaluates its union at x1 whatever ``eval.block_union`` says; the run's summary must say so
    rather than report a rescaled union.
    """
    if not scales:
        return {}, []
    from subnetdp.sdp.construct import meta_model

    layers = adapter.branch_output_layers(meta_model(adapter, spec))
    return ({n: float(s) for n, s in scales.items() if layers.get(n)},
            sorted(n for n in scales if not layers.get(n)))


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, batches: Any, n: int, inputs: Any) -> int:
    """Recompute BatchNorm running statistics as a plain average over ``n`` training batches.

    The statistics are those of the network that is evaluated: stochastic depth and hidden dropout
    (``model.stochastic_depth``, ``model.hidden_dropout``) are off while they are gathered, or a
    model trained with them would be evaluated on statistics of randomly thinned networks.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns or n <= 0:
        return 0
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    seen = 0
    with regularizers_off(model):
        for batch in batches:
            if seen >= n:
                break
            model(inputs(batch))
            seen += 1
    for m, mom in zip(bns, momenta):
        m.momentum = mom
    model.eval()
    return seen


def _moved(x: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)


@torch.no_grad()
def evaluate(model: nn.Module, adapter: ModelAdapter, data: DataModule, cfg: Any,
             device: torch.device | None = None) -> dict[str, float]:
    """The adapter's metrics of ``model`` on the held-out split (after BatchNorm recalibration).

    With ``device``, inputs go there and outputs come back to the host, where the batches are.
    """
    inputs = adapter.inputs if device is None else (lambda b: _moved(adapter.inputs(b), device))
    n_cal = cfg.eval.bn_recalibrate_batches
    if n_cal > 0:
        calib = data.train_loader(0, 1, cfg.train.batch_size)
        recalibrate_batchnorm(model, iter(calib), n_cal, inputs)
    model.eval()
    outputs, batches = [], []
    for i, batch in enumerate(data.eval_loader(cfg.eval.batch_size)):
        if cfg.eval.batches and i >= cfg.eval.batches:
            break
        out = model(inputs(batch))
        outputs.append(out if device is None else _moved(out, torch.device("cpu")))
        batches.append(batch)
    return adapter.metrics(outputs, batches)


# --- The union streamed from its owners ------------------------------------------------------------


@dataclass(frozen=True)
class _Fetch:
    """One collective of a streamed tensor: ``[start, stop)`` along ``dim`` (all of it for None), from
    ``src``, which holds it as the unit pieces ``parts`` (``(start, stop)`` each; its local layout
    need not keep them side by side)."""

    dim: int | None
    start: int
    stop: int
    src: int
    parts: tuple[tuple[int, int], ...]


@dataclass
class _Slot:
    """A unit parameter of the union model: where it sits in the skeleton and how it is fetched."""

    name: str
    module: nn.Module
    attr: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fetches: list[_Fetch]
    scale: float = 1.0
    idle: Any = None  # the skeleton's meta parameter, put back after the module ran


def _module_path(tensor_name: str) -> str:
    return tensor_name.rpartition(".")[0]


def _common_path(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    return ".".join(common)


def _callable_path(model: nn.Module, path: str, tensor_name: str) -> str:
    """``path``, or the child on the way to ``tensor_name`` while ``path`` is a container that never runs."""
    module = model.get_submodule(path)
    while isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        rest = _module_path(tensor_name)[len(path):].lstrip(".")
        path = f"{path}.{rest.split('.')[0]}" if path else rest.split(".")[0]
        module = model.get_submodule(path)
    return path


def _fetches(items: list[Item], shape: tuple[int, ...], name: str) -> list[_Fetch]:
    """The pieces of one tensor, dim-0 neighbours from the same source merged into one collective."""
    out: list[_Fetch] = []
    for it in sorted(items, key=lambda i: i.start):
        last = out[-1] if out else None
        # Merged only along the first dimension, where a slice is contiguous and is received in place;
        # a slice along another needs a staging buffer, which then stays one unit's piece.
        if last is not None and last.dim == it.dim == 0 and last.src == it.owners[0] and last.stop == it.start:
            out[-1] = _Fetch(it.dim, last.start, it.stop, last.src, last.parts + ((it.start, it.stop),))
        else:
            out.append(_Fetch(it.dim, it.start, it.stop, it.owners[0], ((it.start, it.stop),)))
    whole = len(out) == 1 and out[0].dim is None
    dims = {f.dim for f in out}
    if not whole and not (len(dims) == 1 and None not in dims and out[0].start == 0
                          and out[-1].stop == shape[out[0].dim]
                          and all(a.stop == b.start for a, b in zip(out, out[1:]))):
        raise ValueError(f"the units' pieces of {name} do not cover it exactly once along one dimension: "
                         "the adapter's partition must slice every unit tensor completely")
    return out


class StreamedUnion:
    """The union model on this rank's device without the union: unit parameters arrive just in time.

    The full model is a skeleton on the ``meta`` device. Shared parameters are this rank's own
    tensors (every rank holds the same values: they are averaged over the world every step, and
    local steps evaluate right after a synchronisation). Buffers are small and stay resident for the
    whole evaluation, so BatchNorm recalibration accumulates across batches as it would in the
    assembled union: unit float buffers averaged among their owners, integer buffers from
    ``min(owners)``, shared float buffers averaged over the world, shared integer buffers from rank 0.
    Unit parameters are streamed: a forward pre-hook on the module that holds a unit (a block at block
    level; the layer's module at neuron level) allocates its unit tensors and broadcasts every piece
    from ``min(owners)``, and a forward hook frees them after the module has run. Branch scales
    (``eval.block_union=rescaled``) are folded into the fetched weights, exactly as
    :func:`~subnetdp.sdp.branches.fold_branch_scales` folds them into an assembled union.

    Every rank must run the same forwards in the same order (each module's pre-hook is a collective):
    :func:`evaluate_union` has every rank evaluate the same batches. Use as a context manager; the
    rank's own model is left untouched.

    Attributes:
        module: the union model (run it under ``torch.no_grad()``).
        fetched_bytes: payload bytes handed to collectives so far (buffers and streamed parameters).
        block_bytes: bytes of the largest set of unit parameters materialised at once (one module's).
        staging_bytes: bytes of the largest piece that needs a contiguous buffer of its own to be
            received (a slice along a dimension other than the first).
        resident_bytes: bytes held for the whole evaluation: every buffer, and scaled copies of
            shared layers that end a residual branch (none in the built-in adapters).
    """

    def __init__(self, adapter: ModelAdapter, spec: DataSpec, partition: Partition, plan: MaskPlan,
                 model: nn.Module, pmap: ParamMap, comm: Communicator, scales: Mapping[str, float] | None = None) -> None:
        self.comm, self.partition = comm, partition
        self.device = comm.device
        self.index = LocalIndex(model, pmap)
        self.fetched_bytes = self.resident_bytes = 0
        from subnetdp.sdp.construct import meta_model

        self.module = meta_model(adapter, spec)
        scaled = {id(m): float(s) for name, s in (scales or {}).items()
                  for m in adapter.branch_output_layers(self.module).get(name, []) if float(s) != 1.0}
        self._slots = self._plan_slots(plan, scaled)
        self.block_bytes = max((sum(_numel(s.shape) * s.dtype.itemsize for s in slots)
                                for slots in self._slots.values()), default=0)
        self.staging_bytes = max((_numel(s.shape) // s.shape[f.dim] * (f.stop - f.start) * s.dtype.itemsize
                                  for slots in self._slots.values() for s in slots for f in s.fetches
                                  if f.dim not in (None, 0)), default=0)
        self._hooks: list[Any] = []
        # One staging buffer for every piece that needs one, reused: a buffer a finished broadcast still
        # references is released whenever the backend lets go of it, so a fresh one per piece could
        # briefly hold two (seen as one piece over the memory bound).
        self._stage: torch.Tensor | None = None
        self._resident(plan, scaled)
        for path, slots in self._slots.items():
            m = self.module.get_submodule(path)
            self._hooks.append(m.register_forward_pre_hook(lambda _m, _a, slots=slots: self._fill(slots)))
            self._hooks.append(m.register_forward_hook(lambda _m, _a, _o, slots=slots: self._drop(slots),
                                                       always_call=True))

    def _plan_slots(self, plan: MaskPlan, scaled: dict[int, float]) -> dict[str, list[_Slot]]:
        """Stream module path -> the unit parameters it materialises, in the model's tensor order."""
        unit_paths = {u.id: _common_path([_module_path(s.name) for s in u.slices]) for u in self.partition.units}
        units_of: dict[str, set[int]] = {}
        for u in self.partition.units:
            for s in u.slices:
                units_of.setdefault(s.name, set()).add(u.id)
        items: dict[str, list[Item]] = {}
        for it in global_items(self.partition, plan):
            if it.unit is not None:
                items.setdefault(it.name, []).append(it)
        slots: dict[str, list[_Slot]] = {}
        for name in self.partition.shapes:  # module order, the same on every rank
            if name not in units_of:
                continue
            path = _callable_path(self.module, _common_path([unit_paths[u] for u in sorted(units_of[name])]), name)
            owner = self.module.get_submodule(_module_path(name))
            shape = tuple(self.partition.shapes[name])
            slots.setdefault(path, []).append(_Slot(name, owner, name.rpartition(".")[2], shape,
                                                    self.partition.dtypes[name], _fetches(items[name], shape, name),
                                                    scaled.get(id(owner), 1.0)))
        return slots

    @torch.no_grad()
    def _resident(self, plan: MaskPlan, scaled: dict[int, float]) -> None:
        """Shared parameters from this rank's own copy; every buffer fetched once, kept for the evaluation."""
        for name in self.partition.shared:
            owner = self.module.get_submodule(_module_path(name))
            attr = name.rpartition(".")[2]
            own = self.index.view(TensorSlice(name))
            if id(owner) in scaled:  # a branch ending in a shared layer: scale a copy, never the rank's own
                own = nn.Parameter(own.detach().clone().mul_(scaled[id(owner)]), requires_grad=False)
                self.resident_bytes += own.numel() * own.element_size()
            owner._parameters[attr] = own if isinstance(own, nn.Parameter) else nn.Parameter(own, requires_grad=False)
        held: dict[str, torch.Tensor] = {}
        for item in global_items(self.partition, plan, buffers=True):
            t = held.get(item.name)
            if t is None:
                t = held[item.name] = torch.empty(self.partition.shapes[item.name],
                                                  dtype=self.partition.dtypes[item.name], device=self.device)
            dst = t if item.dim is None else t.narrow(item.dim, item.start, item.stop - item.start)
            rank, dtype = self.comm.rank, self.partition.dtypes[item.name]
            mine = self.index.view(item).detach() if rank in item.owners and self.index.holds(item) else None
            if dtype.is_floating_point:
                # collective: every rank reaches this for every buffer piece; non-owners add zeros.
                buf = mine.clone() if mine is not None else torch.zeros(item.shape, dtype=dtype, device=self.device)
                self.comm.all_reduce(buf, self.comm.world).wait()
                buf /= len(item.owners)
            else:
                buf = mine.contiguous().clone() if rank == item.owners[0] else torch.empty(item.shape, dtype=dtype,
                                                                                         device=self.device)
                self.comm.broadcast(buf, item.owners[0])  # collective: every rank reaches this
            self.fetched_bytes += buf.numel() * buf.element_size()
            dst.copy_(buf)
        for name, t in held.items():
            owner = self.module.get_submodule(_module_path(name))
            owner._buffers[name.rpartition(".")[2]] = t
            self.resident_bytes += t.numel() * t.element_size()

    def _staged(self, dst: torch.Tensor) -> torch.Tensor:
        """A contiguous buffer shaped as ``dst``, a view of the one staging buffer (``staging_bytes``)."""
        nbytes = dst.numel() * dst.element_size()
        if self._stage is None:
            self._stage = torch.empty(self.staging_bytes, dtype=torch.uint8, device=self.device)
        return self._stage[:nbytes].view(dst.dtype).view(dst.shape)

    @torch.no_grad()
    def _fill(self, slots: list[_Slot]) -> None:
        """Materialise ``slots`` from their owners. Collective: every rank runs the same module here."""
        rank = self.comm.rank
        for slot in slots:
            t = torch.empty(slot.shape, dtype=slot.dtype, device=self.device)
            for f in slot.fetches:
                dst = t if f.dim is None else t.narrow(f.dim, f.start, f.stop - f.start)
                buf = dst if dst.is_contiguous() else self._staged(dst)
                if rank == f.src:
                    for a, b in f.parts:
                        part = buf if f.dim is None else buf.narrow(f.dim, a - f.start, b - a)
                        part.copy_(self.index.view(TensorSlice(slot.name, f.dim, a, b)))
                self.comm.broadcast(buf, f.src)  # collective: min(owners) of the piece to every rank
                if buf is not dst:
                    dst.copy_(buf)
                self.fetched_bytes += buf.numel() * buf.element_size()
                del buf, dst
            if slot.scale != 1.0:
                t.mul_(slot.scale)  # eval.block_union=rescaled, as fold_branch_scales does it
            slot.idle = slot.module._parameters[slot.attr]
            slot.module._parameters[slot.attr] = nn.Parameter(t, requires_grad=False)

    def _drop(self, slots: list[_Slot]) -> None:
        for slot in slots:
            if slot.idle is not None:
                slot.module._parameters[slot.attr], slot.idle = slot.idle, None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._stage = None

    def __enter__(self) -> "StreamedUnion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@torch.no_grad()
def evaluate_union(adapter: ModelAdapter, spec: DataSpec, seed: int, partition: Partition, plan: MaskPlan,
                   model: nn.Module, pmap: ParamMap, comm: Communicator, data: DataModule, cfg: Any,
                   scales: Mapping[str, float] | None = None) -> dict[str, float]:
    """The union model's metrics, streamed from the owners (:class:`StreamedUnion`); BatchNorm recalibrated.

    Collective: every rank calls it and evaluates the same batches (calibration and held-out), so
    every rank issues the same broadcasts in the same order and returns the same metrics. Bytes: the
    buffers once, then every unit parameter once per forward (``eval.bn_recalibrate_batches`` plus
    the evaluation batches), each broadcast from ``min(owners)``. Randomness (a regulariser active
    while recalibrating) is drawn from ``seed`` on every rank, and the run's generator is left as it was.
    ``scales``: block name -> factor folded into its residual branch (:func:`union_branch_scales`).
    """
    with torch.random.fork_rng(devices=[]), StreamedUnion(adapter, spec, partition, plan, model, pmap, comm,
                                                          scales) as union:
        torch.manual_seed(seed)
        return evaluate(union.module, adapter, data, cfg, device=comm.device)
