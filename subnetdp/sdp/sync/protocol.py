"""What the step, the loop and the checkpointer ask of a synchroniser (:class:`GradSynchronizer`), and
what every-step synchronisers answer alike (:class:`EveryStepSync`)."""

from __future__ import annotations

from typing import Any, ContextManager, Mapping, Optional, Protocol

import torch

from subnetdp.sdp.sync.legacy import OldStateMethods

class GradSynchronizer(Protocol):
    """What the step, the loop and the checkpointer ask of a synchroniser (:class:`OwnerGroupAverager`,
    FSDP's ``ShardedOwnerAverager``, :class:`~subnetdp.sdp.local_steps.LocalStepsSynchronizer`).

    Per step: :meth:`prepare`, the micro-batches' backward (all but the last inside :meth:`no_sync`),
    :meth:`carry` of the inf/NaN flags, :meth:`finish` (collective: owner groups average), then
    :meth:`grad_norm` / :meth:`scale_grads_` for clipping, the optimizer update, and
    :meth:`after_update`. Checkpoints save and restore what it keeps besides the model
    (:meth:`state_dict`, :meth:`load_state_dict`).
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

    def state_dict(self) -> dict[str, Any]:
        """What it keeps besides the model, for a checkpoint (torch's ``Stateful`` shape):
        ``{"pieces": {key prefix: {local parameter name: tensor}}, "rank": {key: value}}``.

        ``pieces``: state kept per parameter (local steps' ``outer_anchor/`` and ``outer_momentum/``),
        each tensor of its parameter's local shape, so a checkpoint cuts it and keys it by unit like the
        parameter; the live tensors, not copies. ``rank``: plain per-rank values (local steps: the
        cycle's skipped inner steps), written into the rank's state file. Both empty for every-step
        synchronisers."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave, after the model's pieces were loaded.

        ``state["step"]``, when present, is the step the run continues after (a checkpoint's): local
        steps with ``sync.warmup_steps`` take that step's phase (per-step synchronisation before it,
        local steps from it on); absent (a re-plan from the live owners), the phase stays. A prefix
        missing from ``pieces`` is made up for (local steps without an anchor restart their cycle at
        the loaded parameters; a missing momentum starts at zero); a key missing from ``rank`` is skipped.
        """

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


class EveryStepSync(OldStateMethods):
    """What the synchronisers that average every step (:class:`OwnerGroupAverager`, FSDP's
    ``ShardedOwnerAverager``) answer alike: no state besides the model, nothing after an update
    (and, for one release, the old state methods: :class:`~subnetdp.sdp.sync.legacy.OldStateMethods`)."""

    owners_diverge = False  # every owner holds the same averaged values after every step
    checks_locally = False  # every step's flags reach the world (carried, or in the guard's reduction)

    def defer_nonfinite(self, step: int) -> bool:
        return False  # every step is synchronised: the guard applies train.on_nonfinite at once

    def after_update(self, step: int, last_step: int, signum: int = 0) -> Optional[dict[int, int]]:
        return None  # the gradients were averaged before the update

    def state_dict(self) -> dict[str, Any]:
        return {"pieces": {}, "rank": {}}  # nothing besides the model

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None  # the same synchronisation at every step, nothing of its own to restore

    def log_figures(self) -> dict[str, float]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {"sync_mode": "every_step"}
