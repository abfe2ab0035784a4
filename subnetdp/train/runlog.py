"""A run's log writers (:class:`RunLogger`): ``metrics.jsonl`` and TensorBoard events, rank 0's and each rank's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class RunLogger:
    """Writes a run's ``metrics.jsonl`` and TensorBoard events.

    Rank 0 writes the global series to ``RUN_DIR/tensorboard``; every rank writes the values that
    differ by rank (memory, bytes, step time, its local loss) to ``RUN_DIR/tensorboard/rank_{r}``,
    so TensorBoard shows one curve per rank under the same tag.
    """

    def __init__(self, run_dir: Path, rank: int, tensorboard: bool = True) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.global_writer = None
        self.rank_writer = None
        self._jsonl = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = run_dir / "tensorboard"
            if rank == 0:
                self.global_writer = SummaryWriter(str(tb))
            self.rank_writer = SummaryWriter(str(tb / f"rank_{rank}"))
        if rank == 0:
            self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")

    def scalars(self, step: int, values: dict[str, float], per_rank: bool = False) -> None:
        writer = self.rank_writer if per_rank else self.global_writer
        if writer is None:
            return
        for k, v in values.items():
            if v is not None:
                writer.add_scalar(k, float(v), step)

    def jsonl(self, record: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()

    def text(self, tag: str, text: str) -> None:
        if self.global_writer is not None:
            self.global_writer.add_text(tag, text, 0)

    def histogram(self, tag: str, values: Any, step: int = 0) -> None:
        if self.global_writer is not None:
            import numpy as np

            values = np.asarray(values)
            # One bin per integer value: owner counts are small integers.
            self.global_writer.add_histogram(tag, values, step, bins=np.arange(values.min(), values.max() + 2) - 0.5)

    def image(self, tag: str, img: Any, step: int = 0, dataformats: str = "HW") -> None:
        if self.global_writer is not None:
            self.global_writer.add_image(tag, img, step, dataformats=dataformats)

    def close(self) -> None:
        for w in (self.global_writer, self.rank_writer):
            if w is not None:
                w.flush()
                w.close()
        if self._jsonl is not None:
            self._jsonl.close()
        self.global_writer = self.rank_writer = self._jsonl = None
