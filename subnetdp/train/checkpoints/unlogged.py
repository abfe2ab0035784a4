"""The losses of finished steps that no ``metrics.jsonl`` row holds yet, kept through a recovery.

A log row is written after the world's losses are added up (a collective on log steps). A rank that
dies between a step's update and that sum leaves a step every survivor finished and nobody logged:
the survivors resume after it, and its row would be missing. So each rank notes its own loss of
every finished step until a row holds it (:class:`Unlogged`); a survivor's fragment keeps the notes
up to the step it saved, the checkpoint assembled from the fragments carries every survivor's
(``unlogged_losses`` in its manifest), and the resumed run's rank 0 hands them to its reporter
(:func:`carried`): the row of that step is written from them, marked ``"recovered"`` with the ranks
whose losses it averages (the dead ranks' are gone), or, when the step is not a log step, they join
the next row's mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from subnetdp.core import records


class Unlogged:
    """This rank's losses of finished steps after the last log row (step -> loss)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def note(self, step: int, loss: float | None) -> None:
        """``step`` finished with this rank's ``loss`` (a non-finite one is left out of the mean)."""
        if loss is not None and math.isfinite(loss):
            self.losses[step] = float(loss)

    def logged(self, step: int) -> None:
        """A row holds every step up to ``step``."""
        self.losses = {s: v for s, v in self.losses.items() if s > step}

    def upto(self, step: int, progress: Any = None) -> dict[int, float]:
        """What a fragment of ``step`` keeps: the notes up to it, and the loss of the step in progress
        when it passed its update but was not noted yet (``progress``: the state's ``StepProgress``)."""
        out = {s: v for s, v in self.losses.items() if s <= step}
        if progress is not None and progress.updated and progress.step == step and step not in out \
                and progress.loss is not None:
            loss = float(progress.loss)
            if math.isfinite(loss):
                out[step] = loss
        return out


def manifest_entries(fragments: list[tuple[int, dict[str, float]]]) -> list[dict[str, Any]]:
    """The ``unlogged_losses`` of an assembled checkpoint from ``(rank, {step: loss})`` of its fragments."""
    return [{"rank": rank, "step": int(s), "loss": float(v)}
            for rank, losses in sorted(fragments) for s, v in sorted(losses.items(), key=lambda kv: int(kv[0]))]


@dataclass(frozen=True)
class Carried:
    """Losses a resumed run's log owes: of the steps after its last row up to ``step``, by rank."""

    step: int  # the step the run resumed from
    world_size: int  # of the run that trained them
    entries: tuple[tuple[int, int, float], ...]  # (rank, step, loss)

    @property
    def ranks(self) -> list[int]:
        return sorted({r for r, _, _ in self.entries})

    @property
    def losses(self) -> list[float]:
        return [v for _, _, v in self.entries]


def carried(manifest: dict[str, Any], metrics: Path) -> Carried | None:
    """What the checkpoint's ``unlogged_losses`` add to the log ``metrics`` (None: nothing): the
    entries after the last training row at or before the checkpoint's step."""
    entries = manifest.get("unlogged_losses") or []
    if not entries:
        return None
    step = int(manifest["step"])
    last = last_logged(metrics, step)
    kept = tuple((int(e["rank"]), int(e["step"]), float(e["loss"])) for e in entries if last < int(e["step"]) <= step)
    return Carried(step, int(manifest["world_size"]), kept) if kept else None


def last_logged(metrics: Path, step: int) -> int:
    """The step of the last training row at or before ``step`` in ``metrics`` (0: none)."""
    last = 0
    if not metrics.is_file():
        return last
    for line in metrics.read_bytes().splitlines():
        try:
            record = records.parse_json(line)
        except records.BadJSON:
            continue  # a line cut short by a crash
        at = record.get("step") if isinstance(record, dict) else None
        if isinstance(at, int) and "train/loss" in record and last < at <= step:
            last = at
    return last
