"""Communicator ``mpi``: collectives through mpi4py, for clusters where MPI is the fabric.

Start it under ``mpirun`` / ``mpiexec`` (or ``srun`` with PMI): MPI itself knows the world, so
there is no rendezvous. Tensors travel without copies where MPI can read them in place:

- CPU tensors: a numpy view of the contiguous tensor (no copy); a non-contiguous tensor is copied
  to a contiguous buffer and back.
- CUDA tensors: passed to MPI directly when the library is CUDA-aware (``comm.cuda_aware``;
  null asks ``MPIX_Query_cuda_support``), else staged through a pinned host buffer.
- bf16 / fp16: MPI has no such sum (MPICH raises, Open MPI returns garbage), so they are reduced in
  fp32 and rounded back once.

Owner groups are sub-communicators made with ``MPI_Comm_split`` over the world, once, in the
caller's order; ``all_reduce`` with ``async_op`` returns a handle around ``MPI_Iallreduce``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from subnetdp import CommConfig, Communicator, ConfigError, DoneHandle, Handle, SubnetdpError, hookimpl
from subnetdp.plugins.comm._rendezvous import import_mpi

DEVICE_CHOICES = ("cpu", "cuda")
# dtypes MPI cannot sum: reduced in fp32.
_WIDEN = (torch.bfloat16, torch.float16)


def mpi_cuda_aware() -> bool:
    """Whether the loaded MPI library accepts CUDA device pointers (``MPIX_Query_cuda_support``).

    Call after importing ``mpi4py.MPI``, when libmpi is mapped into the process.
    """
    libs = sorted({line.split()[-1] for line in open("/proc/self/maps") if "/libmpi" in line})
    for path in libs:
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        return bool(query())
    return False


class MpiHandle(Handle):
    """An ``MPI_Request`` plus what must happen after it completes (copy back from a staging buffer)."""

    def __init__(self, request: Any, finish: Callable[[], None], keep: Any) -> None:
        self.request, self.finish, self._keep = request, finish, keep

    def wait(self) -> None:
        if self.request is None:
            return
        self.request.Wait()
        self.request = None
        self.finish()
        self._keep = None


@dataclass
class MpiConfig(CommConfig):
    """``comm.*`` for ``mpi``.

    Attributes:
        device: ``cpu``, or ``cuda`` (rank computes on ``cuda:LOCAL_RANK``).
        cuda_aware: null (ask the library), true, or false (stage CUDA tensors through pinned host
            memory).
    """

    device: str = "cpu"
    cuda_aware: Optional[bool] = None


class MpiCommunicator(Communicator):
    """mpi4py: CPU tensors without copies, CUDA tensors directly or through pinned host buffers."""

    Config = MpiConfig
    ignores = {"init_method": "MPI's own launcher makes the world; there is no rendezvous",
               "timeout_s": "MPI's collectives take no timeout"}

    def __init__(self, cfg: Any, env: Any) -> None:
        super().__init__(cfg, env)
        self.MPI: Any = None
        self._comms: dict[tuple[int, ...], Any] = {}
        self._cuda_aware = False

    @classmethod
    def validate_config(cls, node: Any, cfg: Any) -> None:
        if str(node.device) not in DEVICE_CHOICES:
            raise ConfigError("comm.device", node.device, f"valid choices: {', '.join(DEVICE_CHOICES)}")
        if cfg is not None and cfg.train.device not in ("auto", str(node.device)):
            raise ConfigError("train.device", cfg.train.device, f"comm.device={node.device} holds the tensors",
                              f"set comm.device={cfg.train.device} too, or train.device=auto")

    @classmethod
    def device_type(cls, cfg: Any) -> str:
        return "cuda" if cfg.device == "cuda" else "cpu"

    @classmethod
    def check_launcher(cls, launcher: str, nproc: int) -> None:
        if launcher == "mpirun":
            return
        how = (f"launch.nproc={nproc}, whose workers torch's elastic launcher starts" if launcher == "local"
               else launcher)
        raise ConfigError("comm.name", "mpi", f"needs the MPI world of mpirun, not {how}",
                          (f"start it with subnetdp launch --launcher mpirun --nproc {nproc} RECIPE [key=value ...], "
                           "or use comm.name=gloo") if launcher == "local" else "use --launcher mpirun, or comm.name=gloo")

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.cfg.device == "cuda" else torch.device("cpu")

    def check_environment(self) -> None:
        """mpi4py imports, and MPI's world is the world the launcher promised."""
        if self.device.type == "cuda" and torch.cuda.device_count() <= self.local_rank:
            raise ConfigError("comm.device", "cuda", f"local rank {self.local_rank} needs GPU cuda:{self.local_rank}, "
                              f"but {torch.cuda.device_count()} are visible", "use comm.device=cpu")
        MPI = import_mpi("comm.name", self.cfg.name)
        size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
        if size != self.world_size or rank != self.rank:
            raise ConfigError("comm.name", self.cfg.name,
                              f"MPI's world is rank {rank} of {size}, but the {self.env.launcher} launch says rank "
                              f"{self.rank} of {self.world_size}",
                              "start comm.name=mpi with mpirun/mpiexec (subnetdp launch --launcher mpirun), "
                              "or use comm.name=gloo under torchrun")
        self.MPI = MPI

    def init(self) -> None:
        # MPI_Init already ran when mpi4py was imported (check_environment); the world exists.
        if self.MPI is None:
            self.check_environment()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        aware = self.cfg.cuda_aware
        self._cuda_aware = mpi_cuda_aware() if aware is None else bool(aware)
        # collective: every rank reaches this. A duplicate keeps our traffic apart from any other
        # library's on COMM_WORLD (what a library is expected to do).
        self._comms[self.world] = self.MPI.COMM_WORLD.Dup()

    @property
    def cuda_aware(self) -> bool:
        return self._cuda_aware

    def new_group(self, ranks: Sequence[int]) -> None:
        key = tuple(sorted(ranks))
        if key in self._comms:
            return
        world = self._comms[self.world]
        member = self.rank in key
        # collective: every rank splits the world for every group, in the same order, member or not;
        # key=rank keeps the sub-communicator's ranks in global order (sub-rank i = key[i]).
        sub = world.Split(0 if member else self.MPI.UNDEFINED, self.rank)
        self._comms[key] = sub if member else None

    def _comm(self, group: Sequence[int] | None) -> Any:
        key = self.world if group is None else tuple(group)
        try:
            comm = self._comms[key]
        except KeyError:
            raise SubnetdpError(f"no MPI communicator for ranks {key}: groups must be created at set-up") from None
        if comm is None:
            raise SubnetdpError(f"rank {self.rank} is not in group {key}")
        return comm

    # ------------------------------------------------------------------ buffers
    def _stage(self, tensor: torch.Tensor, widen: bool) -> tuple[Any, Callable[[], None]]:
        """An MPI buffer for ``tensor`` and what copies the result back into it (nothing when in place)."""
        work = tensor.detach()
        if widen and work.dtype in _WIDEN:
            work = work.to(torch.float32, memory_format=torch.contiguous_format)
        elif not work.is_contiguous():
            work = work.contiguous()
        if work.is_cuda and not self._cuda_aware:
            host = torch.empty(work.shape, dtype=work.dtype, pin_memory=True)
            host.copy_(work)  # synchronous: the stream's pending kernels finish first
            work = host
        elif work.is_cuda:
            torch.cuda.current_stream(work.device).synchronize()  # MPI does not know torch's streams
        if work.data_ptr() == tensor.data_ptr() and work.dtype == tensor.dtype and work.device == tensor.device:
            return self._buffer(work), lambda: None

        def copy_back() -> None:
            with torch.no_grad():
                tensor.copy_(work)

        return self._buffer(work), copy_back

    def _buffer(self, t: torch.Tensor) -> Any:
        """What mpi4py reads: a numpy view of a CPU tensor, the CUDA tensor itself (its
        ``__cuda_array_interface__``); dtypes without an MPI type travel as bytes (broadcast only)."""
        flat = t.reshape(-1)  # a view: t is contiguous here
        if flat.dtype in _WIDEN or flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        return flat if flat.is_cuda else flat.numpy()

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, group: Sequence[int], async_op: bool = False) -> Handle:
        key = tuple(group)
        self.bytes.add(key, tensor.numel() * tensor.element_size())
        if len(key) == 1 or tensor.numel() == 0:
            return DoneHandle()
        comm = self._comm(key)
        buf, finish = self._stage(tensor, widen=True)
        MPI = self.MPI
        if async_op:
            # collective: every member issues this, in the same order (Iallreduce).
            return MpiHandle(comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM), finish, buf)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        finish()
        return DoneHandle()

    def broadcast(self, tensor: torch.Tensor, src: int, group: Sequence[int] | None = None) -> None:
        key = self.world if group is None else tuple(group)
        self.bytes.add(key, tensor.numel() * tensor.element_size())  # the payload every member hands over
        if len(key) == 1:
            return
        comm = self._comm(key)
        buf, finish = self._stage(tensor, widen=False)
        # collective: every member reaches this; sub-rank of src is its index in the sorted group.
        comm.Bcast(buf, root=key.index(src))
        finish()

    def all_gather_object(self, obj: Any) -> list[Any]:
        # collective: every rank reaches this.
        return list(self._comm(None).allgather(obj))

    def barrier(self) -> None:
        # collective: every rank reaches this.
        self._comm(None).Barrier()

    def shutdown(self) -> None:
        """Free our communicators; MPI itself is finalised by mpi4py at exit."""
        for comm in self._comms.values():
            if comm is not None:
                comm.Free()
        self._comms.clear()


@hookimpl
def subnetdp_register_communicators(registry) -> None:
    registry.add("mpi", MpiCommunicator)
