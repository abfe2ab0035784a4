"""Activation checkpointing of materialised blocks (``train.activation_checkpointing``)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Sequence

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def _running_stats_frozen(norms: list[_BatchNorm]) -> Iterator[None]:
    """BatchNorm whose recomputation leaves the running statistics as they are.

    The recomputed forward must not count the batch a second time. Momentum 0 makes the update
    ``1 * running + 0 * batch``, which is the running value exactly, while the operation saves the
    same tensors for backward as the original forward did (turning tracking off would not);
    ``num_batches_tracked`` gets its value back afterwards.
    """
    saved = [(bn.momentum, bn.num_batches_tracked.clone() if bn.num_batches_tracked is not None else None)
             for bn in norms]
    for bn in norms:
        bn.momentum = 0.0
    try:
        yield
    finally:
        for bn, (momentum, count) in zip(norms, saved):
            bn.momentum = momentum
            if count is not None:
                bn.num_batches_tracked.copy_(count)


def _checkpointed(block: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    norms = [m for m in block.modules() if isinstance(m, _BatchNorm)]

    def contexts() -> tuple[Any, Any]:
        return contextlib.nullcontext(), _running_stats_frozen(norms)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with keyword arguments, gradient hooks and FSDP2, and restores the
        # RNG state for the recomputation, so dropout and stochastic depth draw the same masks twice.
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

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
        block.forward = _checkpointed(block, block.forward)
        block._subnetdp_checkpointed = True
    return positions
