"""The four SDP variants from one config: granularity (block, neuron) x regime (forward, backward).

- B-SDP / N-SDP (``masker.regime=forward``): the adapter materialises the rank's subnetwork (dropped
  blocks compute their shortcut; narrowed layers are physically narrower).
- Bb-SDP / Nb-SDP (``masker.regime=backward``): the full model, with non-owned units frozen or split
  off (:mod:`subnetdp.sdp.backward`), refreshed from their owners every ``masker.refresh_every`` steps.

What the regime decides is a :class:`Regime`, looked up once by :func:`regime_of`: the code that builds,
evaluates, rescales or refreshes asks it what to do, never compares the regime's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn

from subnetdp.sdp.backward import apply_backward_masking
from subnetdp.core.contracts import DataSpec, ModelAdapter, ParamMap, Partition
from subnetdp.core.errors import ConfigError, suggest


@dataclass(frozen=True)
class Regime:
    """What ``masker.regime`` decides, in one place.

    Attributes:
        name: the config value.
        full_model: every rank materialises the full model and masks the units it does not own
            (backward), instead of materialising its subnetwork (forward).
        drops_branches: a block a rank does not own is skipped in that rank's training forward, so a
            residual branch runs in ``k(u) / W`` of the forwards: its keep rate, which the union's
            ``eval.block_union=rescaled`` and a re-plan's rising rates scale by (block level only).
        refreshes: non-owned units are refreshed from their owners every ``masker.refresh_every`` steps.
    """

    name: str
    full_model: bool
    drops_branches: bool
    refreshes: bool


REGIMES = {r.name: r for r in (Regime("forward", full_model=False, drops_branches=True, refreshes=False),
                                Regime("backward", full_model=True, drops_branches=False, refreshes=True))}


def regime_of(mcfg: Any) -> Regime:
    """The :class:`Regime` of a ``masker`` section; an unknown one is one line with the choices."""
    name = mcfg.regime
    if name not in REGIMES:
        raise ConfigError("masker.regime", name, f"unknown masking regime; available: {', '.join(REGIMES)}"
                          + suggest(name, REGIMES))
    return REGIMES[name]


def rescale_enabled(mcfg: Any) -> bool:
    """``masker.rescale``, defaulting to on for neuron level and off for block level."""
    value = mcfg.rescale
    return mcfg.granularity == "neuron" if value is None else bool(value)


def partition_model(adapter: ModelAdapter, full: nn.Module, mcfg: Any, spec: DataSpec) -> Partition:
    """The adapter's partition; neuron level passes ``masker.units_per_layer``."""
    granularity = mcfg.granularity
    if granularity == "neuron":
        return adapter.partition(full, granularity, spec, units_per_layer=mcfg.units_per_layer)
    return adapter.partition(full, granularity, spec)


def local_model(adapter: ModelAdapter, full: nn.Module, owned: Sequence[int], partition: Partition,
                mcfg: Any) -> tuple[nn.Module, ParamMap]:
    """What this rank holds: the materialised subnetwork (forward) or the masked full model (backward).

    Takes ownership of ``full``.
    """
    if regime_of(mcfg).full_model:
        return apply_backward_masking(full, partition, owned)
    if partition.granularity == "neuron":
        return adapter.materialize(full, owned, partition, rescale=rescale_enabled(mcfg))
    return adapter.materialize(full, owned, partition)

