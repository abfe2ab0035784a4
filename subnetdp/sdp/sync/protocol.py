"""What the step, the loop and the checkpointer ask of a synchroniser (:class:`GradSynchronizer`), and
what every-step synchronisers answer alike (:class:`EveryStepSync`)."""

from __future__ import annotations

from typing import Any, ContextManager, Mapping, Optional, Protocol

import torch

class GradSynchronizer(Protocol):
    """What the step, the loop and the checkpointer ask of a synchroniser (:class:`OwnerGroupAverager`,
    FSDP's ``ShardedOwnerAverager``, :class:`~subnetdp.sdp.local_steps.LocalStepsSynchronizer`).

    Per step: :meth:`prepare`, the micro-batches' backward (all but the last inside :meth:`no_sync`),
    :meth:`carry` of the inf/NaN flags, :meth:`finish` (collective: owner groups average), then
    :meth:`grad_norm` / :meth:`scale_grads_` for clipping, the optimizer update, and
    :meth:`after_update`. Checkpoints save and restore what it keeps besides the model
    (:meth:`extra_tensors`, :meth:`rank_state`).
    """

    dense: bool
    replicated: bool
    #: Whether owners' copies of a piece differ between synchronisations (local steps), so every
    #: owner writes its own copy to a checkpoint instead of one writer per piece.
    owners_diverge: bool

    def prepare(self, keep_grads: bool = False) -> None:
        """Drop the last step's gradients (before the memory baseline of a measured step).

        ``keep_grads``: keep them instead, so the coming backward adds to them (a user loop that did not
        zero its gradients, as DDP accumulates).
        """

    def no_sync(self) -> ContextManager[None]:
        """Accumulate gradients locally: no collective inside the block."""

    #: Whether the guard's check stays on this rank (local steps between synchronisations): the
    #: step then agrees on no world flags; stop signals wait for :meth:`after_update`'s
    #: synchronisation (or, with ``sync.stop_every_step``, the loop's collective of its own).
    checks_locally: bool

    def carry(self, flags: torch.Tensor) -> bool:
        """Let ``flags`` (:data:`FLAG_SLOTS` per rank) ride along this step's collectives; False if it cannot."""

    def carried(self) -> Optional[torch.Tensor]:
        """The world's sum of the carried flags, after :meth:`finish`."""

    def finish(self) -> None:
        """Average this step's gradients over each unit's owners. Collective."""

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's (averaged, after :meth:`finish`) gradients."""

    def grad_norm(self, flags: Optional[torch.Tensor] = None) -> float:
        """Norm of the averaged full-model gradient, each unit once; ``flags`` are summed over the world."""

    def scale_grads_(self, coef: float) -> None:
        """Multiply every gradient by ``coef`` in place."""

    def defer_nonfinite(self, step: int) -> bool:
        """A non-finite loss or gradient at ``step`` was seen on some rank: True if this synchroniser
        takes it over (local steps: this rank skips its inner step and every rank hears of it at the
        next synchronisation), False to let the guard apply ``train.on_nonfinite`` now."""

    def after_update(self, step: int, last_step: int, signum: int = 0) -> Optional[dict[int, int]]:
        """After the optimizer update of ``step`` (of ``last_step``): local steps' outer synchronisation
        when a cycle ends (collective then, on every rank at the same steps); nothing for every-step.

        Returns the stop signals agreed in it (rank -> signal number, ``signum`` this rank's pending
        one, 0 for none), or None when it issued no world reduction."""

    def extra_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """``(key prefix, local parameter name, tensor)`` of the state it keeps per piece (local steps'
        anchor and outer momentum), each of its parameter's local shape, so a checkpoint keys it by
        unit like the parameter. Empty for every-step synchronisers."""

    def resume_at(self, step: int) -> None:
        """The run continues after ``step`` (a checkpoint's), called before the pieces are loaded:
        local steps with ``sync.warmup_steps`` take the phase of that step here (per-step
        synchronisation before it, local steps and their outer state from it on)."""

    def restore_extra(self, found: set[str]) -> None:
        """After the pieces were loaded: ``found`` are the prefixes of :meth:`extra_tensors` the source
        held; make up for what it lacked (local steps without an anchor restart their cycle here)."""

    def rank_state(self) -> dict[str, Any]:
        """Per-rank state for the rank's checkpoint file (local steps: the cycle's skipped-step counts)."""

    def load_rank_state(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`rank_state` saved, from a rank's checkpoint file (keys it lacks are skipped)."""

    def bytes_per_step(self) -> float:
        """Payload this rank hands to gradient collectives per step (over a cycle with local steps)."""

    def log_figures(self) -> dict[str, float]:
        """Per-rank figures of a log step (local steps: the last synchronisation's bytes per step of its cycle)."""

    def state_tensors(self) -> list[torch.Tensor]:
        """Persistent buffers, for memory accounting."""

    def remove_hooks(self) -> None:
        """Detach from the model (before the plan changes)."""

    def owner_groups(self) -> list[tuple[int, ...]]:
        """The owner sets this rank averages with."""

    def describe(self) -> dict[str, Any]:
        """This synchroniser's fields of the summary (per rank): ``sync_mode`` and its figures."""


class EveryStepSync:
    """What the synchronisers that average every step (:class:`OwnerGroupAverager`, FSDP's
    ``ShardedOwnerAverager``) answer alike: no state besides the model, nothing after an update."""

    owners_diverge = False  # every owner holds the same averaged values after every step
    checks_locally = False  # every step's flags reach the world (carried, or in the guard's reduction)

    def defer_nonfinite(self, step: int) -> bool:
        return False  # every step is synchronised: the guard applies train.on_nonfinite at once

    def after_update(self, step: int, last_step: int, signum: int = 0) -> Optional[dict[int, int]]:
        return None  # the gradients were averaged before the update

    def extra_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        return []

    def resume_at(self, step: int) -> None:
        return None  # the same synchronisation at every step

    def restore_extra(self, found: set[str]) -> None:
        return None

    def rank_state(self) -> dict[str, Any]:
        return {}

    def load_rank_state(self, state: Mapping[str, Any]) -> None:
        return None

    def log_figures(self) -> dict[str, float]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {"sync_mode": "every_step"}
