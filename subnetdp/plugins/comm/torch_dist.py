"""The ``torch.distributed`` communicators' shared code (``gloo``, ``nccl``; and FSDP's groups).

:class:`TorchDistCommunicator` creates the process group at :meth:`~TorchDistCommunicator.init`,
one sub-group per owner set (entered by every rank, in the same order), and counts every
all-reduce's payload; a subclass names its ``backend`` and ``device``.
"""

from __future__ import annotations

import datetime
import os
import re
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from subnetdp.core.contracts import Communicator, Handle
from subnetdp.core.errors import SubnetdpError
from subnetdp.launchers import rendezvous


class WorkHandle(Handle):
    """Wraps a ``torch.distributed`` work object."""

    def __init__(self, work: Any, comm: "TorchDistCommunicator | None" = None, group: tuple[int, ...] = ()) -> None:
        self.work, self.comm, self.group = work, comm, group

    def wait(self) -> None:
        if self.work is not None:
            if self.comm is None:
                self.work.wait()
            else:
                self.comm._guarded("all_reduce", self.group, self.work.wait)


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text or "deadline" in text


#: What gloo and NCCL say when a peer's process is gone (killed, crashed, or its node left the job).
PEER_GONE = ("connection reset by peer", "connection closed by peer", "broken pipe", "remote process exited")


def _is_peer_gone(error: BaseException) -> bool:
    text = str(error).lower()
    return any(words in text for words in PEER_GONE)


def stalled_peers(store: Any, rank: int, members: Sequence[int], key: str, grace: float) -> list[int]:
    """The members of a timed-out collective that never reported timing out themselves.

    Every member that times out writes ``key/<rank>`` into the world's store; a member that does not
    within ``grace`` seconds was not waiting in the collective: it is the one that stopped answering.
    """
    store.set(f"{key}/{rank}", "timed out")
    deadline = time.monotonic() + grace
    silent = [r for r in members if r != rank]
    while silent and time.monotonic() < deadline:
        silent = [r for r in silent if not store.check([f"{key}/{r}"])]
        time.sleep(0.05)
    return silent


def arrival_error(comm: Communicator, init_method: str, timeout: float, error: BaseException) -> str:
    """A message for a world that did not assemble: how many processes were expected, how many came."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = (f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
             if init_method == "env://" else init_method)
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        arrived = f"only {joined.group(1)} of {comm.world_size} processes arrived"  # rank 0 counts itself
    elif "timed out" in text.lower() or "timeout" in text.lower():
        arrived = f"rank {comm.rank} of {comm.world_size} could not meet the others"
    else:
        return (f"comm.name={comm.cfg.name}: creating the {comm.world_size}-process group at {where} failed: "
                f"{text}")
    return (f"comm.name={comm.cfg.name}: {arrived} at {where} within comm.timeout_s={timeout:g} s "
            f"(the launcher promised world size {comm.world_size}; {comm.env.launcher} launch). Start "
            f"exactly {comm.world_size} processes with the same MASTER_ADDR/MASTER_PORT, or raise "
            f"comm.timeout_s if some start late. ({text})")


class TorchDistCommunicator(Communicator):
    """Shared code of the ``torch.distributed`` backends; subclasses set ``backend``."""

    backend = "gloo"
    supports_fsdp = True

    def __init__(self, cfg: Any, env: Any) -> None:
        super().__init__(cfg, env)
        self._groups: dict[tuple[int, ...], Any] = {}
        self._stalls = 0  # timed-out collectives so far: each gets its own keys in the store

    def init(self) -> None:
        # collective: every rank reaches this; it creates the world process group.
        timeout = float(self.cfg.timeout_s)
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout), **self._init_kwargs()}
        init_method = str(self.cfg.init_method)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if self.world_size == 1 and init_method == "env://":
            kwargs["store"] = dist.HashStore()
        elif attempt is not None and init_method == "env://":
            # torchrun keeps one agent store across restarts of the group, and the keys the process
            # group writes carry no attempt number: a restarted rank could read a dead peer's
            # address. A prefix per attempt keeps every attempt's keys apart.
            store, _, _ = next(dist.rendezvous(init_method, self.rank, self.world_size, timeout=kwargs["timeout"]))
            kwargs["store"] = dist.PrefixStore(f"subnetdp/attempt-{attempt}", store)
        else:
            if init_method == "env://":
                rendezvous(self.env)  # mpirun / srun: MASTER_ADDR and MASTER_PORT from rank 0
            kwargs["init_method"] = init_method
        try:
            dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size, **kwargs)
        except (dist.DistError, RuntimeError, ValueError) as e:
            raise SubnetdpError(arrival_error(self, init_method, timeout, e)) from None
        self._groups[self.world] = dist.group.WORLD

    def _init_kwargs(self) -> dict[str, Any]:
        """Extra ``init_process_group`` arguments of a backend (NCCL binds its device)."""
        return {}

    def new_group(self, ranks: Sequence[int]) -> None:
        key = tuple(sorted(ranks))
        if key in self._groups:
            return
        # collective: every rank creates every group, in the same order, member or not. Owner groups
        # get comm.timeout_s too (torch's default would be 30 minutes for a stalled peer).
        self._groups[key] = dist.new_group(list(key), backend=self.backend,
                                           timeout=datetime.timedelta(seconds=float(self.cfg.timeout_s)))

    def _guarded(self, what: str, group: Sequence[int] | None, call: Any) -> Any:
        """Run a collective; on a timeout, name the rank(s) that stopped answering, not only this one."""
        try:
            return call()
        except (dist.DistError, RuntimeError) as e:
            if _is_peer_gone(e):
                members = tuple(range(self.world_size)) if group is None else tuple(group)
                first = str(e).strip().splitlines()[0][:200]
                # One line, not a traceback per survivor: the agent restarts the group (elastic or
                # --max-restarts) and resume=auto continues from the newest checkpoint.
                raise SubnetdpError(f"rank {self.rank} lost a peer in {what} over ranks {members}: a process "
                                    f"of the job is gone (killed, crashed, or its node left) ({first})") from None
            if not _is_timeout(e):
                raise
            members = tuple(range(self.world_size)) if group is None else tuple(group)
            self._stalls += 1
            try:
                store = dist.distributed_c10d._get_default_store()
                grace = max(2.0, min(10.0, float(self.cfg.timeout_s) / 10))
                silent = stalled_peers(store, self.rank, members, f"subnetdp/stall/{self._stalls}", grace)
            except Exception:  # the store went with the job: say what is known
                silent = []
            who = (f"rank(s) {', '.join(map(str, silent))} stopped answering" if silent
                   else "a peer stopped answering (every other member timed out too)")
            raise SubnetdpError(f"{who}: rank {self.rank} timed out after comm.timeout_s={float(self.cfg.timeout_s):g} s "
                                f"waiting in {what} over ranks {members} — look at the log of "
                                f"{'rank(s) ' + ', '.join(map(str, silent)) if silent else 'the slowest rank'} "
                                "(a crash, a hang, or a much slower step), or raise comm.timeout_s") from None

    def _pg(self, group: Sequence[int] | None) -> Any:
        key = self.world if group is None else tuple(group)
        try:
            return self._groups[key]
        except KeyError:
            raise RuntimeError(f"no process group for ranks {key}: groups must be created at set-up") from None

    def all_reduce(self, tensor: torch.Tensor, group: Sequence[int], async_op: bool = False) -> Handle:
        key = tuple(group)
        self.bytes.add(key, tensor.numel() * tensor.element_size())
        pg = self._pg(key)
        work = self._guarded("all_reduce", key, lambda: dist.all_reduce(tensor, group=pg, async_op=async_op))
        return WorkHandle(work, self, key) if async_op else WorkHandle(None)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Sequence[int] | None = None) -> None:
        key = self.world if group is None else tuple(group)
        self.bytes.add(key, tensor.numel() * tensor.element_size())  # the payload every member hands over
        pg = self._pg(group)
        self._guarded("broadcast", group, lambda: dist.broadcast(tensor, src=src, group=pg))

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._guarded("all_gather_object", None, lambda: dist.all_gather_object(out, obj))
        return out

    def barrier(self) -> None:
        self._guarded("barrier", None, dist.barrier)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._groups.clear()
