"""The masker contract: which units each rank trains."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from subnetdp.core.plan import MaskPlan

from subnetdp.core.contracts.types import Partition
from subnetdp.core.contracts.plugin import MaskerConfig, Plugin


class Masker(Plugin, abc.ABC):
    """Chooses which units every rank owns. Must be a pure function of its arguments."""

    Config: ClassVar[type] = MaskerConfig

    @abc.abstractmethod
    def plan(self, partition: Partition, world_size: int, seed: int) -> "MaskPlan":
        """Return the plan: for every rank the sorted ids of the units it owns."""
