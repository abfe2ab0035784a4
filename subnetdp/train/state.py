"""The training state of one rank: its model and everything built on it, changed only by its own methods.

:class:`TrainState` owns the partition, the plan, the rank's model and parameter map, the
parallelisms applied to it, the optimizer, the learning-rate schedule, the synchroniser, backward
masking's refresher, the plan re-drawer and the step. Two methods change it:

- :meth:`TrainState.train_step`: one optimizer step (:func:`subnetdp.train.step.train_step`);
- :meth:`TrainState.replan`: a new plan, with the values of the pieces each rank then holds taken
  from a :class:`PieceSource`. Every mid-run plan change goes through it: re-drawing
  (:class:`PeerPieces`, the live owners), resuming on the same or a new plan
  (:class:`~subnetdp.train.checkpoints.source.CheckpointPieces`, a checkpoint directory), and any
  other source that can fill a rank's pieces (a set of files written by the surviving owners of a
  lost worker is one).

Whatever holds the model (checkpointer, meter, reporter, probes) reads it from the state when it
needs it, so nothing is patched after a re-plan. Lifecycle hooks receive the state as a
:class:`~subnetdp.core.contracts.TrainStateView`: properties only.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional, Protocol

import torch
from torch import nn

from subnetdp.core.contracts import ParamMap, Partition, RunContext, TrainStateView
from subnetdp.core.errors import SubnetdpError
from subnetdp.core.plan import MaskPlan
from subnetdp.parallel.apply import RankParallelism
from subnetdp.parallel.memory import training_state_tensors
from subnetdp.parallel.wrapper import SubnetworkParallel
from subnetdp.sdp.construct import build_local, drop_in_place, empty_local, poisoned
from subnetdp.sdp.keep_rates import describe, forward_keep_rates, rescale_branches, rising_rates
from subnetdp.sdp.pieces import LocalIndex
from subnetdp.sdp.resample import Resampler, receive_from_owners
from subnetdp.sdp.union import scalable_branches
from subnetdp.sdp.sync import GradSynchronizer, NonFiniteGuard, SyncSettings
from subnetdp.sdp.sync import make_synchronizer
from subnetdp.sdp.variants import regime_of
from subnetdp.train import faults
from subnetdp.train.faults import step_faults
from subnetdp.train.optim import build_optimizer, build_schedule
from subnetdp.train.stateful import ModelUnits, OptimizerUnits, Stateful
from subnetdp.train.step import StepContext, StepProgress, StepResult, train_step


class Holding(NamedTuple):
    """A rank's model under one plan: what a re-plan moves pieces out of."""

    model: nn.Module
    pmap: ParamMap
    plan: MaskPlan


class PieceSource(Protocol):
    """Where a re-plan takes the values of the pieces every rank holds under the new plan.

    ``trained_rates``: after :meth:`load`, block name -> the forward keep rate the loaded values were
    trained at (:func:`~subnetdp.sdp.keep_rates.forward_keep_rates`), or None when they are the
    state's own (the plan before the change tells).
    """

    trained_rates: Optional[dict[str, float]]

    def load(self, state: "TrainState", previous: Optional[Holding]) -> Optional[int]:
        """Fill ``state.model`` (every piece and buffer this rank holds under ``state.plan``) and what
        else the source holds: optimizer state, schedule, the synchroniser's own state, data position,
        RNG. Collective: every rank calls it, with the same kind of source.

        Args:
            state: the state, already rebuilt for the new plan when the plan changed.
            previous: the rank's model before the change, or None when the plan stayed the same (then
                the source loads into the model in place).

        Returns:
            The step the run continues after (a checkpoint's), or None when the step does not change.
        """


class PeerPieces:
    """The live owners, over the communicator: what a re-drawn plan is filled from.

    A piece a rank gains comes from its previous ``min(owners)``, broadcast piece by piece in global
    order (:func:`subnetdp.sdp.resample.receive_from_owners`). The optimizer state starts fresh on
    every rank and the schedule keeps its position (documented in :mod:`subnetdp.sdp.resample`).
    """

    trained_rates = None  # the live values were trained under the plan before the change

    def load(self, state: "TrainState", previous: Optional[Holding]) -> None:
        if previous is None:
            return None  # the same plan: every rank holds its pieces already
        comm = state.context.comm
        with comm.bytes.phase("redraw"):
            # collective: every rank joins the broadcast of each piece that changes hands.
            receive_from_owners(state.partition, LocalIndex(previous.model, previous.pmap), previous.plan,
                                LocalIndex(state.model, state.pmap), state.plan, comm)
        state.synchronizer.load_state_dict({"pieces": {}})  # its own state starts from the values received
        return None


class TrainState(TrainStateView):
    """One rank's training state; built by :meth:`build`, changed by :meth:`train_step` and :meth:`replan`.

    Args:
        ctx: the run context.
        partition, plan: the model's partition and the plan the rank starts with.
        model, pmap: the rank's model (holding its initial values) and its parameter map.
    """

    def __init__(self, ctx: RunContext, partition: Partition, plan: MaskPlan, model: nn.Module, pmap: ParamMap,
                 last_good: Callable[[], Any] = lambda: None) -> None:
        cfg = ctx.cfg
        self._ctx, self._partition, self._step = ctx, partition, 0
        self._last_good = last_good  # the run's last good checkpoint, named when a non-finite step stops it
        self._progress = StepProgress()
        self._settings = SyncSettings.from_config(cfg)
        self._parallel = RankParallelism(cfg, ctx.comm)
        self._guard = NonFiniteGuard(ctx.comm, cfg.train.on_nonfinite, self._last_good)
        # Block -> the highest training keep rate its values have run at (see _keep_rates_rise).
        self._rates_run = forward_keep_rates(cfg.masker, partition, plan)
        every = cfg.masker.resample_every
        self._resampler = Resampler(partition, plan, cfg.seed, every, cfg.masker.group_by) if every > 0 else None
        self._install(model, pmap, plan)

    @classmethod
    def build(cls, ctx: RunContext, partition: Partition, plan: MaskPlan, full: nn.Module,
              last_good: Callable[[], Any] = lambda: None) -> "TrainState":
        """The state of rank ``ctx.rank``: its units and the shared tensors materialised on its device,
        each initialised from the seed and its global name. Collective (see :meth:`_install`).
        ``last_good`` gives the run's last good checkpoint (the checkpointer's, which the state does not know)."""
        cfg = ctx.cfg
        model, pmap = build_local(ctx.adapter, full, plan.owned[ctx.rank], partition, cfg.masker, cfg.seed,
                                  ctx.comm.device)
        return cls(ctx, partition, plan, model, pmap, last_good)

    def _install(self, model: nn.Module, pmap: ParamMap, plan: MaskPlan, applied: bool = False) -> None:
        """Make ``model`` the trained one: parallelisms (unless ``applied``: a model that lost units in
        place keeps them), optimizer, schedule at the current step, synchroniser, refresher. Collective:
        FSDP's mesh (once) and the owner groups (the communicator keeps them, so a re-drawn plan of the
        family finds its groups made)."""
        ctx, cfg = self._ctx, self._ctx.cfg
        self._model, self._pmap = model, pmap
        self._units = tuple(plan.owned[ctx.rank])  # what the model holds (a re-formed world may keep it)
        faults.track_model(model)  # test-only
        if not applied:  # collective when sharded: activation checkpointing, compile and FSDP, from outside the model.
            self._parallel.apply(model, ctx.adapter)
        self._optimizer = build_optimizer(cfg.optim, model.parameters())
        self._scheduler = build_schedule(cfg.optim, self._optimizer, ctx.steps, start=self._step)
        self._synchronise(plan)

    def _synchronise(self, plan: MaskPlan) -> None:
        """The synchroniser (or the wrapper) and the refresher of the model under ``plan``. Collective:
        every rank creates every owner group, in the same order (the communicator keeps them)."""
        ctx, cfg, model, pmap = self._ctx, self._ctx.cfg, self._model, self._pmap
        self._plan = plan
        self._synced = (plan.digest(), ctx.comm.rank)  # what its buckets are laid out for (groups go by ranks)
        sharded = self._parallel.sharding()
        self._wrapper: SubnetworkParallel | None = None
        if sharded is None and self._settings.mode != "local_steps" and not regime_of(cfg.masker).refreshes:
            # Per-step owner-group averaging goes through the public wrapper, as in a user's loop: its
            # end-of-backward callback finishes the averaging (one owner-bucket path, two entrances).
            # collective: every rank creates every owner group, in the same order.
            self._wrapper = SubnetworkParallel.from_parts(model, pmap, plan, self._partition, ctx.comm, self._settings,
                                                          before_finish=self._sync_fault(ctx))
            self._sync = self._wrapper.averager
        else:
            # collective: every rank creates every owner group, in the same order.
            self._sync = make_synchronizer(self._settings, model, pmap, plan, self._partition, ctx.comm,
                                           sharded=sharded, last_good=self._last_good)
        self._refresher = None
        if regime_of(cfg.masker).refreshes:
            from subnetdp.sdp.backward import Refresher

            # With local steps owners disagree between synchronisations: refresh only right after one.
            self._refresher = Refresher(model, pmap, plan, self._partition, ctx.comm,
                                        cfg.masker.refresh_every * self._settings.cycle, self._settings.bucket_cap_mb)

    def _sync_fault(self, ctx: RunContext) -> Callable[[], None] | None:
        """Test-only: the wrapper's kill point inside the averaging (``SUBNETDP_TEST_KILL_IN_SYNC``), at the
        step in progress; None in every real run."""
        fault = step_faults(ctx.rank, ctx.run_dir)
        return None if fault is None else lambda: fault("sync", self._progress.step)

    def _detach(self) -> None:
        """Take the synchroniser's (and the wrapper's) hooks off the model: its gradients are nobody's business now."""
        if self._wrapper is not None:
            self._wrapper.remove_hooks()
        else:
            self._sync.remove_hooks()

    # ------------------------------------------------------------------ read-only view
    @property
    def context(self) -> RunContext:
        return self._ctx

    @property
    def step(self) -> int:
        return self._step

    @property
    def partition(self) -> Partition:
        return self._partition

    @property
    def plan(self) -> MaskPlan:
        return self._plan

    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def units(self) -> tuple[int, ...]:
        """The units this rank's model holds (a world after a join may hold what one before did)."""
        return self._units

    @property
    def wrapper(self) -> Optional[SubnetworkParallel]:
        """The public wrapper :attr:`model` trains through (per-step owner-group averaging, unsharded,
        forward masking), or None (local steps, FSDP shards and backward masking keep their own
        synchronisers). :attr:`model` is its ``module``: names, checkpoints and hooks see no prefix."""
        return self._wrapper

    @property
    def pmap(self) -> ParamMap:
        return self._pmap

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def scheduler(self) -> Any:
        return self._scheduler

    @property
    def synchronizer(self) -> GradSynchronizer:
        return self._sync

    @property
    def parallel(self) -> RankParallelism:
        return self._parallel

    @property
    def refresher(self) -> Any:
        return self._refresher

    @property
    def resampler(self) -> Optional[Resampler]:
        return self._resampler

    # ------------------------------------------------------------------ changing it
    def step_context(self) -> StepContext:
        """What :func:`~subnetdp.train.step.train_step` needs of this state (read at the call)."""
        cfg = self._ctx.cfg
        return StepContext(model=self._model, adapter=self._ctx.adapter, sync=self._sync, optimizer=self._optimizer,
                           guard=self._guard, scheduler=self._scheduler, refresher=self._refresher,
                           accum=cfg.train.grad_accum, clip=cfg.optim.clip_grad_norm,
                           autocast=self._parallel.autocast, device=self._ctx.comm.device,
                           last_step=self._ctx.steps, fault=step_faults(self._ctx.rank, self._ctx.run_dir),
                           averaged_in_backward=self._wrapper is not None)

    def train_step(self, batches: Iterator[Any], *, step: int, need_norm: bool = False,
                   probe: Callable[[list[Any]], None] | None = None,
                   pending_signal: Callable[[], int] | None = None) -> StepResult:
        """Optimizer step ``step`` (:func:`~subnetdp.train.step.train_step`); the state is then at ``step``.

        Collective: the synchroniser's owner groups, the guard and (when due) local steps'
        synchronisation and backward masking's refresh, in the step's fixed order.
        """
        out = train_step(self.step_context(), batches, step=step, need_norm=need_norm, probe=probe,
                         progress=self._progress, pending_signal=pending_signal)
        self._step = step
        return out

    @property
    def progress(self) -> StepProgress:
        """How far the step in progress got (read when a peer is lost in the middle of it)."""
        return self._progress

    def drawn_plan(self, step: int) -> Optional[MaskPlan]:
        """``masker.resample_every``: the family's plan for the steps after ``step`` when a re-draw is
        due there, else None. The same on every rank."""
        r = self._resampler
        return r.plan_at(step) if r is not None and r.due(step) else None

    def stateful(self) -> dict[str, Stateful]:
        """What a checkpoint holds of this state, one Stateful per component (:mod:`subnetdp.train.stateful`):
        the model (per piece), the optimizer (per parameter), the schedule and the synchroniser, as they
        are now (a re-plan rebuilds them, so the checkpointer asks at the time and keeps none)."""
        return {"model": ModelUnits(self._model, self._pmap, self._partition, self._plan, self._ctx.rank),
                "optimizer": OptimizerUnits(self._model, self._optimizer, self._parallel),
                "scheduler": self._scheduler, "sync": self._sync}

    def lasting_tensors(self) -> list[torch.Tensor]:
        """What lives across steps (parameters, buffers, gradients, optimizer and synchroniser state):
        the memory baseline of a measured step."""
        return training_state_tensors(self._model, self._optimizer, self._sync.state_tensors())

    def regroup(self, ctx: RunContext, before: MaskPlan, new_plan: MaskPlan, source: PieceSource) -> None:
        """Go on in the world re-formed without lost ranks (:mod:`subnetdp.train.continuation`). Collective
        among the survivors.

        ``ctx``: the run context in the survivors' numbering; ``before``: the plan as it stands,
        renumbered (``plan.without(members)``: this rank's model holds exactly its units); ``new_plan``:
        the plan to go on with. The synchroniser is rebuilt for the new world (its owner groups are new).
        A rank whose model already holds exactly its units under ``new_plan`` (a survivor that gains and
        loses none; a newcomer, built for its units at set-up) keeps its model, optimizer and schedule,
        and the source loads into them in place (a newcomer keeps its synchroniser too). A rank that only
        loses units (a member at a join, which drops the units it gained at W-1) drops them in place where the adapter can
        (``ModelAdapter.drop_units``), with a new optimizer and schedule over the tensors it keeps. Any
        other gets a new model, optimizer and schedule, as any re-plan does. ``source`` fills them (it
        fetched every piece before: nothing reads the model as it was). A tensor left unfilled is an error.
        """
        keep = tuple(new_plan.owned[ctx.rank]) == self._units
        # A newcomer's synchroniser, made at set-up for this plan and rank, stays: it reaches the owner
        # groups by their ranks, and they are made now.
        stays = keep and self._synced == (new_plan.digest(), ctx.comm.rank)
        self._ctx, self._plan = ctx, before
        self._replan(new_plan, source, rebuild=True, keep=keep, drop=not keep, stays=stays)
        faults.optimizer_storage(self._optimizer)  # test-only

    def replan(self, new_plan: MaskPlan, source: PieceSource) -> None:
        """Continue under ``new_plan``, with every piece's values from ``source``. Collective.

        The one path of every plan change. When the plan changes, the synchroniser leaves the old
        model, the new model is built on ``meta`` and given storage filled with a value no
        initialisation makes, the parallelisms, optimizer (fresh), schedule (at the current step),
        synchroniser and refresher are rebuilt on it, the source fills it, and a tensor left unfilled
        is an error. When the plan is the same (resuming on the config's plan), the source loads into
        the model in place. A residual branch that now runs in more of the training forwards than its
        values were trained at is scaled by the ratio of the rates (:meth:`_keep_rates_rise`).
        """
        self._replan(new_plan, source, rebuild=new_plan.digest() != self._plan.digest())

    def _replan(self, new_plan: MaskPlan, source: PieceSource, rebuild: bool, keep: bool = False,
                drop: bool = False, stays: bool = False) -> None:
        ctx, previous = self._ctx, None
        if rebuild:
            previous = Holding(self._model, self._pmap, self._plan)
            if stays:  # the units, plan and rank its synchroniser was made for (regroup: a newcomer)
                self._plan = new_plan
            else:
                self._detach()  # the old model's gradients are nobody's business from now on
                if keep:  # the same units in a new world: only the owner groups are new (regroup)
                    self._model.zero_grad(set_to_none=True)  # views into the old synchroniser's buckets
                    self._synchronise(new_plan)
                elif not (drop and self._drop_units(new_plan)):
                    model, pmap = empty_local(ctx.adapter, ctx.spec, new_plan.owned[ctx.rank], self._partition,
                                              ctx.cfg.masker, ctx.comm.device)
                    self._install(model, pmap, new_plan)
        step = source.load(self, previous)  # collective: every rank takes its pieces from the source
        if previous is not None:
            with self._parallel.gathered(self._model):  # collective when sharded
                unset = poisoned(self._model)
            if unset:
                raise SubnetdpError(f"re-planning after step {self._step} left {unset[:3]} of rank {ctx.rank}'s "
                                    "new model unset")
            self._model.train()
        if step is not None:
            self._step = step
        self._keep_rates_rise(self._rates_run if source.trained_rates is None else source.trained_rates)

    def _drop_units(self, plan: MaskPlan) -> bool:
        """Lose, in place, the units this rank's model holds beyond its units under ``plan``, and train on
        with the rest (their tensors, values and optimizer state as they are): True. False when ``plan``
        gives it a unit it does not hold, the adapter cannot drop units, its result fails the check (said
        in one line), or the parallelisms applied would differ on a new build: the caller builds anew."""
        ctx = self._ctx
        units = tuple(plan.owned[ctx.rank])
        if not set(units) < set(self._units):
            return False
        pmap = drop_in_place(ctx.adapter, self._model, self._pmap, units, self._partition)
        if isinstance(pmap, str):
            print(f"subnetdp: rank {ctx.rank}: the model adapter's drop_units left the model wrong ({pmap}); "
                  "building the smaller subnetwork anew", flush=True)
            return False
        if pmap is None or not self._parallel.applied_after_drop(self._model, ctx.adapter):
            return False
        self._model.zero_grad(set_to_none=True)  # views into the old synchroniser's buckets
        self._install(self._model, pmap, plan, applied=True)
        return True

    def _keep_rates_rise(self, trained: dict[str, float]) -> None:
        """Block-level forward masking: scale each residual branch whose keep rate the new plan raises
        above ``trained`` (the highest rate its values have run at) by old / new rate, as the rescaled
        union evaluation does (:mod:`subnetdp.sdp.keep_rates`), and say so in one line (rank 0).
        ``eval.block_union=x1`` leaves them (and says that). A rate that falls changes nothing, and a
        branch that returns to a rate it ran at before is not scaled again: re-drawn plans whose owner
        counts differ move rates up and down, and scaling at every rise would shrink the branch at
        every re-draw (docs/checkpoints.md, "Resuming on another world size, coverage or masker")."""
        ctx = self._ctx
        now = forward_keep_rates(ctx.cfg.masker, self._partition, self._plan)
        rising = rising_rates(trained, now)
        self._rates_run = {name: max(rate, trained.get(name, rate)) for name, rate in now.items()}
        if not rising:
            return
        what = (f"the new plan runs {len(rising)} residual branch(es) in more of the training forwards than "
                f"they were trained at: {describe(rising)}")
        if ctx.cfg.eval.block_union == "x1":
            line = f"{what}; not rescaled (eval.block_union=x1)"
        else:
            # Asked of the full model: this rank's subnetwork holds only the blocks it owns.
            scales, blind = scalable_branches(ctx.adapter, ctx.spec,
                                              {name: old / new for name, (old, new) in rising.items()})
            # Elementwise: a rank's shards (fsdp.shard_size > 1) and their optimizer state scale as they are.
            outer = self._sync.state_dict().get("pieces") or {}  # the live tensors: scaled in place
            rescale_branches(self._model, ctx.adapter.branch_output_layers(self._model), scales, self._optimizer,
                             [(prefix, name, t) for prefix, ts in outer.items() for name, t in ts.items()])
            line = what + ("; each scaled by old/new rate in its output layer, with its optimizer state, as "
                           "the rescaled union is evaluated (eval.block_union=rescaled)" if scales else "")
            if blind:  # the adapter's branch_output_layers names no layer for them: they stay at x1
                line += (f"; not rescaled (the model adapter names no output layer for them): "
                         f"{', '.join(blind[:8])}" + (f" and {len(blind) - 8} more" if len(blind) > 8 else ""))
        if ctx.rank == 0:
            print(f"subnetdp: {line}", flush=True)
