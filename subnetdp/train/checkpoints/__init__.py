"""Checkpoints: the on-disk format (:mod:`.files`) and saving/resuming a running job (:mod:`.checkpointer`).

What a checkpoint holds besides the model's pieces is a mapping of Stateful components
(:mod:`subnetdp.train.stateful`)."""
