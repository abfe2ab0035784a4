"""The four SDP variants from one config: granularity (block, neuron) x regime (forward, backward).

- B-SDP / N-SDP (``masker.regime=forward``): the adapter materialises the rank's subnetwork (dropped
  blocks compute their shortcut; narrowed layers are physically narrower).
- Bb-SDP / Nb-SDP (``masker.regime=backward``): the full model, with non-owned units frozen or split
  off (:mod:`subnetdp.sdp.backward`), refreshed from their owners every ``masker.refresh_every`` steps.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from subnetdp.sdp.backward import apply_backward_masking
from subnetdp.core.contracts import DataSpec, ModelAdapter, ParamMap, Partition


def rescale_enabled(mcfg: Any) -> bool:
    """``masker.rescale``, defaulting to on for neuron level and off for block level."""
    value = mcfg.rescale
    return str(mcfg.granularity) == "neuron" if value is None else bool(value)


def partition_model(adapter: ModelAdapter, full: nn.Module, mcfg: Any, spec: DataSpec) -> Partition:
    """The adapter's partition; neuron level passes ``masker.units_per_layer``."""
    granularity = str(mcfg.granularity)
    if granularity == "neuron":
        return adapter.partition(full, granularity, spec, units_per_layer=int(mcfg.units_per_layer))
    return adapter.partition(full, granularity, spec)


def local_model(adapter: ModelAdapter, full: nn.Module, owned: Sequence[int], partition: Partition,
                mcfg: Any) -> tuple[nn.Module, ParamMap]:
    """What this rank holds: the materialised subnetwork (forward) or the masked full model (backward).

    Takes ownership of ``full``.
    """
    if is_backward(mcfg):
        return apply_backward_masking(full, partition, owned)
    if partition.granularity == "neuron":
        return adapter.materialize(full, owned, partition, rescale=rescale_enabled(mcfg))
    return adapter.materialize(full, owned, partition)


def is_backward(mcfg: Any) -> bool:
    return str(mcfg.regime) == "backward"
