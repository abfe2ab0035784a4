"""The gradient-alignment probe (``train.grad_alignment_every``): SDP's update against DDP's gradient.

At a probe step, after the owner groups have averaged the gradients and before the optimizer steps,
two full-model vectors are compared on rank 0:

- **SDP's aggregated gradient**: for every unit, the gradient its owners averaged (identical on all
  owners); for every shared tensor, the world average. It is assembled like the union model (each
  unit from ``min(owners)``), from a rank's gradients in place of its parameters. Clipping scales it
  as a whole, so the cosine is the one of the update direction SGD takes.
- **the full-batch DDP gradient**: the union model (the same parameters, before the step) run
  forward and backward in training mode on every rank's micro-batches of this step, one rank's
  batch at a time (so BatchNorm sees the batches DDP's ranks would see), averaged over ranks.

The probe reports their cosine over all parameters, over the units only and over the shared
tensors only, and the ratio of their norms. At C = 1 SDP's gradient is DDP's, so the cosine is 1.
The probe is read-only: the rank's model, gradients and RNG state are left as they were.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
from torch import nn

from subnetdp.core.contracts import Communicator, DataSpec, ModelAdapter, ParamMap, Partition
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.union import assemble_union


@contextlib.contextmanager
def _gradients_as_values(model: nn.Module):
    """Temporarily give every parameter its gradient as value (zeros where it has none)."""
    saved = []
    with torch.no_grad():
        for p in model.parameters():
            saved.append(p.data)
            p.data = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p.data)
    try:
        yield model
    finally:
        with torch.no_grad():
            for p, d in zip(model.parameters(), saved):
                p.data = d


def _cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))
    na = sum(float(x.double().pow(2).sum()) for x in a) ** 0.5
    nb = sum(float(y.double().pow(2).sum()) for y in b) ** 0.5
    return dot / (na * nb) if na > 0 and nb > 0 else float("nan")


def ddp_gradient(union: nn.Module, adapter: ModelAdapter, batches_by_rank: Sequence[Sequence[Any]]) -> dict[str, torch.Tensor]:
    """The gradient DDP would average on this global batch: mean over ranks of each rank's
    (micro-batch-averaged) loss gradient, with the union model's parameters."""
    union.train()
    union.zero_grad(set_to_none=True)
    world = len(batches_by_rank)
    for micro in batches_by_rank:
        for batch in micro:
            loss = adapter.loss(union(adapter.inputs(batch)), batch) / (len(micro) * world)
            loss.backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach() for n, p in union.named_parameters()}


def gradient_alignment(adapter: ModelAdapter, spec: DataSpec, seed: int, partition: Partition, plan: MaskPlan,
                       model: nn.Module, pmap: ParamMap, comm: Communicator,
                       batches: Sequence[Any]) -> dict[str, float] | None:
    """Cosine of SDP's averaged gradient with the full-batch DDP gradient. Collective: every rank
    calls it at the same step with its own micro-batches of that step; the result on rank 0, None
    elsewhere."""
    with torch.random.fork_rng(devices=[]):  # the probe draws nothing from the run's generator
        with _gradients_as_values(model):
            # collective: every rank contributes its owned gradients.
            sdp = assemble_union(adapter, spec, seed, partition, plan, model, pmap, comm)
        # collective: the union model with the parameters this step's gradients were taken at.
        union = assemble_union(adapter, spec, seed, partition, plan, model, pmap, comm)
        # collective: rank 0 needs every rank's batches of this step.
        everyone = comm.all_gather_object([tuple(t.detach().cpu() for t in b) for b in batches])
        if union is None or sdp is None:
            return None
        ddp = ddp_gradient(union, adapter, everyone)
    sdp_grads = dict(sdp.named_parameters())
    shared = set(partition.shared)
    names = [n for n in ddp if n in sdp_grads]
    pick = lambda keep: ([sdp_grads[n].detach() for n in names if keep(n)], [ddp[n] for n in names if keep(n)])  # noqa: E731
    a, b = pick(lambda n: True)
    norm_sdp = sum(float(x.double().pow(2).sum()) for x in a) ** 0.5
    norm_ddp = sum(float(y.double().pow(2).sum()) for y in b) ** 0.5
    return {"cosine": _cosine(a, b), "cosine_units": _cosine(*pick(lambda n: n not in shared)),
            "cosine_shared": _cosine(*pick(lambda n: n in shared)),
            "norm_ratio": norm_sdp / norm_ddp if norm_ddp > 0 else float("nan")}
