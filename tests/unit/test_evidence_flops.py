"""The evidence study's FLOP matching (``benchmarks/evidence.py``) counts what each row's ranks run:
the full model is built on ``meta``, so the count must work there, and a regression would silently
skew every FLOP-matched step count of the study."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import evidence  # noqa: E402
from benchmarks.evidence_tasks import TASKS  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path):
    before, evidence._CACHE[0] = evidence._CACHE[0], str(tmp_path / "data")
    yield
    evidence._CACHE[0] = before


def test_flop_ratios_follow_what_each_variant_runs():
    ratios = evidence.flop_ratios(TASKS["resnet18"], ["DDP", "DDP+SD", "B-SDP", "N-SDP", "Bb-SDP"])
    assert ratios["DDP"]["forward"] == ratios["DDP"]["train_step"] == 1.0
    assert ratios["DDP+SD"]["forward"] == 1.0  # stochastic depth computes every branch
    # Forward masking at C = 0.5 runs half of every stage's blocks (block) or half the inner
    # channels (neuron); the stem, shortcuts and classifier keep the ratio a little above 0.5.
    for row in ("B-SDP", "N-SDP"):
        assert 0.5 < ratios[row]["forward"] < 0.55, (row, ratios[row])
        assert ratios[row]["forward_flops"] < ratios["DDP"]["forward_flops"]
    # Backward masking runs the full forward but no weight gradients of the blocks it does not own.
    assert ratios["Bb-SDP"]["forward"] == 1.0 and ratios["Bb-SDP"]["train_step"] < 0.9
