"""Measurements (tensor memory, bytes) and the run's outputs (TensorBoard, metrics.jsonl).

Memory on a GPU is the CUDA allocator's peak. On a CPU it is measured by
:class:`TensorMemoryTracker`, a dispatch-level tracker that counts every tensor storage once when an
operator creates it and subtracts it when it is freed; it sees every tensor torch allocates but not
the buffers a communication library keeps for itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemoryTracker(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the ``with`` block, plus a baseline.

    Args:
        baseline: bytes already live when the block starts (parameters, gradients, optimizer state),
            see :func:`live_state_bytes`.
    """

    def __init__(self, baseline: int = 0) -> None:
        super().__init__()
        self.baseline = baseline
        self.current = baseline
        self.peak = baseline
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output that shares storage with an input (in-place ops, views, out=) allocated nothing:
        # that storage is either counted already or part of the baseline.
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)


def live_state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def training_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                           extra: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer state: what lives across steps.

    Sharded tensors (FSDP2's DTensors) count with this rank's shard.
    """
    out: list[torch.Tensor] = list(model.parameters()) + list(model.buffers())
    out += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    out += list(extra)
    return [t.to_local() if hasattr(t, "to_local") else t for t in out]


class RunLogger:
    """Writes a run's ``metrics.jsonl`` and TensorBoard events.

    Rank 0 writes the global series to ``RUN_DIR/tensorboard``; every rank writes the values that
    differ by rank (memory, bytes, step time, its local loss) to ``RUN_DIR/tensorboard/rank_{r}``,
    so TensorBoard shows one curve per rank under the same tag.
    """

    def __init__(self, run_dir: Path, rank: int, tensorboard: bool = True) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.global_writer = None
        self.rank_writer = None
        self._jsonl = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = run_dir / "tensorboard"
            if rank == 0:
                self.global_writer = SummaryWriter(str(tb))
            self.rank_writer = SummaryWriter(str(tb / f"rank_{rank}"))
        if rank == 0:
            self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")

    def scalars(self, step: int, values: dict[str, float], per_rank: bool = False) -> None:
        writer = self.rank_writer if per_rank else self.global_writer
        if writer is None:
            return
        for k, v in values.items():
            if v is not None:
                writer.add_scalar(k, float(v), step)

    def jsonl(self, record: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()

    def text(self, tag: str, text: str) -> None:
        if self.global_writer is not None:
            self.global_writer.add_text(tag, text, 0)

    def figure(self, tag: str, fig: Any, step: int = 0) -> None:
        if self.global_writer is not None:
            self.global_writer.add_figure(tag, fig, step)

    def image(self, tag: str, img: Any, step: int = 0) -> None:
        if self.global_writer is not None:
            self.global_writer.add_image(tag, img, step, dataformats="HW")

    def close(self) -> None:
        for w in (self.global_writer, self.rank_writer):
            if w is not None:
                w.flush()
                w.close()
        if self._jsonl is not None:
            self._jsonl.close()


def plan_figure(owned_image: Any, unit_names: list[str], counts: list[int]) -> Any:
    """A ranks x units heat map of the mask plan, with owner counts in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks, units = owned_image.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * units + 1.5), max(2.0, 0.35 * ranks + 1.2)))
    ax.imshow(owned_image, cmap="Blues", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(units), unit_names, rotation=90, fontsize=7)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=7)
    ax.set_title(f"mask plan (owners per unit: {min(counts)}..{max(counts)})", fontsize=9)
    fig.tight_layout()
    return fig


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temporary name, fsync, rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def group_label(group: tuple[int, ...]) -> str:
    """A group's name in TensorBoard tags and JSON keys: its ranks joined by ``-`` (``0-2-3``)."""
    return "-".join(str(r) for r in group)


def bytes_by_group(payload: dict[tuple[int, ...], int], steps: int) -> dict[str, dict[str, float]]:
    """Per owner group: payload bytes per step and the ring all-reduce wire estimate ``2(k-1)/k`` x payload."""
    out = {}
    for group in sorted(payload, key=lambda g: (len(g), g)):
        per_step = payload[group] / steps
        k = len(group)
        out[group_label(group)] = {"k": k, "payload_bytes_per_step": per_step,
                                   "wire_bytes_per_step_ring": 2 * (k - 1) / k * per_step if k > 1 else 0.0}
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
