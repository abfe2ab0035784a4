"""The averaged gradient's global norm over the world, and clipping to a maximum norm."""

from __future__ import annotations

import math
import torch

from subnetdp.core.contracts import Communicator
from subnetdp.sdp.sync.protocol import GradSynchronizer

def clip_to(averager: GradSynchronizer, norm: float, max_norm: float) -> None:
    """Scale every gradient by ``max_norm / norm`` when the norm is above ``max_norm`` (0: no clipping)."""
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            averager.scale_grads_(coef)


def world_norm(comm: Communicator, local_squares: torch.Tensor, flags: torch.Tensor | None = None) -> float:
    """``sqrt`` of the world's sum of ``local_squares`` (float64 scalar); ``flags`` ride along, summed in place.

    With ``flags`` (:data:`FLAG_SLOTS` values per rank), this rank's flag is raised first when its own share is not
    finite: inf and NaN in any gradient propagate into it, so the norm doubles as the inf/NaN check.
    Collective: every rank of the world calls it.
    """
    if flags is not None:
        flags[comm.rank] += (~torch.isfinite(local_squares)).to(flags.dtype)
    both = torch.cat([local_squares.view(1), flags.to(local_squares)]) if flags is not None else local_squares.view(1)
    comm.all_reduce(both, tuple(range(comm.world_size))).wait()
    if flags is not None:
        flags.copy_(both[1:])
    return math.sqrt(float(both[0]))
