"""subnetdp: Subnetwork Data Parallelism for PyTorch.

The public API: everything a plugin author imports (``examples/plugin-template`` uses only this).
It is the contract layer (:mod:`subnetdp.core`) and nothing above it; ``tests/unit/test_public_api.py``
freezes it, so a change here is deliberate.
"""

from subnetdp.core.contracts import (CommConfig, Communicator, DataConfig, DataModule, DataSpec, DoneHandle,
                                     Handle, HiddenSite, LaunchEnv, Masker, MaskerConfig, ModelAdapter,
                                     ModelConfig, NullCommunicator, ParamMap, Partition, Piece, ResumableLoader,
                                     RunContext, RunResult, TensorSlice, TrainStateView, Unit)
from subnetdp.core.errors import (CheckpointError, ConfigError, NonFiniteError, PeerLost, PlanError,
                                  RankMismatchError, SubnetdpError, suggest)
from subnetdp.core import moved as _moved
from subnetdp.core.fields import doc
from subnetdp.core.hookspecs import hookimpl
from subnetdp.core.plan import GROUP_BY, MaskPlan, group_units, rank_coverages, units_kept
from subnetdp.core.plugins import Registry
from subnetdp.core.records import plain_name_problem

__version__ = "0.2.0"

# Import paths that moved since 0.1.0 still work for one release, with a DeprecationWarning.
_moved.install()

__all__ = [
    "CheckpointError", "CommConfig", "Communicator", "ConfigError", "DataConfig", "DataModule", "DataSpec",
    "DoneHandle", "GROUP_BY", "Handle", "HiddenSite", "LaunchEnv", "MaskPlan", "Masker", "MaskerConfig",
    "ModelAdapter", "ModelConfig", "NonFiniteError", "NullCommunicator", "ParamMap", "Partition", "PeerLost",
    "Piece", "PlanError", "RankMismatchError", "Registry", "ResumableLoader", "RunContext", "RunResult",
    "SubnetdpError", "TensorSlice", "TrainStateView", "Unit",
    "doc", "group_units", "hookimpl", "plain_name_problem", "rank_coverages", "suggest", "units_kept",
]


def __getattr__(name: str):
    """``subnetdp.parallelize``, loaded on first use: it stands on ``torch.distributed`` (``parallel/``),
    which a plugin importing the contracts from ``subnetdp`` must not pull in."""
    if name in ("parallelize", "SubnetworkParallel"):
        from subnetdp.parallel import wrapper

        return getattr(wrapper, name)
    raise AttributeError(f"module 'subnetdp' has no attribute {name!r}")
