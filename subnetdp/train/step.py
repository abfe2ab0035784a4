"""The training step: one function for the loop and for both dry runs of ``subnetdp plan``.

The plan's memory and byte estimates are this function run under ``FakeTensorMode``, so the
estimate and the run cannot drift apart. What differs between them is given, not branched on: the
batches (real, or one fake batch repeated), the guard (:class:`~subnetdp.sdp.sync.NonFiniteGuard`,
or the dry run's, which cannot read a value) and the synchroniser (grouped or sharded).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch

from subnetdp.core.contracts import GradSynchronizer, ModelAdapter


@dataclass
class StepResult:
    """What one step leaves behind."""

    loss: torch.Tensor  # this rank's loss of the step (micro-batches summed, each / accum), detached
    grad_norm: float | None  # the averaged gradient's global norm, when it was needed
    updated: bool  # False when the guard skipped a non-finite step


def train_step(model: torch.nn.Module, adapter: ModelAdapter, batches: Iterator[Any], sync: GradSynchronizer,
               optimizer: torch.optim.Optimizer, guard: Any, *, step: int, accum: int = 1, clip: float = 0.0,
               need_norm: bool = False, autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
               scheduler: Any = None, refresher: Any = None, outer: Any = None, last_step: int = 0,
               probe: Callable[[list[Any]], None] | None = None,
               device: torch.device | None = None) -> StepResult:
    """One optimizer step of this rank: forward and backward of ``accum`` micro-batches, averaging, update.

    Call ``sync.prepare()`` first (it drops the last step's gradients, so a memory baseline taken
    after it holds only what lives across steps).

    Args:
        batches: yields this rank's micro-batches (already on the device).
        guard: ``carry(sync, loss)``, ``check(step, sync, loss, need_norm) -> (finite, norm)`` and
            ``clip(sync, norm, max_norm)``.
        step: the step's number (the refresh and the guard's messages use it).
        need_norm: compute the gradient norm even without clipping (log steps show it).
        refresher: backward masking's broadcaster of owners' values, or None.
        probe: called with the step's micro-batches after averaging and before the update (the
            gradient-alignment probe, ``train.grad_alignment_every``), or None.
        outer: ``sync.mode=local_steps``: the synchroniser whose owners average their parameter
            deltas every ``sync.every`` steps and at ``last_step``, or None.
    """
    loss_sum = torch.zeros((), device=device)
    seen: list[Any] = []
    for micro in range(accum):
        batch = next(batches)
        if probe is not None:
            seen.append(batch)
        last = micro == accum - 1
        with contextlib.nullcontext() if last else sync.no_sync():  # all but the last accumulate locally
            with autocast():
                loss = adapter.training_loss(model, batch) / accum
            loss_sum += loss.detach()
            if last:
                guard.carry(sync, loss_sum)  # the loss's inf/NaN flag travels with the gradients
            loss.backward()
    sync.finish()  # collective: owner groups average this step's gradients
    if probe is not None:
        probe(seen)  # collective: every rank reaches the probe on the same steps
    # collective below C = 1: every rank learns whether any rank saw inf/NaN (train.on_nonfinite),
    # in the gradient-norm all-reduce when clipping or logging needs the norm.
    finite, norm = guard.check(step, sync, loss_sum, need_norm=clip > 0 or need_norm)
    if finite:
        guard.clip(sync, norm, clip)
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    if outer is not None and outer.due(step, last_step):
        outer.synchronise(step)  # collective: owners average their parameter deltas; the outer optimizer steps
    if refresher is not None and refresher.due(step):
        comm = refresher.comm
        with comm.bytes.phase("refresh"):
            refresher.refresh()  # collective: owners' new values reach every rank
    return StepResult(loss_sum, norm, finite)
