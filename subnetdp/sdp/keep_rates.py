"""A re-plan that changes how often a residual branch runs in training: the union rule, applied in training.

Under block-level forward masking a unit's residual branch runs in the forward of ``k(u)`` of ``W``
ranks: its training *keep rate* is ``k(u) / W``, and the union model is evaluated with every branch
scaled by that rate (``eval.block_union=rescaled``, :func:`~subnetdp.sdp.branches.fold_branch_scales`):
the test-time rule of stochastic depth, since a network that never ran all its branches at once is
off its training distribution when it does. A re-plan that raises the rate (a resume at C = 1 from a
checkpoint trained at C = 0.5, or under backward masking, which runs every branch) puts the trained
values into exactly that situation, in training. :func:`rescale_branches` then scales each such
branch by ``old / new`` rate, folded into its output layer as the union evaluation folds it, so the
first forward after the change computes the function the rescaled union evaluation measured.

The optimizer's and the synchroniser's per-parameter state move with the weights they belong to
(``w' = s w``): first moments (SGD's ``momentum_buffer``, Adam's ``exp_avg``) and local steps' anchor
and outer momentum x ``s``, second moments (``exp_avg_sq``, ``max_exp_avg_sq``) x ``s^2``. SGD's
pending momentum then moves each weight in proportion to its new size; Adam's step
``exp_avg / sqrt(exp_avg_sq)`` is unchanged, and the averages keep the scale of the new weights'
gradients that join them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from subnetdp.core.contracts import Partition
from subnetdp.core.errors import SubnetdpError
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.branches import fold_branch_scales
from subnetdp.sdp.variants import regime_of

#: Optimizer state per parameter -> the power of the weight's scale it carries.
STATE_POWERS = {"momentum_buffer": 1, "exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 2}


def forward_keep_rates(masker: Any, partition: Partition, plan: MaskPlan) -> dict[str, float]:
    """Block name -> the fraction of the global batch whose training forward runs its residual branch:
    ``k(u) / W`` under block-level forward masking, 1 under backward masking (every rank runs the
    whole forward); empty at neuron level (no branch is ever dropped)."""
    if partition.granularity != "block":
        return {}
    if not regime_of(masker).drops_branches:
        return {u.name: 1.0 for u in partition.units}
    return {u.name: len(plan.owners(u.id)) / plan.world_size for u in partition.units}


def rising_rates(trained: Mapping[str, float], now: Mapping[str, float]) -> dict[str, tuple[float, float]]:
    """Block name -> (trained rate, new rate) of every branch that now runs in more of the forwards."""
    return {name: (trained[name], rate) for name, rate in now.items()
            if name in trained and rate > trained[name] * (1 + 1e-9)}


def describe(rising: Mapping[str, tuple[float, float]]) -> str:
    """``layer1.0, layer2.0 (0.5 -> 1); layer3.0 (0.25 -> 0.5)``: the blocks grouped by their change."""
    groups: dict[tuple[float, float], list[str]] = {}
    for name, change in rising.items():
        groups.setdefault(change, []).append(name)
    return "; ".join(f"{', '.join(names)} ({a:.3g} -> {b:.3g})" for (a, b), names in sorted(groups.items()))


@torch.no_grad()
def rescale_branches(model: nn.Module, layers: Mapping[str, Sequence[nn.Module]], scales: Mapping[str, float],
                     optimizer: torch.optim.Optimizer, extra: Sequence[tuple[str, str, torch.Tensor]] = ()) -> int:
    """Scale each residual branch of block ``name`` by ``scales[name]`` in ``model``'s weights, with the
    optimizer's state of those weights and the synchroniser's (``extra``: ``(prefix, local parameter
    name, tensor)``, each of its parameter's shape). Every owner of a block applies the same factors
    to the same values, so owners stay bit-identical.

    Returns:
        the number of layers scaled.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    by_name: dict[str, list[torch.Tensor]] = {}
    for _, name, t in extra:
        by_name.setdefault(name, []).append(t)
    for block, modules in layers.items():
        s = float(scales.get(block, 1.0))
        if s == 1.0:
            continue
        for m in modules:
            for p in (m.weight, getattr(m, "bias", None)):
                if p is None:
                    continue
                _scale_state(optimizer.state.get(p, {}), s, names.get(id(p), block))
                for t in by_name.get(names.get(id(p), ""), []):
                    t.mul_(s)
    return fold_branch_scales(layers, scales)


def _scale_state(state: dict[str, Any], s: float, name: str) -> None:
    for key, value in state.items():
        if not torch.is_tensor(value) or value.dim() == 0:
            continue  # a step count
        if key not in STATE_POWERS:
            raise SubnetdpError(f"re-planning cannot rescale the optimizer state {key!r} of {name}: it knows "
                                f"{', '.join(STATE_POWERS)}; set eval.block_union=x1 to leave the branches as they are")
        value.mul_(s ** STATE_POWERS[key])
