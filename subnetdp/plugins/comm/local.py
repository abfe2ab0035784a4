"""Communicator ``local``: one process, no process group; every collective is the identity.

The loop takes the same path with it as with a real backend, so single-process runs never branch
on "distributed or not". The collectives are the contract's do-nothing ones
(:class:`subnetdp.NullCommunicator`, which the plan's dry runs share); this plugin
adds only the checks that it runs one process.
"""

from __future__ import annotations

from subnetdp import ConfigError, NullCommunicator, hookimpl


class LocalCommunicator(NullCommunicator):
    """The null communicator for world size 1."""

    ignores = {"init_method": "it runs one process and creates no process group",
               "timeout_s": "it runs one process: no collective ever waits"}

    @classmethod
    def check_world_size(cls, world_size: int) -> None:
        if world_size != 1:
            raise ConfigError("comm.name", "local", f"runs one process, but {world_size} were asked for",
                              "use comm.name=gloo (or nccl, mpi), or launch.nproc=1")

    def check_environment(self) -> None:
        if self.world_size != 1:
            raise ConfigError("comm.name", "local", f"runs one process, but the launcher started "
                              f"{self.world_size}", "use comm.name=gloo (or nccl, mpi)")


@hookimpl
def subnetdp_register_communicators(registry) -> None:
    registry.add("local", LocalCommunicator)
