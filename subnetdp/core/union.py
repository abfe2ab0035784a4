"""The union model: every unit from one of its owners, assembled on rank 0 and evaluated there."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from subnetdp.core.contracts import Communicator, DataModule, DataSpec, ModelAdapter, ParamMap, Partition
from subnetdp.core.plan import MaskPlan


def _local_tensors(model: nn.Module, pmap: ParamMap) -> dict[str, torch.Tensor]:
    """Global name -> local tensor, for tensors held whole."""
    local = dict(model.named_parameters())
    local.update(dict(model.named_buffers()))
    out = {}
    for name, pieces in pmap.pieces.items():
        if name in local and len(pieces) == 1 and pieces[0].dim is None:
            out[pieces[0].global_name] = local[name]
    return out


@torch.no_grad()
def assemble_union(adapter: ModelAdapter, spec: DataSpec, seed: int, partition: Partition, plan: MaskPlan,
                   model: nn.Module, pmap: ParamMap, comm: Communicator) -> nn.Module | None:
    """Rank 0 gets the full model: parameters from ``min(owners)``, float buffers averaged among owners.

    Collective: every rank calls it. Returns the union model (on CPU) on rank 0, None elsewhere.
    The ranks' own copies are untouched.
    """
    rank = comm.rank
    local = _local_tensors(model, pmap)
    device = next(model.parameters()).device
    union = None
    if rank == 0:
        torch.manual_seed(seed)
        union = adapter.build(spec)
    target = {}
    if union is not None:
        target = dict(union.named_parameters())
        target.update(dict(union.named_buffers()))

    def fetch(name: str, owners: tuple[int, ...], average: bool) -> None:
        shape = partition.shapes[name]
        mine = local.get(name) if rank in owners else None
        dtype = partition.dtypes[name]
        if average:
            # collective: every rank reaches this; non-owners contribute zeros.
            buf = mine.detach().clone() if mine is not None else torch.zeros(shape, dtype=dtype, device=device)
            comm.all_reduce(buf, comm.world).wait()
            buf /= len(owners)
        else:
            if rank == 0 and mine is not None:
                buf = mine.detach()
            else:
                src = owners[0]
                buf = mine.detach().clone() if mine is not None else torch.empty(shape, dtype=dtype, device=device)
                if src != 0:
                    # collective: every rank reaches this for units rank 0 does not own.
                    comm.broadcast(buf, src)
        if union is not None:
            target[name].copy_(buf.to(target[name].dtype).cpu())

    world = comm.world
    for unit in partition.units:
        owners = plan.owners(unit.id)
        for s in unit.slices:
            fetch(s.name, owners, average=False)
        for s in unit.buffers:
            fetch(s.name, owners, average=partition.dtypes[s.name].is_floating_point)
    for name in partition.shared:
        fetch(name, world, average=False)
    for name in partition.shared_buffers:
        fetch(name, world, average=partition.dtypes[name].is_floating_point)
    return union


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, batches: Any, n: int, inputs: Any) -> int:
    """Recompute BatchNorm running statistics as a plain average over ``n`` training batches."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns or n <= 0:
        return 0
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    seen = 0
    for batch in batches:
        if seen >= n:
            break
        model(inputs(batch))
        seen += 1
    for m, mom in zip(bns, momenta):
        m.momentum = mom
    model.eval()
    return seen


@torch.no_grad()
def evaluate(model: nn.Module, adapter: ModelAdapter, data: DataModule, cfg: Any) -> dict[str, float]:
    """The adapter's metrics of ``model`` on the held-out split (after BatchNorm recalibration)."""
    n_cal = int(cfg.eval.bn_recalibrate_batches)
    if n_cal > 0:
        calib = data.train_loader(0, 1, int(cfg.train.batch_size))
        recalibrate_batchnorm(model, iter(calib), n_cal, adapter.inputs)
    model.eval()
    outputs, batches = [], []
    for i, batch in enumerate(data.eval_loader(int(cfg.eval.batch_size))):
        if cfg.eval.batches and i >= cfg.eval.batches:
            break
        outputs.append(model(adapter.inputs(batch)))
        batches.append(batch)
    return adapter.metrics(outputs, batches)
