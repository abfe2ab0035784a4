"""The ``sync.*`` keys, read once (:class:`SyncSettings`), and the choice between grouped and dense averaging."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Values per rank that ride in the world's last gradient bucket and in the guard's reduction: the
#: first W slots hold each rank's inf/NaN flag, the next W its pending stop signal (0: none).
FLAG_SLOTS = 2


def uses_dense_sync(owner_sets: int, max_groups: int) -> bool:
    """Whether a plan with ``owner_sets`` distinct owner sets is averaged densely over the world
    (``sync.max_groups``: the most owner sets that get a process group of their own)."""
    return owner_sets > max_groups


@dataclass(frozen=True)
class SyncSettings:
    """How a run synchronises: the ``sync.*`` keys (and ``train.on_nonfinite``), read from the config once.

    Attributes:
        mode: ``every_step`` (gradients averaged among owners after every backward) or
            ``local_steps`` (owners average parameter deltas every ``every`` steps).
        bucket_cap_mb: the largest bucket (dense mode: chunk), in MiB.
        max_groups: the most distinct owner sets that get a process group; above it, dense mode.
        every, outer_lr, outer_momentum, outer_on_host: local steps' cycle and outer optimizer.
        warmup_steps: local steps begin after this many steps synchronised every step.
        on_nonfinite: ``stop`` or ``skip``: what local steps do at a synchronisation that hears of inf/NaN.
    """

    mode: str = "every_step"
    bucket_cap_mb: float = 25.0
    max_groups: int = 64
    every: int = 1
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    outer_on_host: bool = False
    warmup_steps: int = 0
    on_nonfinite: str = "stop"

    @classmethod
    def from_config(cls, cfg: Any) -> "SyncSettings":
        s = cfg.sync
        return cls(mode=str(s.mode), bucket_cap_mb=float(s.bucket_cap_mb), max_groups=int(s.max_groups),
                   every=int(s.every), outer_lr=float(s.outer_lr), outer_momentum=float(s.outer_momentum),
                   outer_on_host=bool(s.outer_on_host), warmup_steps=int(s.warmup_steps),
                   on_nonfinite=cfg.train.on_nonfinite)

    @property
    def cycle(self) -> int:
        """Steps between two points where owners agree: ``every`` with local steps, else 1."""
        return self.every if self.mode == "local_steps" else 1
