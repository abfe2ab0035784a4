"""``consumed_before``: a resumed run's tokens/samples seen and FLOPs go on from what its
``metrics.jsonl`` last counted up to the checkpoint's step (the run-based check of the axes
themselves: ``tests/e2e/test_launchers.py``)."""

from __future__ import annotations

import json

from subnetdp.train.report import consumed_before


def test_consumed_before_reads_the_last_counts_up_to_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert consumed_before(path, 10) == (0, 0.0, 0.0)  # a new run
    lines = [{"step": 4, "train/loss": 1.0, "train/tokens_seen": 400.0, "train/flops": 4e9},
             {"step": 6, "eval/loss": 2.0},
             {"step": 8, "train/loss": 0.9, "train/tokens_seen": 800.0, "train/flops": 8e9},
             {"step": 12, "train/loss": 0.8, "train/tokens_seen": 1200.0, "train/flops": 1.2e10}]
    path.write_text("\n".join(map(json.dumps, lines)) + "\n{\"step\": 13, \"train/tok")  # cut by a crash
    # Resumed from step 10's checkpoint: step 12's line was logged after it and does not count.
    assert consumed_before(path, 10) == (8, 800.0, 8e9)
    assert consumed_before(path, 12) == (12, 1200.0, 1.2e10)
    assert consumed_before(path, 0) == (0, 0.0, 0.0)
    images = tmp_path / "images.jsonl"
    images.write_text(json.dumps({"step": 3, "train/samples_seen": 96.0}) + "\n")
    assert consumed_before(images, 5) == (3, 96.0, 0.0)
