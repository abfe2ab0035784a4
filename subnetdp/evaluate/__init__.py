"""The union model from a checkpoint's files: ``subnetdp eval`` and ``subnetdp export``.

- :mod:`~subnetdp.evaluate.export`: load, evaluate and export the union model (plain reference
  ``state_dict``), and rebuild an export (:func:`~subnetdp.evaluate.export.load_reference`).
- :mod:`~subnetdp.evaluate.hf`: ``export --format hf``, a Hugging Face model directory.

A command wing: it stands on ``train`` and the floors below, and no other wing imports it.
"""
