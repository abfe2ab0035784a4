"""Communicator ``nccl``: ``torch.distributed`` over NCCL, one GPU per local rank.

Rank ``r`` computes on ``cuda:LOCAL_RANK``; the model, the synchroniser's gradient buckets and every
collective live on that GPU. Owner groups are NCCL communicators created once at set-up (each costs
GPU memory, hence ``sync.max_groups``). Works under torchrun, mpirun (rank 0 broadcasts a free port
over MPI) and srun.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from subnetdp import ConfigError, hookimpl
from subnetdp.plugins.comm.torch_dist import TorchDistCommunicator


class NcclCommunicator(TorchDistCommunicator):
    """NCCL: CUDA tensors, one process per GPU."""

    backend = "nccl"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank)

    @classmethod
    def validate_config(cls, node: Any, cfg: Any) -> None:
        if cfg.train.device == "cpu":
            raise ConfigError("train.device", "cpu", f"comm.name={node.name} computes on cuda:LOCAL_RANK",
                              "use train.device=auto (or cuda), or comm.name=gloo to train on CPUs")

    @classmethod
    def device_type(cls, cfg: Any) -> str:
        return "cuda"

    @classmethod
    def check_machine(cls, name: str = "nccl") -> None:
        """CUDA and NCCL on this machine; called in the launching process before workers start."""
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible (torch.cuda.is_available() is False)")
            raise ConfigError("comm.name", name, f"needs one CUDA GPU per process; {why}",
                              "use comm.name=gloo on CPUs (or comm.name=mpi under mpirun)")
        if not dist.is_nccl_available():
            raise ConfigError("comm.name", name, "this torch build has no NCCL support",
                              "install a CUDA build of torch, or use comm.name=gloo")

    def check_environment(self) -> None:
        """Raise a :class:`ConfigError` before any process group when NCCL cannot run here."""
        name = self.cfg.name
        self.check_machine(name)
        count = torch.cuda.device_count()
        if self.local_rank >= count:
            raise ConfigError("comm.name", name,
                              f"local rank {self.local_rank} needs GPU cuda:{self.local_rank}, but this node "
                              f"has {count} (local world size {self.env.local_world_size})",
                              f"start at most {count} processes per node (NCCL refuses two ranks on one GPU)")

    def init(self) -> None:
        # Bind the device before the process group so NCCL's communicators land on our GPU.
        torch.cuda.set_device(self.device)
        super().init()

    def _init_kwargs(self) -> dict[str, Any]:
        return {"device_id": self.device}

    def barrier(self) -> None:
        # collective: every rank reaches this.
        dist.barrier(device_ids=[self.local_rank])


@hookimpl
def subnetdp_register_communicators(registry) -> None:
    registry.add("nccl", NcclCommunicator)
