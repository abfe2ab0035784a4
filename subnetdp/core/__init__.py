"""The framework's core: hook specifications, contracts, plan, synchroniser, config and loop.

Nothing in here imports ``torch.distributed``, ``mpi4py`` or ``subnetdp.plugins``; every backend
and model reaches the core through the contracts in :mod:`subnetdp.core.contracts`.
"""
