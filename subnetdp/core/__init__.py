"""The contract layer a plugin author reads: hook specifications, plugin manager, contracts, plan, config, errors.

Nothing in here imports ``torch.distributed``, ``mpi4py``, ``subnetdp.plugins`` or any floor above it
(``sdp``, ``parallel``, ``train``, the command wings: ``tests/unit/test_layering.py``); every backend
and model reaches the core through the contracts in :mod:`subnetdp.core.contracts`.
"""
