"""A rank's training step without allocating: peak memory and bytes from a dry run.

The rank's model is built on the ``meta`` device and materialised (or masked, for backward masking)
there, which costs no memory and no initialisation and runs an initialiser's data-dependent code
(``trunc_normal_``'s rejection loop) as a no-op; its parameters and buffers then become fake CPU
tensors of the same shapes, dtypes and strides (tied tensors stay tied), and it is trained for two
steps under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`, which gives every tensor a
shape and no storage, by the loop's own :func:`~subnetdp.train.step.train_step`. The second step
runs inside :class:`~subnetdp.parallel.memory.TensorMemoryTracker`, the same tracker and the same
baseline (parameters, buffers, gradients, gradient buckets, optimizer state) the training loop uses
on a CPU, so the estimate is the step the loop measures. Collectives
go to :class:`DryRunCommunicator`, which does nothing but count the payload.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from subnetdp.core.contracts import Communicator, DataSpec, LaunchEnv, ModelAdapter, NullCommunicator, ParamMap, Partition
from subnetdp.parallel.memory import TensorMemoryTracker, live_state_bytes, training_state_tensors
from subnetdp.train.optim import build_optimizer
from subnetdp.train.step import StepContext, train_step
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.sync import Checked, SyncSettings
from subnetdp.sdp.sync import make_synchronizer
from subnetdp.sdp.construct import build_model
from subnetdp.sdp.variants import local_model, regime_of


class DryRunCommunicator(NullCommunicator):
    """Rank ``rank`` of ``world_size`` in this one process, with no process group: the ``local``
    communicator's do-nothing collectives, counting the payload each is handed."""

    counts_bytes = True

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(None, LaunchEnv(rank, world_size, rank, world_size, "dry-run"))


def fake_module(module: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    """Replace every parameter and buffer of ``module`` (in place) by a fake CPU tensor like it.

    Shapes, dtypes, strides and ``requires_grad`` are kept; a tensor registered in several places
    (tied embeddings) becomes one fake tensor registered in the same places.
    """
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            with mode:
                new = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
            memo[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
        return memo[id(t)]

    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = fake(p)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = fake(b)
    return module


class DryRunGuard:
    """The step's guard in a dry run: no inf/NaN check (a fake tensor has no value), clipping's tensor work.

    The loop's clipping reduces one scalar norm per tensor, all-reduces the sum (8 bytes, in phase
    ``"guard"``) and scales every gradient in place; here the scale stays a tensor, so the same
    tensors are made and the in-place scaling runs whatever the norm is.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def carry(self, sync: Any, loss: torch.Tensor, signum: int = 0) -> None:
        return None

    def check(self, step: int, sync: Any, loss: torch.Tensor, need_norm: bool, signum: int = 0) -> Checked:
        return Checked(True, None, {})

    def clip(self, sync: Any, norm: None, max_norm: float) -> None:
        if max_norm <= 0:
            return
        grads = sync.local_grads()
        total = torch.zeros((), dtype=torch.float64)
        for g in grads:
            total += torch.linalg.vector_norm(g).double() ** 2
        with self.comm.bytes.phase("guard"):
            # collective: every rank reaches this (the dry run's communicator only counts it).
            self.comm.all_reduce(total, list(range(self.comm.world_size))).wait()
        coef = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))


def fake_rank_model(cfg: Any, adapter: ModelAdapter, spec: DataSpec, partition: Partition, plan: MaskPlan,
                    rank: int, fake: FakeTensorMode) -> tuple[torch.nn.Module, ParamMap, list[int]]:
    """Rank ``rank``'s model as the loop builds it, with fake tensors, in training mode.

    Built and materialised on ``meta`` (:func:`fake_module`), with activation checkpointing applied
    as :mod:`subnetdp.parallel` applies it. Returns the model, its parameter map and the positions
    of the checkpointed blocks.
    """
    from subnetdp.parallel.checkpointing import apply_ac  # no process group involved

    with torch.device("meta"):
        model, pmap = local_model(adapter, build_model(adapter, spec), plan.owned[rank], partition, cfg.masker)
    fake_module(model, fake)
    model.train()
    return model, pmap, apply_ac(adapter.blocks(model), cfg.train.activation_checkpointing)


def micro_batches(accum: int) -> int:
    """Micro-batches a dry run needs for the peak of ``accum``: at most 3.

    The first micro-batch creates the gradients, the last one synchronises them, and every one in
    between starts from the same tensors and does the same work (accumulating in place), so its
    peak is the second's: ``min(accum, 3)`` micro-batches give the whole step's peak in a third of
    the time for the 1B recipe's 8.
    """
    return min(accum, 3)


def estimate_rank(cfg: Any, adapter: ModelAdapter, spec: DataSpec, partition: Partition, plan: MaskPlan,
                  rank: int, batch: Any) -> dict[str, float]:
    """Peak tensor bytes of rank ``rank``'s measured training step, its bytes per step and parameters.

    Args:
        cfg: the run config.
        adapter, spec, partition, plan: as in training.
        rank: the rank to estimate.
        batch: one real training batch (its shapes are used; it is converted to fake tensors).
    """
    from subnetdp.parallel.apply import autocast_for

    comm = DryRunCommunicator(rank, plan.world_size)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model, pmap, checkpointed = fake_rank_model(cfg, adapter, spec, partition, plan, rank, fake)
    autocast = autocast_for(cfg.train.precision, "cpu", False, bool(checkpointed))
    with fake:
        fbatch = tuple(fake.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in batch)
        optimizer = build_optimizer(cfg.optim, model.parameters())
        # Local steps: the heaviest step of a cycle is its synchronisation, which averages the same owner
        # buckets as the per-step synchroniser; the outer state is added below.
        settings = dataclasses.replace(SyncSettings.from_config(cfg), mode="every_step")
        averager = make_synchronizer(settings, model, pmap, plan, partition, comm)
        refresher = None
        if regime_of(cfg.masker).refreshes:
            from subnetdp.sdp.backward import Refresher

            refresher = Refresher(model, pmap, plan, partition, comm, cfg.masker.refresh_every,
                                  cfg.sync.bucket_cap_mb)
        # The loop measures step min(train.memory_step, train.steps); one earlier step creates the
        # optimizer state it starts with.
        measured = min(cfg.train.memory_step, cfg.train.steps)
        every = max(1, cfg.masker.refresh_every)
        ctx = StepContext(model=model, adapter=adapter, sync=averager, optimizer=optimizer, guard=DryRunGuard(comm),
                          refresher=refresher, accum=micro_batches(cfg.train.grad_accum),
                          clip=cfg.optim.clip_grad_norm, autocast=lambda: autocast)

        def step(n: int) -> None:
            # The earlier step only creates the optimizer state (gradients are dropped before the
            # measured one): one micro-batch makes the same state as all of them.
            train_step(ctx if n == measured else dataclasses.replace(ctx, accum=1), itertools.repeat(fbatch), step=n)

        if measured > 1:
            averager.prepare()
            step(measured - 1)
        comm.bytes.reset()
        averager.prepare()  # as the loop: last step's gradients are dropped before the baseline
        state = training_state_tensors(model, optimizer, averager.state_tensors())
        with TensorMemoryTracker(live_state_bytes(state)) as tracker:
            step(measured)
        grad_bytes = float(averager.bytes_per_step())
        if refresher is not None and plan.world_size > 1:
            grad_bytes += refresher.bytes_per_refresh() / every
        params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    averager.remove_hooks()
    peak = tracker.peak
    if cfg.sync.mode == "local_steps":
        # One synchronisation's buckets every sync.every steps; the outer state (anchor, and momentum
        # unless it is 0) is one copy of the trained parameters each, counted on the host too.
        grad_bytes /= cfg.sync.every
        copies = 2 if cfg.sync.outer_momentum > 0 else 1
        peak += copies * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"peak_memory_bytes": int(peak), "bytes_per_step": float(grad_bytes),
            "params_held": int(params), "params_trained": int(trainable), "dense_sync": bool(averager.dense)}
