"""What the loop asks of the parallelisms: :func:`parallelize` and the :class:`RankParallelism` it returns
(the :class:`~subnetdp.core.contracts.Parallelism` protocol)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from subnetdp.core.contracts import GradSynchronizer
from subnetdp.sdp.sync import OwnerGroupAverager
from subnetdp.parallel.checkpointing import apply_ac
from subnetdp.parallel.compile import apply_compile


class RankParallelism:
    """Activation checkpointing, compile, precision and (optionally) FSDP of one rank's model.

    Without FSDP every method is the plain path: the loop never branches on "sharded or not".
    """

    def __init__(self, run: Any) -> None:
        cfg = run.cfg
        self.run = run
        self.shard_size = int(cfg.fsdp.shard_size)
        self.precision = str(cfg.train.precision)
        blocks = run.adapter.blocks(run.model)
        self.checkpointed = apply_ac(blocks, int(cfg.train.activation_checkpointing))
        self.compiled = apply_compile(blocks, str(cfg.train.compile_backend)) if cfg.train.compile else 0
        self.mesh = None
        self.synchroniser: GradSynchronizer | None = None  # made by :meth:`averager`
        # FSDP's all-gather and reduce-scatter bytes of one step, measured by :meth:`counting`.
        self.fsdp_bytes, self.fsdp_wire, self.fsdp_by_kind = 0, 0.0, {}
        if self.shard_size > 1:
            from subnetdp.parallel import fsdp

            self.mesh = fsdp.replica_mesh(run.comm, self.shard_size)
            fsdp.apply_fsdp(run.model, blocks, self.mesh["shard"], fsdp.mixed_precision(self.precision),
                            bool(cfg.fsdp.reshard_after_forward))

    @property
    def sharded(self) -> bool:
        return self.shard_size > 1

    def averager(self) -> GradSynchronizer:
        """The gradient synchroniser for this rank's (possibly sharded) model. Collective (creates groups)."""
        run, cfg = self.run, self.run.cfg
        if str(cfg.sync.mode) == "local_steps":  # FSDP is refused for it before any process group exists
            from subnetdp.sdp.local_steps import LocalStepsSynchronizer

            s = cfg.sync
            sync: GradSynchronizer = LocalStepsSynchronizer(
                run.model, run.pmap, run.plan, run.partition, run.comm, int(s.every), float(s.outer_lr),
                float(s.outer_momentum), bool(s.outer_on_host), float(s.bucket_cap_mb), int(s.max_groups),
                on_nonfinite=str(cfg.train.on_nonfinite))
        elif self.sharded:
            from subnetdp.parallel.fsdp import ShardedOwnerAverager

            sync = ShardedOwnerAverager(run.model, run.pmap, run.plan.replicas(self.shard_size), run.partition,
                                        run.comm, self.shard_size, float(cfg.sync.bucket_cap_mb),
                                        bool(cfg.fsdp.reduce_each_micro_batch))
        else:
            sync = OwnerGroupAverager(run.model, run.pmap, run.plan, run.partition, run.comm,
                                      float(cfg.sync.bucket_cap_mb), int(cfg.sync.max_groups))
        self.synchroniser = sync
        return sync

    def autocast(self) -> Any:
        """bf16 autocast around forward and loss; FSDP's mixed-precision policy casts when sharded.

        With activation checkpointing autocast's cache of bf16 weight copies is off: the copies
        would outlive the blocks whose activations were dropped (1.4 GiB at 1B LLaMA), and the
        recomputation casts again anyway.
        """
        return autocast_for(self.precision, self.run.comm.device.type, self.sharded, bool(self.checkpointed))

    def memory_tracker(self, baseline: int) -> Any:
        """The dispatch-level tracker of the measured step; with FSDP it counts shards and gathers."""
        if self.sharded:
            from subnetdp.parallel.fsdp import ShardedMemoryTracker

            return ShardedMemoryTracker(baseline)
        from subnetdp.parallel.memory import TensorMemoryTracker

        return TensorMemoryTracker(baseline)

    @contextlib.contextmanager
    def gathered(self, writeback: bool = False) -> Iterator[None]:
        """The model with full (unsharded) parameters inside the block. Collective when sharded."""
        if not self.sharded:
            yield
            return
        from subnetdp.parallel.fsdp import gathered

        with gathered(self.run.model, writeback):
            yield

    @contextlib.contextmanager
    def counting(self, active: bool) -> Iterator[None]:
        """Measure FSDP's own collectives during this step (when ``active`` and sharded).

        Every step moves the same bytes, so one step is measured (the loop uses the step on which
        it measures memory: counting every dispatched op would slow each step down).
        """
        if not (self.sharded and active):
            yield
            return
        from subnetdp.parallel.fsdp import CollectiveBytes

        counter = CollectiveBytes()
        with counter:
            yield
        self.fsdp_bytes, self.fsdp_wire, self.fsdp_by_kind = counter.payload, counter.wire, dict(counter.by_kind)

    def optimizer_state_full(self, optimizer: torch.optim.Optimizer) -> list[dict]:
        """Each optimizer parameter's state (in the optimizer's order), sharded state gathered to
        full tensors. Collective over each shard group when sharded."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.sharded:
            return [optimizer.state.get(p, {}) for p in params]
        from subnetdp.parallel.fsdp import state_full

        return state_full(optimizer)

    def optimizer_state_from_full(self, optimizer: torch.optim.Optimizer) -> None:
        """After loading full-shaped state (:meth:`optimizer_state_full`): each rank keeps its shards."""
        if self.sharded:
            from subnetdp.parallel.fsdp import state_from_full

            state_from_full(optimizer)

    def describe(self) -> dict[str, Any]:
        sync = self.synchroniser.describe() if self.synchroniser is not None else {"sync_mode": "every_step"}
        return {"fsdp_shard_size": self.shard_size, "precision": self.precision,
                "activation_checkpointing": len(self.checkpointed), "compiled_blocks": self.compiled, **sync}


def autocast_for(precision: str, device_type: str, sharded: bool, checkpointed: bool) -> Any:
    """The forward's autocast context of :meth:`RankParallelism.autocast` (also used by the plan's dry run)."""
    if precision == "bf16" and not sharded:
        return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=not checkpointed)
    return contextlib.nullcontext()


def parallelize(run: Any) -> RankParallelism:
    """Apply checkpointing, compile and FSDP (in that order, as torchtitan does) to ``run.model``."""
    return RankParallelism(run)


def local_numel(model: nn.Module) -> int:
    """Parameter elements this rank stores (its shards when sharded)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
