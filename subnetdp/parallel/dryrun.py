"""The dry run of a sharded rank (``fsdp.shard_size > 1``) for ``subnetdp plan``.

As :mod:`subnetdp.core.dryrun`, but the rank's subnetwork goes through the real activation
checkpointing and FSDP2 ``fully_shard`` over a real device mesh, in this one process posing as rank
``r`` of W through torch's *fake* process group (its collectives return at once and move nothing).
The step runs under ``FakeTensorMode`` inside :class:`~subnetdp.parallel.fsdp.ShardedMemoryTracker`,
the tracker the loop uses on its measured step when sharded; FSDP's bytes are counted by
:class:`~subnetdp.parallel.fsdp.CollectiveBytes` and the replicas' averaging by the communicator.
``benchmarks/fsdp_memory.py`` measures the same way at 1B.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh

from subnetdp.core.contracts import DataSpec, Handle, ModelAdapter, Partition
from subnetdp.core.dryrun import DryRunCommunicator, fake_rank_model, micro_batches
from subnetdp.core.metrics import live_state_bytes, training_state_tensors
from subnetdp.core.optim import build_optimizer
from subnetdp.core.plan import MaskPlan
from subnetdp.parallel.fsdp import (CollectiveBytes, ShardedMemoryTracker, ShardedOwnerAverager, apply_fsdp,
                                    local, mixed_precision)


class _Work:
    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()


class FakeGroupCommunicator(DryRunCommunicator):
    """Rank ``rank`` of ``world_size`` over torch's fake process group: real groups, no traffic.

    FSDP2 and device meshes need ``torch.distributed`` groups; their collectives return at once.
    The communicator's own all-reduces still count their payload.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._groups: dict[tuple[int, ...], Any] = {}

    def init(self) -> None:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        if not dist.is_initialized():
            dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)
        self._groups[self.world] = dist.group.WORLD

    def new_group(self, ranks: Sequence[int]) -> None:
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key))

    def all_reduce(self, tensor: torch.Tensor, group: Sequence[int], async_op: bool = False) -> Handle:
        key = tuple(group)
        self.bytes.add(key, tensor.numel() * tensor.element_size())
        return _Work(dist.all_reduce(tensor, group=self._groups[key], async_op=async_op))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


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
    if dist.is_initialized():
        raise RuntimeError("the sharded dry run needs a process without a process group")
    shard = int(cfg.fsdp.shard_size)
    comm = FakeGroupCommunicator(rank, plan.world_size)
    comm.init()
    try:
        # DeviceMesh reads its layout with .tolist(): made outside FakeTensorMode.
        mesh = init_device_mesh("cpu", (plan.world_size // shard, shard), mesh_dim_names=("replica", "shard"))
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        model, pmap, _ = fake_rank_model(cfg, adapter, spec, partition, plan, rank, fake)
        with fake:
            apply_fsdp(model, adapter.blocks(model), mesh["shard"], mixed_precision(str(cfg.train.precision)),
                       bool(cfg.fsdp.reshard_after_forward))
            optimizer = build_optimizer(cfg.optim, model.parameters())
            averager = ShardedOwnerAverager(model, pmap, plan.replicas(shard), partition, comm, shard,
                                            float(cfg.sync.bucket_cap_mb), bool(cfg.fsdp.reduce_each_micro_batch))
            fbatch = tuple(fake.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in batch)
            accum = micro_batches(int(cfg.train.grad_accum))  # the peak of all of them (see micro_batches)

            def step() -> None:
                # Clipping is left out, as in the unsharded dry run: in-place scaling and scalars.
                for micro in range(accum):
                    with averager.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                        adapter.training_loss(model, fbatch).div(accum).backward()
                averager.finish()
                optimizer.step()

            if min(int(cfg.train.memory_step), int(cfg.train.steps)) > 1:
                averager.prepare()
                step()  # the optimizer state the measured step starts with
            averager.prepare()  # as the loop: the last step's gradients are dropped before the baseline
            comm.bytes.reset()
            baseline = live_state_bytes(training_state_tensors(model, optimizer, averager.state_tensors()))
            counter = CollectiveBytes()
            with counter, ShardedMemoryTracker(baseline) as tracker:
                step()
            held = sum(local(p).numel() for p in model.parameters())
        return {"peak_memory_bytes": int(tracker.peak), "bytes_per_step": float(comm.bytes.total() + counter.payload),
                "params_held": int(held), "params_trained": int(held), "dense_sync": False,
                "fsdp_bytes_per_step": dict(counter.by_kind)}
    finally:
        comm.shutdown()
