"""What the training state asks of the parallelisms applied to a rank's model from outside it: the
:class:`Parallelism` protocol and its implementation, :class:`RankParallelism`."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Protocol

import torch
from torch import nn

from subnetdp.core.contracts import Communicator, ModelAdapter
from subnetdp.parallel.checkpointing import apply_ac, checkpointed_positions
from subnetdp.parallel.compile import apply_compile


class Parallelism(Protocol):
    """What the training state, meter and checkpointer ask of the parallelisms applied to a rank's
    model from outside it (activation checkpointing, compile, precision, FSDP).

    Without FSDP every method is the plain path, so nothing above branches on "sharded or not". It
    holds no model: :meth:`apply` is given one (again after a re-plan), the rest take it where needed.
    """

    fsdp_bytes: int
    fsdp_wire: float
    fsdp_by_kind: dict[str, float]

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded with FSDP (``fsdp.shard_size`` > 1)."""

    def apply(self, model: nn.Module, adapter: ModelAdapter) -> None:
        """Checkpointing, compile and FSDP on ``model``'s blocks, from outside it. Collective when sharded."""

    def applied_after_drop(self, model: nn.Module, adapter: ModelAdapter) -> bool:
        """After ``model`` lost blocks in place (``ModelAdapter.drop_units``): whether what :meth:`apply`
        made of it is what it would make of it now (the same blocks checkpointed, every block compiled,
        no shards), so it trains on without a new build."""

    def sharding(self) -> Any:
        """What the synchroniser factory is given for sharded gradients, or None without FSDP."""

    def autocast(self) -> ContextManager[Any]:
        """The forward's autocast context (bf16 without FSDP; FSDP's policy casts when sharded)."""

    def memory_tracker(self, baseline: int) -> ContextManager[Any]:
        """The tensor-memory tracker of the measured step (its ``peak`` in bytes after the block)."""

    def gathered(self, model: nn.Module, writeback: bool = False) -> ContextManager[None]:
        """``model`` with full (unsharded) parameters inside the block. Collective when sharded."""

    def counting(self, active: bool) -> ContextManager[None]:
        """Measure FSDP's own collectives during the block into ``fsdp_bytes`` / ``fsdp_by_kind``."""

    def optimizer_state_full(self, optimizer: torch.optim.Optimizer) -> list[dict]:
        """Each optimizer parameter's state, sharded state gathered to full tensors. Collective when sharded."""

    def optimizer_state_from_full(self, optimizer: torch.optim.Optimizer) -> None:
        """After loading full-shaped state: each rank keeps its shards."""

    def describe(self) -> dict[str, Any]:
        """Figures for the summary (shard size, precision, checkpointed and compiled blocks)."""


class RankParallelism:
    """Activation checkpointing, compile, precision and (optionally) FSDP of one rank's model.

    Without FSDP every method is the plain path: nothing above branches on "sharded or not".

    Args:
        cfg: the run config (``train.activation_checkpointing``, ``train.compile``, ``train.precision``,
            ``fsdp.*``).
        comm: the communicator (FSDP's device mesh is made over its world).
    """

    def __init__(self, cfg: Any, comm: Communicator) -> None:
        self.comm = comm
        self.shard_size = cfg.fsdp.shard_size
        self.precision = cfg.train.precision
        self.ac_every = cfg.train.activation_checkpointing
        self.compile_backend = cfg.train.compile_backend if cfg.train.compile else None
        self.reshard_after_forward = cfg.fsdp.reshard_after_forward
        self.reduce_each_micro_batch = cfg.fsdp.reduce_each_micro_batch
        self.checkpointed: list[int] = []
        self.compiled = 0
        self.mesh: Any = None
        # FSDP's all-gather and reduce-scatter bytes of one step, measured by :meth:`counting`.
        self.fsdp_bytes, self.fsdp_wire, self.fsdp_by_kind = 0, 0.0, {}

    @property
    def sharded(self) -> bool:
        return self.shard_size > 1

    def apply(self, model: nn.Module, adapter: ModelAdapter) -> None:
        """Checkpointing, compile and FSDP, in that order (as torchtitan does), on ``model``'s blocks.

        Collective when sharded: the device mesh is created on the first call (on every rank) and
        reused after a re-plan.
        """
        blocks = adapter.blocks(model)
        self.checkpointed = apply_ac(blocks, self.ac_every)
        self.compiled = apply_compile(blocks, self.compile_backend) if self.compile_backend else 0
        if self.sharded:
            from subnetdp.parallel import fsdp

            if self.mesh is None:
                self.mesh = fsdp.replica_mesh(self.comm, self.shard_size)
            fsdp.apply_fsdp(model, blocks, self.mesh["shard"], fsdp.mixed_precision(self.precision),
                            self.reshard_after_forward)

    def applied_after_drop(self, model: nn.Module, adapter: ModelAdapter) -> bool:
        if self.sharded:
            return False
        blocks = adapter.blocks(model)
        held = [i for i, b in enumerate(blocks) if getattr(b, "_subnetdp_checkpointed", False)]
        if held != checkpointed_positions(len(blocks), self.ac_every):
            return False  # checkpointing every k-th block: the positions moved
        self.checkpointed, self.compiled = held, len(blocks) if self.compile_backend else 0
        return True

    def sharding(self) -> Any:
        """What :func:`~subnetdp.sdp.sync.make_synchronizer` needs for sharded gradients
        (:class:`~subnetdp.parallel.fsdp.Sharding`: FSDP's averager), or None."""
        if not self.sharded:
            return None
        from subnetdp.parallel.fsdp import Sharding

        return Sharding(self.shard_size, self.reduce_each_micro_batch)

    def autocast(self) -> Any:
        """bf16 autocast around forward and loss; FSDP's mixed-precision policy casts when sharded.

        With activation checkpointing autocast's cache of bf16 weight copies is off: the copies
        would outlive the blocks whose activations were dropped (1.4 GiB at 1B LLaMA), and the
        recomputation casts again anyway.
        """
        return autocast_for(self.precision, self.comm.device.type, self.sharded, bool(self.checkpointed))

    def memory_tracker(self, baseline: int) -> Any:
        """The dispatch-level tracker of the measured step; with FSDP it counts shards and gathers."""
        if self.sharded:
            from subnetdp.parallel.fsdp import ShardedMemoryTracker

            return ShardedMemoryTracker(baseline)
        from subnetdp.parallel.memory import TensorMemoryTracker

        return TensorMemoryTracker(baseline)

    @contextlib.contextmanager
    def gathered(self, model: nn.Module, writeback: bool = False) -> Iterator[None]:
        """``model`` with full (unsharded) parameters inside the block. Collective when sharded."""
        if not self.sharded:
            yield
            return
        from subnetdp.parallel.fsdp import gathered

        with gathered(model, writeback):
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
        return {"fsdp_shard_size": self.shard_size, "precision": self.precision,
                "activation_checkpointing": len(self.checkpointed), "compiled_blocks": self.compiled}


def autocast_for(precision: str, device_type: str, sharded: bool, checkpointed: bool) -> Any:
    """The forward's autocast context of :meth:`RankParallelism.autocast` (also used by the plan's dry run)."""
    if precision == "bf16" and not sharded:
        return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=not checkpointed)
    return contextlib.nullcontext()


def local_numel(model: nn.Module) -> int:
    """Parameter elements this rank stores (its shards when sharded)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
