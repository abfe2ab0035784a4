"""Communicator ``local``: one process, no process group; every collective is the identity.

The loop takes the same path with it as with a real backend, so single-process runs never branch
on "distributed or not".
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from subnetdp.core.contracts import Communicator, DoneHandle, Handle
from subnetdp.core.errors import ConfigError
from subnetdp.core.hookspecs import hookimpl


class LocalCommunicator(Communicator):
    """The null communicator for world size 1."""

    @classmethod
    def check_world_size(cls, world_size: int) -> None:
        if world_size != 1:
            raise ConfigError("comm.name", "local", f"runs one process, but {world_size} were asked for",
                              "use comm.name=gloo (or nccl, mpi), or launch.nproc=1")

    def check_environment(self) -> None:
        if self.world_size != 1:
            raise ConfigError("comm.name", "local", f"runs one process, but the launcher started "
                              f"{self.world_size}", "use comm.name=gloo (or nccl, mpi)")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def init(self) -> None:
        return None

    def new_group(self, ranks: Sequence[int]) -> None:
        return None

    def all_reduce(self, tensor: torch.Tensor, group: Sequence[int], async_op: bool = False) -> Handle:
        return DoneHandle()

    def broadcast(self, tensor: torch.Tensor, src: int, group: Sequence[int] | None = None) -> None:
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None


@hookimpl
def subnetdp_register_communicators(registry) -> None:
    registry.add("local", LocalCommunicator)
