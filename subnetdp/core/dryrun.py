"""A rank's training step without allocating: peak memory and bytes from a dry run.

The rank's model is built, materialised (or masked, for backward masking) and trained for two steps
under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`, which gives every tensor a shape and
no storage; the second step runs inside :class:`~subnetdp.core.metrics.TensorMemoryTracker`, the
same tracker and the same baseline (parameters, buffers, gradients, gradient buckets, optimizer
state) the training loop uses on a CPU, so the estimate is the step the loop measures. Collectives
go to :class:`DryRunCommunicator`, which does nothing but count the payload.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from subnetdp.core.contracts import Communicator, DataSpec, DoneHandle, Handle, LaunchEnv, ModelAdapter, Partition
from subnetdp.core.metrics import TensorMemoryTracker, live_state_bytes, training_state_tensors
from subnetdp.core.optim import build_optimizer
from subnetdp.core.plan import MaskPlan
from subnetdp.core.sync import OwnerGroupAverager
from subnetdp.core.variants import is_backward, local_model


class DryRunCommunicator(Communicator):
    """Rank ``rank`` of ``world_size`` with collectives that only count bytes."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(None, LaunchEnv(rank, world_size, rank, world_size, "dry-run"))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def init(self) -> None:
        return None

    def new_group(self, ranks: Sequence[int]) -> None:
        return None

    def all_reduce(self, tensor: torch.Tensor, group: Sequence[int], async_op: bool = False) -> Handle:
        self.bytes.add(tuple(group), tensor.numel() * tensor.element_size())
        return DoneHandle()

    def broadcast(self, tensor: torch.Tensor, src: int, group: Sequence[int] | None = None) -> None:
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.world_size

    def barrier(self) -> None:
        return None


def _step(model: torch.nn.Module, adapter: ModelAdapter, batch: Any, averager: OwnerGroupAverager,
          optimizer: torch.optim.Optimizer, accum: int, refresher: Any, clip: float) -> None:
    averager.prepare()
    for micro in range(accum):
        with averager.no_sync() if micro < accum - 1 else _null():
            loss = adapter.loss(model(adapter.inputs(batch)), batch) / accum
            loss.backward()
    averager.finish()
    # Gradient clipping (optim.clip_grad_norm) is left out: it scales gradients in place and its norm
    # is a few scalars, so it adds no memory worth estimating, and it needs real values.
    optimizer.step()
    if refresher is not None:
        refresher.refresh()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def estimate_rank(cfg: Any, adapter: ModelAdapter, spec: DataSpec, partition: Partition, plan: MaskPlan,
                  rank: int, batch: Any) -> dict[str, float]:
    """Peak tensor bytes of rank ``rank``'s measured training step, its bytes per step and parameters.

    Args:
        cfg: the run config.
        adapter, spec, partition, plan: as in training.
        rank: the rank to estimate.
        batch: one real training batch (its shapes are used; it is converted to fake tensors).
    """
    comm = DryRunCommunicator(rank, plan.world_size)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        torch.manual_seed(int(cfg.seed))
        full = adapter.build(spec)
        model, pmap = local_model(adapter, full, plan.owned[rank], partition, cfg.masker)
        del full
        model.train()
        fbatch = tuple(fake.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in batch)
        optimizer = build_optimizer(cfg.optim, model.parameters())
        averager = OwnerGroupAverager(model, pmap, plan, partition, comm, float(cfg.sync.bucket_cap_mb),
                                      int(cfg.sync.max_groups))
        refresher = None
        if is_backward(cfg.masker):
            from subnetdp.core.backward import Refresher

            refresher = Refresher(model, pmap, plan, partition, comm, 1, float(cfg.sync.bucket_cap_mb))
        accum, clip = int(cfg.train.grad_accum), float(cfg.optim.clip_grad_norm)
        # The loop measures step min(train.memory_step, train.steps); one earlier step creates the
        # optimizer state it starts with.
        measured = min(int(cfg.train.memory_step), int(cfg.train.steps))
        every = max(1, int(getattr(cfg.masker, "refresh_every", 1)))
        if measured > 1:
            _step(model, adapter, fbatch, averager, optimizer, accum, refresher, clip)
        comm.bytes.reset()
        state = training_state_tensors(model, optimizer, averager.state_tensors())
        with TensorMemoryTracker(live_state_bytes(state)) as tracker:
            _step(model, adapter, fbatch, averager, optimizer, accum,
                  refresher if measured % every == 0 else None, clip)
        grad_bytes = float(averager.bytes_per_step())
        if refresher is not None and plan.world_size > 1:
            grad_bytes += refresher.bytes_per_refresh() / every
        params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    averager.remove_hooks()
    return {"peak_memory_bytes": int(tracker.peak), "bytes_per_step": float(grad_bytes),
            "params_held": int(params), "params_trained": int(trainable), "dense_sync": bool(averager.dense)}
