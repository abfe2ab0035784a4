"""The training loop: train a rank's subnetwork, evaluate the union model, return what the run produced.

Set-up (:mod:`subnetdp.train.setup`) builds the frozen run context and the training state; the loop
below drives the state step by step and tells the lifecycle hooks what happens, where the built-in
reporter (:mod:`subnetdp.train.report`) and any third-party plugin listen. Every point where all
ranks must meet is marked ``# collective``.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from omegaconf import DictConfig

from subnetdp.core.contracts import LaunchEnv, RunContext, RunResult
from subnetdp.core.errors import PeerLost
from subnetdp.core.plugins import PluginManager
from subnetdp.train.checkpoints.files import step_dir
from subnetdp.train.checkpoints.checkpointer import Checkpointer
from subnetdp.train.checkpoints.source import reseed, seed_host_rngs
from subnetdp.train.continuation import WentOn, go_on, position_in
from subnetdp.train.failures import FailureLog, say_going_on
from subnetdp.train.evaluation import AlignmentProbe, Evaluation, evaluate_run
from subnetdp.train.meter import Meter
from subnetdp.train.owner_check import OwnerCheck
from subnetdp.train.rejoin import grown, join, join_due
from subnetdp.train.report import Counted, reporting, summarise
from subnetdp.train.setup import freeze_lasting, frozen_while_training, set_threads, setup
from subnetdp.train.state import PeerPieces, TrainState
from subnetdp.train.stopping import (REQUEUE_SIGNAL, Interrupted, StopRequest, continue_command, hold_for_test, requeue_job,
                                     stop_message)


class TrainedRun(NamedTuple):
    """What :func:`train` returns: the run's context, its final training state and its result."""

    context: RunContext
    state: TrainState
    result: RunResult


def train(cfg: DictConfig, env: LaunchEnv | None = None, pm: PluginManager | None = None,
          failures: FailureLog | None = None) -> TrainedRun:
    """Run one training job on this rank (the worker's entry point).

    ``failures``: where an error that ends the run is logged once the run directory is this job's
    (:mod:`subnetdp.train.failures`); the error itself is raised unchanged.
    """
    from subnetdp.launchers import detect

    env = env or detect()
    pm = pm or PluginManager()
    failures = failures if failures is not None else FailureLog()
    set_threads(cfg, env)
    # SIGINT/SIGTERM: stop at a step boundary, with a checkpoint; an error: its log in the run directory.
    with StopRequest(env.rank) as stopper, failures:
        ctx, state = setup(cfg, env, pm, on_context=failures.claim)
        failures.follow(state)
        try:
            result = train_loop(ctx, state, stopper)
        finally:
            ctx.comm.shutdown()
            if ctx.lock is not None:
                ctx.lock.release()
    return TrainedRun(ctx, state, result)


def train_loop(ctx: RunContext, state: TrainState, stopper: StopRequest | None = None) -> RunResult:
    """Train ``state`` (built by :func:`~subnetdp.train.setup.setup`) to ``train.steps``.

    Under subnetdp's supervisor (``launch.on_failure=continue``) the survivors of a dead peer go on
    in-process (:mod:`subnetdp.train.continuation`): the loop starts again after the step they all
    finished, in the re-formed world."""
    with frozen_while_training():
        joined = join(ctx, state)  # collective for a replacement: the members heal it before its first step
        went_on = WentOn(joined, joined.run, Counted(), state.plan) if joined is not None else None
        while True:
            try:
                return _train(ctx, state, stopper, went_on)
            except WentOn as w:
                ctx, went_on = w.continued.context, w.without_frames()


def _train(ctx: RunContext, state: TrainState, stopper: StopRequest | None, went_on: WentOn | None) -> RunResult:
    """The loop, top to bottom, from set-up, a resume or an in-process continuation (``went_on``)."""
    cfg, comm, hook, steps = ctx.cfg, ctx.comm, ctx.plugins.hook, ctx.steps
    loader = ctx.data.train_loader(ctx.rank, comm.world_size, cfg.train.batch_size)
    ckpt = Checkpointer(ctx, state, loader)
    if went_on is None:
        # After set-up, whose lazy imports may draw from them (rich, via scikit-learn, does); a resume restores them.
        seed_host_rngs(cfg.seed)
        first = ckpt.start() + 1  # collective: resumes (a re-plan from the checkpoint) when cfg.resume asks for one
        say_going_on(ctx, first - 1)  # after a restart: every node's console says the job goes on
    else:  # the rules of a resume from the survivors' files on exactly the survivors (continuation.py)
        ckpt.adopt(went_on.ckpt)  # a replacement's: the run id and lineage the members sent
        loader.load_state_dict(position_in(went_on.continued, loader, cfg.train.batch_size))
        reseed(cfg.seed + went_on.continued.step)
        first = went_on.continued.step + 1
    if first > 1:
        ckpt.mark_finished(first - 1)
    full = went_on.full if went_on is not None else state.plan  # the W-rank plan a join returns to
    batches = (_to_device(b, comm.device) for b in loader)
    meter = Meter(comm, state.parallel, first, steps, cfg.train.memory_step, (state.plan.digest(), state.units),
                  went_on.counted.peaks if went_on is not None else None, continued=went_on is not None)
    probe = AlignmentProbe(ctx, state, meter)  # train.grad_alignment_every
    owners = OwnerCheck(ctx, state)  # recovery.verify_every
    evaluation: Evaluation | None = None
    every_step_stop = cfg.sync.stop_every_step
    with reporting(ctx, meter) as reporter:  # the built-in reporter: progress, log lines, TensorBoard, summary.json
        try:
            hook.subnetdp_on_run_start(context=ctx, state=state)
            reporter.carry_over(ctx, state, ckpt)  # the counts a resume goes on from; a step nobody logged
            if went_on is not None:  # collective on a log step: the world before's losses, counts and bytes go on
                reporter.take_over(ctx, state, went_on.counted, ckpt, went_on.continued.said)
            if stopper is not None:
                stopper.armed = True  # from here a signal stops the run at the next step boundary
            state.model.train()
            freeze_lasting()
            for step in range(first, steps + 1):
                log_step = step % cfg.train.log_every == 0 or step == steps
                state.synchronizer.prepare()  # drops the last step's gradients: before the memory baseline is taken
                with meter.step(step, state.lasting_tensors):
                    # collective: owner groups average the gradients, the guard, and (when due) local steps'
                    # synchronisation and backward masking's refresh, in the step's fixed order.
                    # Every rank's pending signal rides in the step's world reduction (out.stops).
                    out = state.train_step(batches, step=step, need_norm=log_step, probe=probe.at(step),
                                           pending_signal=stopper.pending if stopper is not None else None)
                    redrawn = state.drawn_plan(step)  # masker.resample_every
                    if redrawn is not None and step < steps:
                        # collective: every rank re-draws the same plan and receives the pieces it gains.
                        state.replan(redrawn, PeerPieces())
                # collective when due: the owners of every unit compare digests (before any checkpoint of this step).
                owners.after_step(step, stopping=bool(out.stops))
                loss = float(out.loss)
                ckpt.mark_finished(step, loss)  # what a survivor's files need (outside the measured step)
                metrics = {"loss": loss, "lr": state.optimizer.param_groups[0]["lr"],
                           "step_time": meter.last_step_time, "grad_norm": out.grad_norm, **probe.figures(step)}
                if step == steps or (cfg.eval.every and step % cfg.eval.every == 0):
                    evaluation = evaluate_run(ctx, state, step)  # collective: the union model streams through every rank
                    hook.subnetdp_on_eval_end(context=ctx, state=state, step=step, metrics=evaluation.metrics,
                                              union=evaluation.union, tasks=evaluation.tasks)
                # collective on log steps: every rank's reporter adds up the world's losses.
                hook.subnetdp_on_step_end(context=ctx, state=state, step=step, metrics=metrics)
                if log_step:
                    ckpt.mark_logged(step)  # the row holds this rank's losses: a survivor need not keep them
                ckpt.after_step(step)  # collective on save steps: checkpoint.every and the last step
                if stopper is not None and step < steps:
                    # The step agreed on the signals in its world reduction (or local steps' synchronisation);
                    # one that issued none (local steps between synchronisations, the same on every rank)
                    # agrees here with sync.stop_every_step, else the next synchronisation does.
                    who = out.stops
                    if who is None and every_step_stop:
                        who = stopper.agreed(comm)  # collective: every rank, after this step
                    if who:
                        _stop(ctx, ckpt, step, who)
                if (joining := join_due(ctx, state, step, full)) is not None:  # one store check a step; collective when due
                    raise grown(ctx, state, ckpt, joining, full, reporter)  # collective: the newcomer's heal
            if first > steps:  # resumed from the final checkpoint (a crash after it): evaluate what it holds
                evaluation = evaluate_run(ctx, state, steps)  # collective
                hook.subnetdp_on_eval_end(context=ctx, state=state, step=steps, metrics=evaluation.metrics,
                                          union=evaluation.union, tasks=evaluation.tasks)
            # collective: every rank's figures are gathered into the summary.
            summary = summarise(ctx, state, meter, max(1, steps - first + 1), evaluation, probe.records)
            result = RunResult(summary=summary, eval_metrics=evaluation.metrics if evaluation else {},
                               eval_union=evaluation.union if evaluation else {}, alignment=list(probe.records),
                               step=state.step)
            hook.subnetdp_on_run_end(context=ctx, state=state, result=result)  # the reporter writes summary.json first
        except PeerLost as lost:
            # collective among the survivors: under the supervisor they re-form the world and go on (again
            # without a second dead, when one dies amid the re-formation); else the error to leave with.
            outcome = go_on(ctx, state, ckpt, lost, getattr(lost, "plan", None))  # a failed join's: in the grown numbering
            if not isinstance(outcome, PeerLost):
                raise WentOn(outcome, ckpt, reporter.counted(ctx, outcome.step), full) from None
            if stopper is not None:
                stopper.leaving()  # the agent's SIGTERM that follows a death asks for nothing more
            # A peer died or stopped answering: keep this rank's units as of its last finished step
            # (no collective), so a restart resumes there rather than at the newest checkpoint.
            raise ckpt.survive(outcome) from lost
    return result


def _to_device(batch: Any, device: Any) -> Any:
    return tuple(t.to(device, non_blocking=True) for t in batch) if device.type != "cpu" else batch


def _stop(ctx: RunContext, ckpt: Checkpointer, step: int, who: dict[int, int]) -> None:
    """Every rank: checkpoint this step (unless it was just saved), then raise :class:`Interrupted`."""
    path = ckpt.last_saved if ckpt.last_saved == step_dir(ctx.run_dir, step) else None
    hold_for_test()
    if path is None and ctx.cfg.checkpoint.enabled:
        path = ckpt.save(step)  # collective: every rank agreed to stop after this step
    signum = who.get(ctx.rank) or who[min(who)]
    hint = continue_command(sys.argv, ctx.cfg.run.dir, ctx.run_name)
    message = stop_message(who, step, path, hint) if ctx.rank == 0 else ""
    if ctx.rank == 0 and REQUEUE_SIGNAL in who.values():
        # SLURM's notice: every rank has written its part of the checkpoint (the save is collective).
        message += "; " + requeue_job()
    raise Interrupted(message, 128 + signum)
