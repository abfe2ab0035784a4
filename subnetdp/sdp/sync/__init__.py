"""Gradient synchronisation among the owners of each piece, one module per concept.

- :mod:`~subnetdp.sdp.sync.settings`: :class:`SyncSettings` (the ``sync.*`` keys), dense or grouped.
- :mod:`~subnetdp.sdp.sync.protocol`: :class:`GradSynchronizer`, what the step, the loop and the
  checkpointer ask of a synchroniser, and :class:`EveryStepSync`.
- :mod:`~subnetdp.sdp.sync.buckets`: gradient buckets and their segments.
- :mod:`~subnetdp.sdp.sync.averager`: :class:`OwnerGroupAverager`, per-step owner-group averaging.
- :mod:`~subnetdp.sdp.sync.norm`: the global gradient norm and clipping.
- :mod:`~subnetdp.sdp.sync.guard`: :class:`NonFiniteGuard`, the inf/NaN guard.
- :mod:`~subnetdp.sdp.sync.factory`: :func:`make_synchronizer`, the one way to make a synchroniser.
- :mod:`~subnetdp.sdp.sync.legacy`: :func:`stateful`, a synchroniser with the state methods of the
  protocol before ``state_dict``/``load_state_dict`` (deprecated) seen through the new two.

The package re-exports every name the former ``subnetdp.sdp.sync`` module held, so
``from subnetdp.sdp.sync import OwnerGroupAverager`` keeps working; ``subnetdp.sdp.synchronizers``
is an old path of :mod:`~subnetdp.sdp.sync.factory` (``subnetdp.core.moved``).
"""

from __future__ import annotations

from typing import Any

from subnetdp.sdp.sync.settings import FLAG_SLOTS, SyncSettings, uses_dense_sync
from subnetdp.sdp.sync.buckets import Bucket, Segment, _split
from subnetdp.sdp.sync.protocol import EveryStepSync, GradSynchronizer
from subnetdp.sdp.sync.norm import clip_to, world_norm
from subnetdp.sdp.sync.averager import OwnerGroupAverager
from subnetdp.sdp.sync.guard import Checked, NonFiniteGuard
from subnetdp.sdp.sync.legacy import stateful

_FACTORY = ("ShardedSynchronizer", "make_synchronizer")


def __getattr__(name: str) -> Any:
    """The factory's names, imported on first use: the factory imports local steps, which import the
    modules above through this package, so importing it here would run in a circle."""
    if name in _FACTORY:
        from subnetdp.sdp.sync import factory

        return getattr(factory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "FLAG_SLOTS", "Bucket", "Checked", "EveryStepSync", "GradSynchronizer", "NonFiniteGuard", "OwnerGroupAverager",
    "Segment", "ShardedSynchronizer", "SyncSettings", "clip_to", "make_synchronizer", "stateful", "uses_dense_sync",
    "world_norm",
]
