"""The one way to make a gradient synchroniser: :func:`make_synchronizer`.

The loop (through the training state), both dry runs of ``subnetdp plan`` and FSDP make their
synchroniser here, from :class:`~subnetdp.sdp.sync.settings.SyncSettings`: per-step owner-group averaging
(:class:`~subnetdp.sdp.sync.averager.OwnerGroupAverager`), local steps
(:class:`~subnetdp.sdp.local_steps.LocalStepsSynchronizer`), or, for a sharded model, what
``parallel/`` hands in (FSDP's averager stands a floor above and is passed in, not imported).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from subnetdp.core.contracts import Communicator, ParamMap, Partition
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.local_steps import LocalStepsSynchronizer
from subnetdp.sdp.sync.averager import OwnerGroupAverager
from subnetdp.sdp.sync.legacy import stateful
from subnetdp.sdp.sync.protocol import GradSynchronizer
from subnetdp.sdp.sync.settings import SyncSettings

#: What ``parallel/`` hands :func:`make_synchronizer` for sharded (FSDP) models: it builds the
#: synchroniser from the settings, model, parameter map, plan (over all ranks), partition and communicator.
ShardedSynchronizer = Callable[[SyncSettings, nn.Module, ParamMap, MaskPlan, Partition, Communicator], GradSynchronizer]


def make_synchronizer(settings: SyncSettings, model: nn.Module, pmap: ParamMap, plan: MaskPlan, partition: Partition,
                      comm: Communicator, *, sharded: Optional[ShardedSynchronizer] = None,
                      last_good: Callable[[], Any] = lambda: None) -> GradSynchronizer:
    """The synchroniser of ``model`` under ``plan``: the one way a run, a dry run or FSDP makes one.

    Args:
        settings: the ``sync.*`` keys.
        model, pmap, plan, partition: the rank's model and map, the plan, the partition.
        comm: the communicator (initialised, or a dry run's).
        sharded: FSDP's synchroniser for sharded models (``subnetdp.parallel.fsdp.Sharding``), or None.
        last_good: gives the last good checkpoint, named when local steps stop on inf/NaN.

    Collective: every rank creates every owner group, in the same order (the communicator keeps
    them, so a second synchroniser over the same owner sets creates none).
    """
    if sharded is not None:  # handed in from outside: it may predate state_dict (sdp/sync/legacy.py)
        return stateful(sharded(settings, model, pmap, plan, partition, comm))
    if settings.mode == "local_steps":  # FSDP is refused for it before any process group exists
        return LocalStepsSynchronizer(model, pmap, plan, partition, comm, settings, last_good=last_good)
    return OwnerGroupAverager(model, pmap, plan, partition, comm, settings.bucket_cap_mb, settings.max_groups)
