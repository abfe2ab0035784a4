"""The communicator contract: collectives over owner groups, their handles and byte counting."""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Sequence

if TYPE_CHECKING:
    import torch

from subnetdp.core.contracts.types import LaunchEnv
from subnetdp.core.contracts.plugin import CommConfig, Plugin


class Handle(abc.ABC):
    """An in-flight collective."""

    @abc.abstractmethod
    def wait(self) -> None: ...


class DoneHandle(Handle):
    """A collective that completed synchronously."""

    def wait(self) -> None:
        return None


@dataclass
class ByteCounter:
    """Payload bytes handed to collectives, per group (sorted rank tuple) and phase.

    ``by_group`` holds the training step's traffic (phase ``"step"``: the gradient averaging); a
    collective issued inside ``with counter.phase(name):`` (the inf/NaN guard, the refresh, the
    evaluation, the loss shown in the log) is kept apart in ``by_phase[name]``, so no caller has to
    save and restore the step's figures around its own traffic.
    """

    by_group: dict[tuple[int, ...], int] = field(default_factory=dict)
    by_phase: dict[str, dict[tuple[int, ...], int]] = field(default_factory=dict)
    calls: int = 0
    #: Collectives issued per phase (``"step"`` included) and group: a round trip each, whatever its size.
    calls_by_phase: dict[str, dict[tuple[int, ...], int]] = field(default_factory=dict)
    current: str = "step"

    def add(self, group: tuple[int, ...], nbytes: int) -> None:
        into = self.by_group if self.current == "step" else self.by_phase.setdefault(self.current, {})
        into[group] = into.get(group, 0) + nbytes
        self.calls += 1
        counts = self.calls_by_phase.setdefault(self.current, {})
        counts[group] = counts.get(group, 0) + 1

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the collectives issued inside the block under ``name`` instead of the step's."""
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def total(self, phase: str = "step") -> int:
        return sum((self.by_group if phase == "step" else self.by_phase.get(phase, {})).values())

    def ring_estimate(self) -> float:
        """Bytes a ring all-reduce puts on the wire per rank: ``2 (k-1)/k`` times the payload (step phase)."""
        return sum(2 * (len(g) - 1) / len(g) * b for g, b in self.by_group.items() if len(g) > 1)

    def reset(self) -> None:
        self.by_group.clear()
        self.by_phase.clear()
        self.calls_by_phase.clear()
        self.calls = 0


class Communicator(Plugin, abc.ABC):
    """Collectives over the world and over owner groups.

    ``init`` is the only place a process group is created; everything before it (config, plan
    validation) runs without one. Groups are identified by the sorted tuple of their ranks.
    """

    Config: ClassVar[type] = CommConfig
    #: Its groups are ``torch.distributed`` process groups, which FSDP2 shards over (``fsdp.shard_size > 1``).
    supports_fsdp: ClassVar[bool] = False

    def __init__(self, cfg: Any, env: LaunchEnv) -> None:
        super().__init__(cfg)
        self.env = env
        self.bytes = ByteCounter()

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world(self) -> tuple[int, ...]:
        return tuple(range(self.world_size))

    @property
    @abc.abstractmethod
    def device(self) -> "torch.device":
        """The device this rank computes on."""

    @abc.abstractmethod
    def init(self) -> None:
        """Create the world process group. Collective: every rank calls it."""

    def check_environment(self) -> None:
        """Raise :class:`ConfigError` if this backend cannot run here (called before ``init``)."""

    @classmethod
    def check_world_size(cls, world_size: int) -> None:
        """Raise :class:`ConfigError` if this backend cannot run ``world_size`` ranks.

        Called before any worker is started (``subnetdp train`` with ``launch.nproc``, ``subnetdp launch``).
        """

    @classmethod
    def check_machine(cls, name: str) -> None:
        """Raise :class:`ConfigError` if the launching machine lacks what this backend needs (CUDA for
        nccl); called in the launching process before workers start, skipped where they run elsewhere (srun)."""

    @classmethod
    def device_type(cls, cfg: Any) -> str:
        """``cpu`` or ``cuda``: what a rank computes on with the ``comm`` section ``cfg``, known before any
        process exists (``device`` tells the same of an instance). ``train.device`` must agree with it."""
        return "cpu"

    @classmethod
    def check_launcher(cls, launcher: str, nproc: int) -> None:
        """Raise :class:`ConfigError` if ``launcher`` cannot start this backend's ranks; called before it
        starts any. ``launcher``: ``local`` (``subnetdp train launch.nproc=N``), ``torchrun``, ``mpirun``
        or ``srun`` (``subnetdp launch``)."""

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> None:
        """Create the group of ``ranks``. Collective: every rank calls it, in the same order."""

    @abc.abstractmethod
    def all_reduce(self, tensor: "torch.Tensor", group: Sequence[int], async_op: bool = False) -> Handle:
        """Sum ``tensor`` in place over ``group`` (sorted ranks; the caller must be a member)."""

    @abc.abstractmethod
    def broadcast(self, tensor: "torch.Tensor", src: int, group: Sequence[int] | None = None) -> None:
        """Copy ``tensor`` from ``src`` to every member of ``group`` (default: the world)."""

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order. Collective over the world."""

    @abc.abstractmethod
    def barrier(self) -> None: ...

    def shutdown(self) -> None:
        """Destroy the process groups."""


class NullCommunicator(Communicator):
    """Collectives that move nothing and return at once, on the CPU, with no process group.

    The communicator ``local`` is one (world size 1: every collective is the identity, so a
    single-process run takes the distributed path). The plan's dry runs use one as rank ``r`` of W
    in a single process, with ``counts_bytes`` on: each collective then records the payload a real
    backend would have been handed, and the estimate of bytes per step comes from the same calls.
    """

    #: Record each collective's payload in ``bytes`` (off for ``local``, whose runs send nothing).
    counts_bytes: ClassVar[bool] = False

    @property
    def device(self) -> "torch.device":
        import torch  # core does not import torch at load

        return torch.device("cpu")

    def init(self) -> None:
        return None

    def new_group(self, ranks: Sequence[int]) -> None:
        return None

    def all_reduce(self, tensor: "torch.Tensor", group: Sequence[int], async_op: bool = False) -> Handle:
        if self.counts_bytes:
            self.bytes.add(tuple(group), tensor.numel() * tensor.element_size())
        return DoneHandle()

    def broadcast(self, tensor: "torch.Tensor", src: int, group: Sequence[int] | None = None) -> None:
        if self.counts_bytes:
            self.bytes.add(self.world if group is None else tuple(group), tensor.numel() * tensor.element_size())

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.world_size

    def barrier(self) -> None:
        return None
