"""Tensor memory on a CPU: a dispatch-level tracker and the bytes of a training state.

Memory on a GPU is the CUDA allocator's peak. On a CPU it is measured by
:class:`TensorMemoryTracker`, a dispatch-level tracker that counts every tensor storage once when an
operator creates it and subtracts it when it is freed; it sees every tensor torch allocates but not
the buffers a communication library keeps for itself. It sits beside the parallelisms because FSDP's
tracker (:class:`~subnetdp.parallel.fsdp.ShardedMemoryTracker`) extends it.
"""

from __future__ import annotations

import weakref
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
            # A meta tensor has a size but no memory (a skeleton model built on the meta device).
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage()._cdata not in inputs:
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
