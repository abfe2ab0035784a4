"""The sharded dry run's communicator: torch's *fake* process group, whose real groups FSDP2 and
device meshes need (their collectives return at once and move nothing).

The dry run without FSDP needs no process group at all
(:class:`~subnetdp.plan.dryrun.DryRunCommunicator`); both are the contract's do-nothing
communicator (:class:`~subnetdp.core.contracts.NullCommunicator`) counting their payload. This one
lives here because only ``parallel/`` (with ``plugins/comm/`` and ``launchers/``) imports
``torch.distributed``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from subnetdp.core.contracts import Handle, LaunchEnv, NullCommunicator


class _Work:
    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()


class FakeGroupCommunicator(NullCommunicator):
    """Rank ``rank`` of ``world_size`` over torch's fake process group: real groups, no traffic.

    FSDP2 and device meshes need ``torch.distributed`` groups; their collectives return at once.
    The communicator's own all-reduces and broadcasts still count their payload.
    """

    counts_bytes = True

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(None, LaunchEnv(rank, world_size, rank, world_size, "dry-run"))
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

    @staticmethod
    def initialized() -> bool:
        return dist.is_initialized()


def fake_mesh(world_size: int, shard_size: int) -> DeviceMesh:
    """The (replica, shard) CPU mesh over the fake process group (made outside FakeTensorMode)."""
    return init_device_mesh("cpu", (world_size // shard_size, shard_size), mesh_dim_names=("replica", "shard"))
