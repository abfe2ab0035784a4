"""``subnetdp plan``: the mask plan without training, and what each rank would hold and send.

- :mod:`~subnetdp.plan.report`: the plan report (ranks x units, owner counts, spectral gap, per-rank
  parameters, estimated peak memory and bytes per step).
- :mod:`~subnetdp.plan.budget`: the largest configuration that fits a memory budget (``--memory``).
- :mod:`~subnetdp.plan.dryrun`, :mod:`~subnetdp.plan.dryrun_fsdp`: one training step under
  FakeTensorMode, with communicators that count bytes and move none.

A command wing: it stands on ``train`` and the floors below, and no other wing imports it.
"""
