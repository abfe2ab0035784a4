"""Hook specifications of subnetdp (pluggy project ``subnetdp``).

Where each hook fires in the training loop (``subnetdp.train.loop.train``)::

    pm = plugin manager, loading every ``subnetdp`` entry point (built-ins included)
    subnetdp_register_maskers(registry)          # each plugin adds named classes
    subnetdp_register_communicators(registry)
    subnetdp_register_models(registry)
    subnetdp_register_datasets(registry)
    cfg = compose(defaults, recipe, overrides)    # schemas of the selected plugins mounted
    plan = masker.plan(partition, world_size)     # validated before any process group exists
    comm.init(); owner groups created once
    resume from a checkpoint if cfg.resume says so   # every rank restores its own files
    subnetdp_on_run_start(run)
    for step in steps:
        forward/backward on own micro-batches -> owner-group gradient averaging -> optimizer step
        every eval.every steps (and after the last): union model streamed from the owners, evaluated on every rank
            subnetdp_on_eval_end(run, step, metrics)
        subnetdp_on_step_end(run, step, metrics)
        every checkpoint.every steps and at the end: checkpoint saved (manifest last)
    subnetdp_on_run_end(run)

Hooks are called with keyword arguments only. Registration hooks run on every rank, in every
process that builds a plugin manager (the CLI included). Lifecycle hooks run on every rank;
``run.rank`` tells an implementation where it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from subnetdp.core.contracts import Run
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
def subnetdp_on_run_start(run: "Run") -> None:
    """A run is set up: process groups exist, the subnetwork is materialised on its device.

    :param run: the :class:`~subnetdp.train.loop.Run` (config, plan, model, rank, run directory).

    Called on every rank, before the first step. The result is ignored.
    """


@hookspec
def subnetdp_on_step_end(run: "Run", step: int, metrics: dict[str, Any]) -> None:
    """An optimizer step finished.

    :param run: the running :class:`~subnetdp.train.loop.Run`.
    :param step: the number of steps done so far (1 after the first step).
    :param metrics: this rank's values for the step (``loss``, ``lr``, ``step_time`` ...).

    Called on every rank after every step. Must not issue collectives unless every rank does.
    The result is ignored.
    """


@hookspec
def subnetdp_on_eval_end(run: "Run", step: int, metrics: dict[str, Any]) -> None:
    """The union model was evaluated.

    :param run: the running :class:`~subnetdp.train.loop.Run`.
    :param step: the step after which the evaluation ran.
    :param metrics: the adapter's eval metrics (``accuracy``, ``loss`` ...), the same on every rank
        (every rank evaluates the same batches; lm-eval task scores, ``eval.tasks``, on rank 0 only).

    Called on every rank after each evaluation. The result is ignored.
    """


@hookspec
def subnetdp_on_run_end(run: "Run") -> None:
    """The run finished its last step and wrote ``summary.json``.

    :param run: the finished :class:`~subnetdp.train.loop.Run`; ``run.summary`` holds the summary.

    Called on every rank. The result is ignored.
    """


REGISTRATION_HOOKS = {
    "masker": "subnetdp_register_maskers",
    "comm": "subnetdp_register_communicators",
    "model": "subnetdp_register_models",
    "data": "subnetdp_register_datasets",
}
