"""The run: one training step, the meter, the loop, checkpoints and what guards a run's start.

- :mod:`~subnetdp.train.step`: the training step, used by the loop and by the plan's dry runs.
- :mod:`~subnetdp.train.meter`: bytes by owner group and phase, memory, time; the run's outputs.
- :mod:`~subnetdp.train.loop`: set-up (the composition root: launcher env, plugins, parallelize) and
  the loop, top to bottom.
- :mod:`~subnetdp.train.checkpoints`: files, save/restore and resume.
- :mod:`~subnetdp.train.runlock`: one job per run directory; :mod:`~subnetdp.train.upfront`: checks
  made before any worker or process group exists.
- :mod:`~subnetdp.train.downstream`, :mod:`~subnetdp.train.lm_eval_model`: lm-evaluation-harness on
  the union model (``eval.tasks`` in the loop; ``subnetdp eval --tasks`` reuses them).

The commands stand on this floor in wings of their own: :mod:`subnetdp.plan`, :mod:`subnetdp.evaluate`.
"""
