"""Checkpoints: the on-disk format (:mod:`.files`) and saving/resuming a running job (:mod:`.checkpointer`), each component a Stateful (:mod:`subnetdp.train.stateful`)."""
