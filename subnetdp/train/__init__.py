"""The run: its context and state, one training step, the loop, reporting, checkpoints and what guards a run's start.

- :mod:`~subnetdp.train.setup`: the composition root (launcher env, plugins, the checks, the process
  group): builds the frozen :class:`~subnetdp.core.contracts.RunContext` and the training state.
- :mod:`~subnetdp.train.state`: :class:`~subnetdp.train.state.TrainState` (model, optimizer, schedule,
  synchroniser, plan, step) and its one ``replan``: re-drawing, resuming, re-planning.
- :mod:`~subnetdp.train.step`: the training step, used by the state and by the plan's dry runs.
- :mod:`~subnetdp.train.loop`: the loop, top to bottom, and nothing else.
- :mod:`~subnetdp.train.evaluation`: the union model, own subnetworks, lm-eval tasks, the alignment probe.
- :mod:`~subnetdp.train.report`: progress, log lines, TensorBoard, the summary: a built-in lifecycle plugin.
- :mod:`~subnetdp.train.meter`: bytes by owner group and phase, memory, time.
- :mod:`~subnetdp.train.checkpoints`: files, save/restore, a checkpoint as a re-plan's source, resume.
- :mod:`~subnetdp.train.runlock`: one job per run directory; :mod:`~subnetdp.train.upfront`: checks
  made before any worker or process group exists.
- :mod:`~subnetdp.train.downstream`, :mod:`~subnetdp.train.lm_eval_model`: lm-evaluation-harness on
  the union model (``eval.tasks`` in the loop; ``subnetdp eval --tasks`` reuses them).

The commands stand on this floor in wings of their own: :mod:`subnetdp.plan`, :mod:`subnetdp.evaluate`.
"""
