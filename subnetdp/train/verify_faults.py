"""Test-only fault injection for the owners' verification: flip one bit of one owner's tensor.

``SUBNETDP_TEST_FLIP_BIT=STEP:RANK:UNIT[:BIT]`` (UNIT: a unit id, or ``shared``; BIT: which bit of
the value, 0 = the lowest, the default; several faults separated by commas) flips that bit of the
first value of that unit's first parameter piece on rank RANK after step STEP, the kind of silent
corruption a faulty memory cell makes. A flipped low mantissa bit can be rounded away by the next
update (the owners then agree again, and nothing is wrong); a test that needs the fault to last
until the next verification flips a higher one. It sits beside the other
test-only fault points (``SUBNETDP_TEST_KILL_*``) and does nothing when the variable is unset.
"""

from __future__ import annotations

import os

import torch

from subnetdp.core.contracts import Communicator
from subnetdp.sdp.verify import SHARED, unit_tensors

FLIP_BIT = "SUBNETDP_TEST_FLIP_BIT"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flips_asked(step: int, rank: int) -> list[tuple[int, int]]:
    """``(unit, bit)`` of every flip this rank makes after ``step``."""
    out = []
    for fault in filter(None, os.environ.get(FLIP_BIT, "").split(",")):
        at, who, unit, *bit = fault.strip().split(":")
        if int(at) == step and int(who) == rank:
            out.append((SHARED if unit == "shared" else int(unit), int(bit[0]) if bit else 0))
    return out


def flip_bits(step: int, state, comm: Communicator) -> None:
    """Flip the bits :func:`flips_asked` names (no communication: the other owners never learn of it)."""
    for unit, bit in flips_asked(step, comm.rank):
        for u, _, _, view in unit_tensors(state.model, state.optimizer, state.pmap, state.partition, state.plan,
                                          comm.rank):
            if u == unit:
                with torch.no_grad():
                    first = view.detach()[(0,) * view.dim()]  # a 0-d view into the tensor's storage
                    bits = first.clone().reshape(1).view(_INT_OF_SIZE[first.element_size()])
                    bits ^= 1 << bit
                    first.copy_(bits.view(first.dtype).reshape(()))
                break
        else:
            raise ValueError(f"{FLIP_BIT}: rank {comm.rank} does not own {unit}")
