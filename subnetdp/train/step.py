"""The training step: one function for the loop and for both dry runs of ``subnetdp plan``.

The plan's memory and byte estimates are this function run under ``FakeTensorMode``, so the
estimate and the run cannot drift apart. What differs between them is given in a
:class:`StepContext`, not branched on: the batches (real, or one fake batch repeated), the guard
(:class:`~subnetdp.sdp.sync.NonFiniteGuard`, or the dry run's, which cannot read a value) and the
synchroniser (grouped, sharded or local steps: one protocol, made by
:func:`~subnetdp.sdp.sync.make_synchronizer`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch

from subnetdp.core.contracts import ModelAdapter
from subnetdp.sdp.sync import GradSynchronizer


@dataclass
class StepResult:
    """What one step leaves behind."""

    loss: torch.Tensor  # this rank's loss of the step (micro-batches summed, each / accum), detached
    grad_norm: float | None  # the averaged gradient's global norm, when it was needed
    updated: bool  # False when the guard skipped a non-finite step
    #: rank -> pending stop signal, agreed in the step's world reduction or local steps'
    #: synchronisation (empty: go on); None when the step issued neither (local steps between
    #: synchronisations): the loop then agrees on its own with ``sync.stop_every_step``, else not at all.
    stops: dict[int, int] | None = None


@dataclass
class StepProgress:
    """How far the step in progress got: what recovery from the survivors needs when a peer dies in it.

    ``updated``: this rank applied the step's optimizer update (and stepped the schedule);
    ``settled``: and every collective that changes its parameters after the update (local steps'
    synchronisation) completed, so the values it holds are the step's final ones; ``loss``: this
    rank's loss of the step once updated (a survivor keeps it for the step's log row).
    """

    step: int = 0
    updated: bool = False
    settled: bool = False
    loss: Any = None


@dataclass(frozen=True)
class StepContext:
    """What a step works with: made by the training state for the loop, by each dry run for its own.

    Attributes:
        model: the rank's model, in training mode.
        adapter: its model adapter (``training_loss``).
        sync: the synchroniser (:class:`~subnetdp.sdp.sync.GradSynchronizer`).
        optimizer: the rank's optimizer.
        guard: ``carry(sync, loss, signum)``, ``check(step, sync, loss, need_norm, signum) ->
            Checked(finite, norm, stops)`` and
            ``clip(sync, norm, max_norm)``: :class:`~subnetdp.sdp.sync.NonFiniteGuard`, or a dry run's.
        scheduler: the learning-rate schedule, stepped after every step (None: none).
        refresher: backward masking's broadcaster of owners' values, or None.
        accum: micro-batches per step (``train.grad_accum``).
        clip: ``optim.clip_grad_norm`` (0: no clipping).
        autocast: the forward's autocast context.
        device: where the loss is summed.
        last_step: the run's last step (``train.steps``): local steps synchronise there whatever the cycle.
        fault: test-only: called with ``"sync"`` before the averaging completes, ``"optimizer"`` (and
            the optimizer) just before the update, and ``"update"`` after it (real kills at those
            moments, ``"optimizer"``'s amid the update); None in every real run.
        averaged_in_backward: the model trains through :class:`~subnetdp.parallel.wrapper.SubnetworkParallel`,
            whose end-of-backward callback finishes the averaging (and fires the ``"sync"`` fault), as in
            a user's loop; the step's own ``sync.finish()`` then does nothing.
    """

    model: torch.nn.Module
    adapter: ModelAdapter
    sync: GradSynchronizer
    optimizer: torch.optim.Optimizer
    guard: Any
    scheduler: Any = None
    refresher: Any = None
    accum: int = 1
    clip: float = 0.0
    autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    device: torch.device | None = None
    last_step: int = 0
    fault: Callable[..., None] | None = None  # test-only fault injection (``sync``, ``optimizer``, ``update``)
    averaged_in_backward: bool = False


def train_step(ctx: StepContext, batches: Iterator[Any], *, step: int, need_norm: bool = False,
               probe: Callable[[list[Any]], None] | None = None, progress: StepProgress | None = None,
               pending_signal: Callable[[], int] | None = None) -> StepResult:
    """One optimizer step of this rank: forward and backward of ``ctx.accum`` micro-batches, averaging, update.

    Call ``ctx.sync.prepare()`` first (it drops the last step's gradients, so a memory baseline taken
    after it holds only what lives across steps).

    Args:
        ctx: the model, synchroniser, optimizer and the rest the step works with.
        batches: yields this rank's micro-batches (already on the device).
        step: the step's number (the refresh, local steps and the guard's messages use it).
        need_norm: compute the gradient norm even without clipping (log steps show it).
        probe: called with the step's micro-batches after averaging and before the update (the
            gradient-alignment probe, ``train.grad_alignment_every``), or None.
        progress: updated as the step passes its update (recovery reads it when a collective fails).
        pending_signal: this rank's pending stop signal (0: none), read when the guard's flags leave;
            the step's world reduction carries it, and :attr:`StepResult.stops` says who holds one.
    """
    sync, guard, accum = ctx.sync, ctx.guard, ctx.accum
    signal = pending_signal if pending_signal is not None else (lambda: 0)
    progress = progress if progress is not None else StepProgress()
    progress.step, progress.updated, progress.settled, progress.loss = step, False, False, None
    loss_sum = torch.zeros((), device=ctx.device)
    seen: list[Any] = []
    for micro in range(accum):
        batch = next(batches)
        if probe is not None:
            seen.append(batch)
        last = micro == accum - 1
        with contextlib.nullcontext() if last else sync.no_sync():  # all but the last accumulate locally
            with ctx.autocast():
                loss = ctx.adapter.training_loss(ctx.model, batch) / accum
            loss_sum += loss.detach()
            if last:
                guard.carry(sync, loss_sum, signal())  # the loss's inf/NaN flag and a stop travel with the gradients
            loss.backward()
    if ctx.fault is not None and not ctx.averaged_in_backward:
        ctx.fault("sync", step)  # the wrapper fires it in its end-of-backward callback
    # collective: owner groups average this step's gradients (through the wrapper, the last backward
    # did, from its end-of-backward callback, and this call does nothing).
    sync.finish()
    if probe is not None:
        probe(seen)  # collective: every rank reaches the probe on the same steps
    # collective below C = 1: every rank learns whether any rank saw inf/NaN (train.on_nonfinite) or
    # holds a stop signal, in the gradient-norm all-reduce when clipping or logging needs the norm.
    checked = guard.check(step, sync, loss_sum, need_norm=ctx.clip > 0 or need_norm, signum=signal())
    finite, norm = checked.finite, checked.norm
    if finite:
        guard.clip(sync, norm, ctx.clip)
        if ctx.fault is not None:
            ctx.fault("optimizer", step, ctx.optimizer)  # test-only: a kill amid the update that follows
        ctx.optimizer.step()
    if ctx.fault is not None:
        ctx.fault("update", step)
    if ctx.scheduler is not None:
        ctx.scheduler.step()
    progress.loss = loss_sum  # read (on the host) only by a survivor
    progress.updated = True  # the commit point is behind: every rank contributed to the last world collective
    # collective when due: local steps' owners average their parameter deltas and the outer optimizer
    # steps; every rank's pending signal rides in its world bucket.
    agreed = sync.after_update(step, ctx.last_step, signal())
    stops = checked.stops if agreed is None else agreed
    progress.settled = True
    if ctx.refresher is not None and ctx.refresher.due(step):
        comm = ctx.refresher.comm
        with comm.bytes.phase("refresh"):
            ctx.refresher.refresh()  # collective: owners' new values reach every rank
    return StepResult(loss_sum, norm, finite, stops)
