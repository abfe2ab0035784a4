"""The union model from a checkpoint's files: ``subnetdp eval`` and ``subnetdp export``.

- :mod:`~subnetdp.evaluate.export`: load, evaluate and export the union model (plain reference
  ``state_dict``), and rebuild an export (:func:`~subnetdp.evaluate.export.load_reference`).
- :mod:`~subnetdp.evaluate.hf`: ``export --format hf``, a Hugging Face model directory.
- :mod:`~subnetdp.evaluate.tasks`: ``eval --tasks``, lm-evaluation-harness on the union model (the
  harness glue itself, :mod:`subnetdp.train.downstream`, is shared with the loop's ``eval.tasks``).

A command wing: it stands on ``train`` and the floors below, and no other wing imports it.
"""
