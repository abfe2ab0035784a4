"""Checkpoints: the on-disk format (:mod:`.files`) and saving/resuming a running job (:mod:`.resume`)."""
