"""The top floor: one training step, the meter, the loop, checkpoints and the plan's dry runs.

- :mod:`~subnetdp.train.step`: the training step, used by the loop and by both dry runs.
- :mod:`~subnetdp.train.meter`: bytes by owner group and phase, memory, time; the run's outputs.
- :mod:`~subnetdp.train.loop`: set-up (the composition root: launcher env, plugins, parallelize) and
  the loop, top to bottom.
- :mod:`~subnetdp.train.checkpoints`: files, save/restore and resume.
- :mod:`~subnetdp.plan.dryrun`, :mod:`~subnetdp.plan.dryrun_fsdp`, :mod:`~subnetdp.plan.report`:
  ``subnetdp plan``'s estimates, the same step under FakeTensorMode.
"""
