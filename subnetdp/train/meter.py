"""The run's measurements (:class:`Meter`): bytes by owner group and phase, memory, step time; digests.

Tensor memory on a CPU is measured by :class:`subnetdp.parallel.memory.TensorMemoryTracker`.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from subnetdp.core.contracts import Communicator
from subnetdp.parallel.memory import live_state_bytes


class Meter:
    """Bytes by owner group and phase, peak memory and step time of one rank's run, in one object.

    The communicator feeds it (its byte counter keeps the step's gradient traffic apart from the
    guard's, the refresh's, the evaluation's and the log's by phase), the parallelism feeds it
    (FSDP's own all-gathers and reduce-scatters, counted on the measured step), and the loop asks
    it for a step's figures. Every step moves the same bytes, so memory and FSDP's bytes are
    measured on one step (``train.memory_step``): measuring slows that step, which is therefore kept
    out of the step times.
    """

    def __init__(self, comm: Communicator, parallel: Any, first: int, steps: int, memory_step: int,
                 held: Any = None, measured: dict[Any, int] | None = None, continued: bool = False) -> None:
        self.comm, self.parallel, self.first = comm, parallel, first
        self.step_times: list[float] = []
        self.last_step_time = 0.0
        self.peak_cpu = 0
        # ``held``: what this rank holds (its plan's digest and its units); ``measured``: the peaks this
        # process measured in the worlds before, by what it held then. A world re-formed in-process
        # (``continued``) measures at its own ``memory_step``-th step (its first warms up, as a run's
        # does), and not at all where this rank holds what it measured before (the members of a world
        # grown back at a join): the figure is that one.
        self.held, self.measured = held, dict(measured or {})
        if not continued:
            self.measured_step: int | None = min(max(memory_step, first), steps)
        elif held in self.measured and not parallel.sharded:
            self.measured_step, self.peak_cpu = None, self.measured[held]
        else:
            self.measured_step = min(first + memory_step - 1, steps)
        self.step_peak = 0
        self._groups_at_start = dict(comm.bytes.by_group)
        self._phases_at_start = {p: comm.bytes.total(p) for p in comm.bytes.by_phase}
        self._ring_at_start = comm.bytes.ring_estimate()
        self._untimed = 0.0
        # The worker id of each rank of this world (the job's first ranks; a replacement's own id): a death
        # or a join renumbers the ranks, so groups are reported in worker ids, which never change meaning.
        self.workers = tuple(getattr(comm, "origin", None) or range(comm.world_size))
        self.done = 0  # steps finished in this world
        self._groups_at_step_end = dict(self._groups_at_start)
        self._earlier: dict[tuple[int, ...], tuple[int, int]] = {}  # the worlds before: (bytes, steps) by group

    @contextlib.contextmanager
    def step(self, step: int, state: Callable[[], Iterable[torch.Tensor]]) -> Iterator[None]:
        """Time the step; on the measured step, its peak tensor memory (CPU) and FSDP's bytes too.

        ``state`` gives the tensors that live across steps (the memory baseline).
        """
        probe = step == self.measured_step
        measure = self.comm.device.type == "cpu" and probe
        t0 = time.perf_counter()
        tracker = self.parallel.memory_tracker(live_state_bytes(state())) if measure else contextlib.nullcontext()
        with tracker, self.parallel.counting(probe):  # FSDP's all-gathers and reduce-scatters, when sharded
            yield
        self.last_step_time = time.perf_counter() - t0 - self._untimed
        self._untimed = 0.0
        self.done += 1
        self._groups_at_step_end = dict(self.comm.bytes.by_group)  # what a world left by a death had moved
        if measure or (probe and self.parallel.sharded):
            self.peak_cpu = tracker.peak if measure else 0
            if measure and self.held is not None:
                self.measured[self.held] = self.peak_cpu
        else:
            self.step_times.append(self.last_step_time)
        # A log step's figure is the peak up to its step's end: its evaluation, reported after it, is not in it.
        self.step_peak = self.peak_memory()

    def untimed(self, seconds: float) -> None:
        """Leave ``seconds`` of the current step out of its time (a probe that is not training)."""
        self._untimed += seconds

    def group_bytes(self) -> dict[tuple[int, ...], int]:
        """Gradient payload per owner group (ranks of this world) since this world's first step. The
        counter keeps the keys of the worlds before a re-formation: they moved nothing since."""
        start = self._groups_at_start
        return {g: n - start.get(g, 0) for g, n in self.comm.bytes.by_group.items() if n != start.get(g, 0)}

    def worker_group(self, group: tuple[int, ...]) -> tuple[int, ...]:
        """``group`` (ranks of this world) as worker ids, sorted."""
        return tuple(sorted(self.workers[r] for r in group))

    def worker_group_bytes(self, finished: bool = False) -> tuple[dict[tuple[int, ...], int], dict[tuple[int, ...], int]]:
        """Payload bytes and steps per owner group named by worker ids, over every world this process
        trained in (:meth:`take_over` adds the worlds before). ``finished``: this world up to its last
        finished step (what a world left by a death hands over), else up to now."""
        start = self._groups_at_start
        now = self.comm.bytes.by_group if not finished else self._groups_at_step_end
        payload = {g: b for g, (b, _) in self._earlier.items()}
        steps = {g: n for g, (_, n) in self._earlier.items()}
        for g, n in now.items():
            if n != start.get(g, 0):
                key = self.worker_group(g)
                payload[key] = payload.get(key, 0) + n - start.get(g, 0)
                steps[key] = steps.get(key, 0) + self.done
        return payload, steps

    def take_over(self, earlier: tuple[dict[tuple[int, ...], int], dict[tuple[int, ...], int]] | None) -> None:
        """Count the bytes by group of the worlds before a re-formation (:meth:`worker_group_bytes` of
        the meter of the world before) into this world's figures."""
        if earlier:
            payload, steps = earlier
            self._earlier = {g: (payload[g], steps[g]) for g in payload}

    def phase_bytes(self) -> dict[str, int]:
        """Payload outside the training step since the first step of this process, by phase (the
        evaluation's fetches, the guard, the log's losses, the refresh, a re-draw, the stop flag)."""
        start = self._phases_at_start
        return {p: self.comm.bytes.total(p) - start.get(p, 0) for p in sorted(self.comm.bytes.by_phase)}

    def bytes_per_step(self, done: int) -> tuple[float, float]:
        """Payload and ring wire estimate per step over ``done`` steps: averaging, refresh and FSDP's own."""
        b, par = self.comm.bytes, self.parallel
        refresh = self.phase_bytes().get("refresh", 0)
        payload = sum(self.group_bytes().values()) + refresh
        wire = b.ring_estimate() - self._ring_at_start + refresh  # a broadcast's payload is its wire bytes
        return payload / done + par.fsdp_bytes, wire / done + par.fsdp_wire

    def mean_step_time(self, window: int) -> float:
        times = self.step_times[-window:] or [self.last_step_time]
        return sum(times) / len(times)

    def peak_memory(self) -> int:
        """The measured step's tensor peak on a CPU; the CUDA allocator's peak on a GPU."""
        device = self.comm.device
        return self.peak_cpu or (int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0)

    def rank_scalars(self, step: int) -> dict[str, float]:
        """The per-rank figures a log step shows."""
        done = step - self.first + 1
        sent, wire = self.bytes_per_step(done)
        out = {"rank/bytes_sent_per_step": sent, "rank/wire_bytes_per_step": wire,
               "rank/peak_memory_bytes": self.step_peak}
        # This world's groups, named by worker ids: a tag keeps one group's meaning across a death or a join.
        out.update({f"rank/bytes_by_group/{group_label(self.worker_group(g))}": n / done
                    for g, n in self.group_bytes().items()})
        return out


def group_label(group: tuple[int, ...]) -> str:
    """A group's name in TensorBoard tags and JSON keys: its ranks joined by ``-`` (``0-2-3``)."""
    return "-".join(str(r) for r in group)


def bytes_by_group(payload: dict[tuple[int, ...], int],
                   steps: int | dict[tuple[int, ...], int]) -> dict[str, dict[str, float]]:
    """Per owner group: payload bytes per step and the ring all-reduce wire estimate ``2(k-1)/k`` x payload.

    ``steps``: the steps the payload was moved in, one number for every group or one per group (a group
    of a world left by a death moved bytes only in that world's steps); a group's entry says it."""
    out = {}
    for group in sorted(payload, key=lambda g: (len(g), g)):
        n = steps if isinstance(steps, int) else steps[group]
        per_step = payload[group] / max(n, 1)
        k = len(group)
        out[group_label(group)] = {"k": k, "payload_bytes_per_step": per_step,
                                   "wire_bytes_per_step_ring": 2 * (k - 1) / k * per_step if k > 1 else 0.0}
        if not isinstance(steps, int):
            out[group_label(group)]["steps"] = n
    return out


def tensor_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a rank's parameters and buffers (names, dtypes, shapes, bytes) in module order.

    Two ranks, runs or launch modes holding bit-identical tensors give the same digest.
    """
    h = hashlib.sha256()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        flat = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}:{flat.dtype}:{tuple(t.shape)};".encode())
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()
