"""Activation checkpointing of materialised blocks (``train.activation_checkpointing``)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with keyword arguments, gradient hooks and FSDP2, and restores the
        # RNG state for the recomputation, so dropout draws the same mask twice.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def checkpointed_positions(n_blocks: int, every: int) -> list[int]:
    """Which of ``n_blocks`` blocks (in forward order) are checkpointed: every ``every``-th.

    ``every = 1`` checkpoints all of them, ``every = 2`` the 2nd, 4th, ...; 0 none.
    """
    if every <= 0:
        return []
    return [i for i in range(n_blocks) if (i + 1) % every == 0]


def apply_ac(blocks: Sequence[nn.Module], every: int) -> list[int]:
    """Recompute the activations of every ``every``-th block in backward instead of storing them.

    The block's ``forward`` is wrapped in place, so parameter and buffer names do not change (a
    checkpoint, the parameter map and the owner-group averager see the same model) and hooks put on
    the module later (FSDP2's all-gather) run around the checkpointed forward.

    Args:
        blocks: the materialised blocks in forward order (``ModelAdapter.blocks``).
        every: k of ``train.activation_checkpointing``; 0 turns checkpointing off.

    Returns:
        The positions of the checkpointed blocks.
    """
    positions = checkpointed_positions(len(blocks), every)
    for i in positions:
        block = blocks[i]
        if getattr(block, "_subnetdp_checkpointed", False):
            continue
        block.forward = _checkpointed(block.forward)
        block._subnetdp_checkpointed = True
    return positions
