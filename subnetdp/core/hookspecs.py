"""Hook specifications of subnetdp (pluggy project ``subnetdp``).

Where each hook fires (``subnetdp.train.setup.setup`` and ``subnetdp.train.loop.train_loop``)::

    pm = plugin manager, loading every ``subnetdp`` entry point (built-ins included)
    subnetdp_register_maskers(registry)          # each plugin adds named classes
    subnetdp_register_communicators(registry)
    subnetdp_register_models(registry)
    subnetdp_register_datasets(registry)
    cfg = compose(defaults, recipe, overrides)    # schemas of the selected plugins mounted
    plan = masker.plan(partition, world_size, seed)  # validated before any process group exists
    comm.init(); context = RunContext(...)        # frozen from here
    state = TrainState(...)                       # model, optimizer, synchroniser; owner groups created once
    resume from a checkpoint if cfg.resume says so   # state.replan: every rank loads its own pieces
    subnetdp_on_run_start(context, state)
    for step in steps:
        forward/backward on own micro-batches -> owner-group gradient averaging -> optimizer step
        every masker.resample_every steps: state.replan(next plan of the family)
        every eval.every steps (and after the last): union model streamed from the owners, evaluated on every rank
            subnetdp_on_eval_end(context, state, step, metrics, union, tasks)
        subnetdp_on_step_end(context, state, step, metrics)
        every checkpoint.every steps and at the end: checkpoint saved (manifest last)
    result = RunResult(summary, ...)              # every rank's figures gathered
    subnetdp_on_run_end(context, state, result)

Hooks are called with keyword arguments only; an implementation takes the ones it needs (pluggy
passes a subset by name). Registration hooks run on every rank, in every process that builds a
plugin manager (the CLI included). Lifecycle hooks run on every rank; ``context.rank`` tells an
implementation where it is. What they receive is read-only: the context is frozen and the state a
view (``subnetdp.TrainStateView``). A lifecycle hook may issue a collective only if every rank issues
the same one at the same hook (reporting's log line does: the world's mean loss on log steps).

Reporting is itself a plugin of these hooks (``subnetdp.train.report.Reporter``), registered for
the run's duration: its ``subnetdp_on_run_end`` writes ``summary.json`` before any other runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from subnetdp.core.contracts import RunContext, RunResult, TrainStateView
    from subnetdp.core.plugins import Registry

PROJECT = "subnetdp"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def subnetdp_register_maskers(registry: "Registry") -> None:
    """Add masker classes (subclasses of :class:`~subnetdp.core.contracts.Masker`).

    :param registry: call ``registry.add(name, cls)`` for each masker; ``name`` is what
        ``masker.name`` selects. A name another plugin already added is an error naming both.

    Called on every rank when the plugin manager is built. The result is ignored.
    """


@hookspec
def subnetdp_register_communicators(registry: "Registry") -> None:
    """Add communicator classes (subclasses of :class:`~subnetdp.core.contracts.Communicator`).

    :param registry: call ``registry.add(name, cls)``; ``comm.name`` selects by that name.

    Called on every rank when the plugin manager is built. The result is ignored.
    """


@hookspec
def subnetdp_register_models(registry: "Registry") -> None:
    """Add model adapter classes (subclasses of :class:`~subnetdp.core.contracts.ModelAdapter`).

    :param registry: call ``registry.add(name, cls)``; ``model.name`` selects by that name.

    Called on every rank when the plugin manager is built. The result is ignored.
    """


@hookspec
def subnetdp_register_datasets(registry: "Registry") -> None:
    """Add data module classes (subclasses of :class:`~subnetdp.core.contracts.DataModule`).

    :param registry: call ``registry.add(name, cls)``; ``data.name`` selects by that name.

    Called on every rank when the plugin manager is built. The result is ignored.
    """


@hookspec
def subnetdp_on_run_start(context: "RunContext", state: "TrainStateView") -> None:
    """A run is set up: process groups exist, the subnetwork is materialised on its device, and a
    resume (``resume``) has loaded its checkpoint.

    :param context: the frozen :class:`~subnetdp.core.contracts.RunContext` (config, communicator,
        run directory, ``context.rank``).
    :param state: the :class:`~subnetdp.core.contracts.TrainStateView` (plan, model, optimizer,
        ``state.step``: the step the run continues after, 0 for a fresh run).

    Called on every rank, before the first step. The result is ignored.
    """


@hookspec
def subnetdp_on_step_end(context: "RunContext", state: "TrainStateView", step: int, metrics: dict[str, Any]) -> None:
    """An optimizer step finished (after its evaluation, if one was due, and before its checkpoint).

    :param context: the frozen :class:`~subnetdp.core.contracts.RunContext`.
    :param state: the :class:`~subnetdp.core.contracts.TrainStateView` after the step (a re-drawn
        plan, ``masker.resample_every``, is in place).
    :param step: the number of steps done so far (1 after the first step).
    :param metrics: this rank's values for the step: ``loss``, ``lr``, ``step_time``, ``grad_norm``
        (None unless clipping or a log step needed it) and, on probed steps
        (``train.grad_alignment_every``), the gradient-alignment figures ``probe/grad_*``.

    Called on every rank after every step, on the same steps. A collective is allowed only if every
    rank's implementation issues the same one (the built-in reporter adds up the world's loss on log
    steps). The result is ignored.
    """


@hookspec
def subnetdp_on_eval_end(context: "RunContext", state: "TrainStateView", step: int, metrics: dict[str, Any],
                         union: dict[str, Any], tasks: dict[str, float]) -> None:
    """The union model was evaluated.

    :param context: the frozen :class:`~subnetdp.core.contracts.RunContext`.
    :param state: the :class:`~subnetdp.core.contracts.TrainStateView` that was evaluated.
    :param step: the step after which the evaluation ran.
    :param metrics: the adapter's eval metrics (``accuracy``, ``loss`` ...), the same on every rank
        (every rank evaluates the same batches), and lm-eval task scores (``eval.tasks``) on rank 0 only.
    :param union: how the union model was evaluated (``summary.json``'s ``eval_union``: ``block_union``,
        ``rescaled``, ``branch_keep_rates``, ``not_rescaled`` (blocks the adapter names no output layer for:
        evaluated at x1); with ``eval.breakdown`` at the last step also the union at
        x1 and rescaled and every rank's own subnetwork).
    :param tasks: the lm-eval scores among ``metrics`` (``<task>/<metric>``; empty without ``eval.tasks``
        and on ranks other than 0).

    Called on every rank after each evaluation, before that step's ``subnetdp_on_step_end``. A
    collective is allowed only if every rank's implementation issues the same one. The result is ignored.
    """


@hookspec
def subnetdp_on_run_end(context: "RunContext", state: "TrainStateView", result: "RunResult") -> None:
    """The run finished its last step; the built-in reporter has written ``summary.json``.

    :param context: the frozen :class:`~subnetdp.core.contracts.RunContext`.
    :param state: the final :class:`~subnetdp.core.contracts.TrainStateView`.
    :param result: the :class:`~subnetdp.core.contracts.RunResult`: ``result.summary`` is the summary
        (every rank's figures, the same on every rank), with the last evaluation and the final step.

    Called on every rank. A collective is allowed only if every rank's implementation issues the same
    one. The result is ignored.
    """


REGISTRATION_HOOKS = {
    "masker": "subnetdp_register_maskers",
    "comm": "subnetdp_register_communicators",
    "model": "subnetdp_register_models",
    "data": "subnetdp_register_datasets",
}
