"""Parallelism applied to a rank's materialised subnetwork from outside the model.

As in torchtitan, the model code holds no distributed code; these small verb-named functions wrap
an adapter's blocks after :meth:`~subnetdp.core.contracts.ModelAdapter.materialize`:

- :func:`~subnetdp.parallel.checkpointing.apply_ac`: activation checkpointing of every k-th block
  (``train.activation_checkpointing``), with ``torch.utils.checkpoint`` (non-reentrant).
- :func:`~subnetdp.parallel.compile.apply_compile`: ``torch.compile`` of each block
  (``train.compile``).
- :func:`~subnetdp.parallel.fsdp.apply_fsdp`: FSDP2 ``fully_shard`` of each block and of the
  shared parts over the shard group (``fsdp.shard_size``), and
  :class:`~subnetdp.parallel.fsdp.ShardedOwnerAverager`, the owner-group averaging of the sharded
  gradients across replicas.

Order, as torchtitan applies them: checkpointing, then compile, then FSDP.
"""
