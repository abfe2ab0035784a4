"""Communicator ``gloo``: ``torch.distributed`` over Gloo (CPU tensors)."""

from __future__ import annotations

import torch

from subnetdp import hookimpl
from subnetdp.plugins.comm.torch_dist import TorchDistCommunicator


class GlooCommunicator(TorchDistCommunicator):
    """Gloo: CPU tensors, any number of ranks on one machine or across machines."""

    backend = "gloo"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


@hookimpl
def subnetdp_register_communicators(registry) -> None:
    registry.add("gloo", GlooCommunicator)
