"""The union model: every unit from one of its owners, assembled on rank 0 and evaluated there."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from subnetdp.core.contracts import Communicator, DataModule, DataSpec, ModelAdapter, ParamMap, Partition
from subnetdp.sdp.pieces import Item, LocalIndex, global_items
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
        torch.manual_seed(seed)
        union = adapter.build(spec)
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
    backward = str(getattr(cfg.masker, "regime", "forward")) == "backward"
    if str(cfg.eval.get("block_union", "rescaled")) != "rescaled" or backward:
        return {}
    return branch_keep_rates(partition, plan)


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
