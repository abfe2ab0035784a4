"""``resume=auto`` leaves a finished run alone, and only a finished one: the steps it compares are
the steps this config trains (``train.steps``, or the FLOP-matched count of the same request)."""

from __future__ import annotations

import json

from tests.helpers import small_config
from subnetdp.train.upfront import finished_run


def _summary(tmp_path, **fields):
    run = tmp_path / "r"
    run.mkdir(exist_ok=True)
    (run / "summary.json").write_text(json.dumps(fields))


def _cfg(tmp_path, *overrides):
    return small_config("resume=auto", "run.name=r", "checkpoint.enabled=true", *overrides, run_dir=tmp_path)


def test_plain_run_is_finished_at_train_steps(tmp_path):
    _summary(tmp_path, steps=8, eval={"accuracy": 0.5})
    assert "already finished its 8 steps" in finished_run(_cfg(tmp_path, "train.steps=8"))
    assert finished_run(_cfg(tmp_path, "train.steps=9")) is None


def test_flop_matched_run_compares_the_matched_count_of_the_same_request(tmp_path):
    # train.steps=8 matched to 11 steps (a plan with training-FLOP ratio below 1).
    _summary(tmp_path, steps=11, flop_matched={"steps_requested": 8, "steps": 11, "train_flop_ratio": 0.73})
    assert "already finished its 11 steps" in finished_run(_cfg(tmp_path, "train.steps=8", "train.flop_matched=true"))
    # Raised a little: 10 requested would match 14 steps; 11 done is not finished (it was called finished).
    assert finished_run(_cfg(tmp_path, "train.steps=10", "train.flop_matched=true")) is None
    # A ratio above 1: 12 requested matched to 9 steps, 9 done is finished (it was never called finished).
    _summary(tmp_path, steps=9, flop_matched={"steps_requested": 12, "steps": 9, "train_flop_ratio": 1.3})
    assert "already finished its 9 steps" in finished_run(_cfg(tmp_path, "train.steps=12", "train.flop_matched=true"))
    # A run that was not FLOP-matched, now asked to be: its matched count is unknown before set-up.
    _summary(tmp_path, steps=12)
    assert finished_run(_cfg(tmp_path, "train.steps=12", "train.flop_matched=true")) is None
