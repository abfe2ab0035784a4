"""The method on top of the contracts: it uses a Communicator, never ``torch.distributed``.

- :mod:`~subnetdp.sdp.sync`: owner-group buckets, averaging, the clipping norm, the inf/NaN guard.
- :mod:`~subnetdp.sdp.backward`: backward masking and the refresh of owners' values.
- :mod:`~subnetdp.sdp.pieces`: global pieces <-> local tensors.
- :mod:`~subnetdp.sdp.union`: union evaluation and assembly.
- :mod:`~subnetdp.sdp.resample`: re-drawn plans.
- :mod:`~subnetdp.sdp.variants`: what a rank holds (materialised subnetwork or masked full model).
- :mod:`~subnetdp.sdp.branches`: stochastic depth and hidden dropout, attached from outside the model
  after the adapter builds it, and the branch scaling of a rescaled block-level union.
"""
