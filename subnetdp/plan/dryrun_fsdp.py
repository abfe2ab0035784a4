"""The dry run of a sharded rank (``fsdp.shard_size > 1``) for ``subnetdp plan``.

As :mod:`subnetdp.plan.dryrun`, but the rank's subnetwork goes through the real activation
checkpointing and FSDP2 ``fully_shard`` over a real device mesh, in this one process posing as rank
``r`` of W through torch's *fake* process group (its collectives return at once and move nothing).
The step runs under ``FakeTensorMode`` inside :class:`~subnetdp.parallel.fsdp.ShardedMemoryTracker`,
the tracker the loop uses on its measured step when sharded; FSDP's bytes are counted by
:class:`~subnetdp.parallel.fsdp.CollectiveBytes` and the replicas' averaging by the communicator.
``benchmarks/fsdp_memory.py`` measures the same way at 1B.
"""

from __future__ import annotations

import dataclasses

import itertools
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from subnetdp.core.contracts import DataSpec, ModelAdapter, Partition
from subnetdp.parallel.dryrun_comm import FakeGroupCommunicator, fake_mesh
from subnetdp.plan.dryrun import DryRunGuard, fake_rank_model, micro_batches
from subnetdp.parallel.memory import live_state_bytes, training_state_tensors
from subnetdp.train.optim import build_optimizer
from subnetdp.train.step import StepContext, train_step
from subnetdp.core.plan import MaskPlan
from subnetdp.parallel.fsdp import CollectiveBytes, ShardedMemoryTracker, Sharding, apply_fsdp, local, mixed_precision
from subnetdp.sdp.sync import SyncSettings
from subnetdp.sdp.sync import make_synchronizer


def estimate_sharded_rank(cfg: Any, adapter: ModelAdapter, spec: DataSpec, partition: Partition, plan: MaskPlan,
                          rank: int, batch: Any) -> dict[str, Any]:
    """Peak tensor bytes, bytes per step and parameters of sharded rank ``rank``'s measured step.

    Args:
        cfg: the run config (``fsdp.*``, ``train.*``, ``optim.*``).
        adapter, spec, partition: as in training.
        plan: the replicated plan over the W ranks (``MaskPlan.replicated``).
        rank: the rank to estimate.
        batch: one real training batch (its shapes are used).
    """
    if FakeGroupCommunicator.initialized():
        raise RuntimeError("the sharded dry run needs a process without a process group")
    shard = cfg.fsdp.shard_size
    comm = FakeGroupCommunicator(rank, plan.world_size)
    comm.init()
    try:
        # DeviceMesh reads its layout with .tolist(): made outside FakeTensorMode.
        mesh = fake_mesh(plan.world_size, shard)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        model, pmap, _ = fake_rank_model(cfg, adapter, spec, partition, plan, rank, fake)
        with fake:
            apply_fsdp(model, adapter.blocks(model), mesh["shard"], mixed_precision(cfg.train.precision),
                       cfg.fsdp.reshard_after_forward)
            optimizer = build_optimizer(cfg.optim, model.parameters())
            averager = make_synchronizer(SyncSettings.from_config(cfg), model, pmap, plan, partition, comm,
                                         sharded=Sharding(shard, cfg.fsdp.reduce_each_micro_batch))
            fbatch = tuple(fake.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in batch)
            ctx = StepContext(model=model, adapter=adapter, sync=averager, optimizer=optimizer, guard=DryRunGuard(comm),
                              accum=micro_batches(cfg.train.grad_accum), clip=cfg.optim.clip_grad_norm)

            def step(n: int) -> None:
                # The earlier step only creates the optimizer state (gradients are dropped before the
                # measured one): one micro-batch makes the same state as all of them.
                train_step(ctx if n == measured else dataclasses.replace(ctx, accum=1), itertools.repeat(fbatch), step=n)

            measured = min(cfg.train.memory_step, cfg.train.steps)
            if measured > 1:
                averager.prepare()
                step(measured - 1)  # the optimizer state the measured step starts with
            averager.prepare()  # as the loop: the last step's gradients are dropped before the baseline
            comm.bytes.reset()
            baseline = live_state_bytes(training_state_tensors(model, optimizer, averager.state_tensors()))
            counter = CollectiveBytes()
            with counter, ShardedMemoryTracker(baseline) as tracker:
                step(measured)
            held = sum(local(p).numel() for p in model.parameters())
        return {"peak_memory_bytes": int(tracker.peak), "bytes_per_step": float(comm.bytes.total() + counter.payload),
                "params_held": int(held), "params_trained": int(held), "dense_sync": False,
                "fsdp_bytes_per_step": dict(counter.by_kind)}
    finally:
        comm.shutdown()
