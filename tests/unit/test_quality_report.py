"""The quality-along-training study (``benchmarks/quality_horizon.py``) renders its report from stored
run records alone: the paired gaps it prints must be the ones the records give, and the FLOP-matched
step counts must follow the measured ratios. The fixture is a real results folder of the study at
16 and 32 DDP steps (DDP and B-SDP FM, seeds 0 and 1; the records only, run directories dropped)."""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import quality_horizon, quality_report  # noqa: E402

FIXTURE = Path(__file__).parent / "data" / "quality"


def _records(horizon: int) -> dict[tuple[str, int], dict]:
    recs = [json.loads(p.read_text()) for p in (FIXTURE / "runs" / f"h{horizon}").glob("*.json")]
    return {(r["row"], r["seed"]): r for r in recs}


def _loss(rec: dict, k: int) -> float:
    return sorted(rec["curve"], key=lambda p: p["step"])[k]["loss"]


def _cells(text: str, title: str, row: str) -> list[str]:
    """The cells of ``row`` in the table that follows the heading containing ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("####") and title in line)
    for line in lines[start + 1:]:
        if line.startswith(f"| {row} |"):
            return [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("####"):
            break
    raise AssertionError(f"no row {row!r} under {title!r}")


def test_report_renders_the_paired_gaps_of_the_stored_runs(tmp_path):
    folder = tmp_path / "results"
    shutil.copytree(FIXTURE, folder)
    docs = tmp_path / "docs" / "quality.md"
    docs.parent.mkdir()
    docs.write_text("# Quality\n\nhand-written\n\n<!-- quality:begin -->\nstale\n<!-- quality:end -->\n\ntail\n")
    text = quality_report.write_report(folder, docs)

    recs = _records(16)
    gaps = {k: [_loss(recs[("B-SDP FM", s)], k) - _loss(recs[("DDP", s)], k) for s in (0, 1)] for k in range(8)}
    fmt = lambda xs: f"{statistics.fmean(xs):+.3f} ± {statistics.stdev(xs):.3f}"  # noqa: E731
    cells = _cells(text, "Horizon 16: gap to DDP along the run", "B-SDP FM")
    assert cells[1:9] == [fmt(gaps[k]) for k in range(8)]
    assert cells[9] == fmt([gaps[7][s] - gaps[3][s] for s in (0, 1)])  # 8/8 minus 4/8, paired by seed
    # Written out from the records (B-SDP FM 7.0449 and 7.0571 at its step 24, DDP 7.2677 and 7.3258 at
    # its step 16: gaps -0.2228 and -0.2687), so the test does not only mirror the code's arithmetic.
    assert cells[8] == "-0.246 ± 0.032", cells
    end = _cells(text, "Horizon 16 DDP steps: the end of every run", "B-SDP FM")
    assert end[2] == "24" and end[6] == fmt(gaps[7])  # 16 / 0.604 rounded to a multiple of 8
    assert end[4] == f"{24 * 4680843264.0 / (16 * 7751073792.0):.3f}"  # training FLOPs over DDP's

    long = _records(32)
    change = [(_loss(long[("B-SDP FM", s)], 7) - _loss(long[("DDP", s)], 7)) - gaps[7][s] for s in (0, 1)]
    assert _cells(text, "a 16- and a 32-step horizon", "B-SDP FM")[3] == fmt(change)

    x1 = [recs[("B-SDP FM", s)]["eval_union"]["union_x1"]["loss"] - recs[("B-SDP FM", s)]["eval_union"]
          ["union_rescaled"]["loss"] for s in (0, 1)]
    assert f"{statistics.fmean(x1):+.4f} ± {statistics.stdev(x1):.4f}" in text

    doc = docs.read_text()  # spliced between the markers, the hand-written parts kept
    assert "stale" not in doc and doc.startswith("# Quality\n\nhand-written") and doc.endswith("\ntail\n")
    assert text in doc
    for png in ("quality_h16.png", "quality_h32.png"):
        assert (docs.parent / png).stat().st_size > 10_000 and f"]({png})" in doc


def test_flop_matched_steps_and_the_long_row_follow_the_stored_figures():
    flops = json.loads((FIXTURE / "flops.json").read_text())
    steps = {r.name: quality_horizon.run_steps(r, 1024, flops) for r in quality_horizon.ROWS}
    # Training (forward + backward) FLOP ratios: B 0.604, N 0.786, Bb 0.903, C = 0.75 0.802.
    assert steps == {"DDP": 1024, "B-SDP": 1024, "B-SDP FM": 1696, "N-SDP": 1024, "N-SDP FM": 1304,
                     "Bb-SDP FM": 1136, "B-SDP C=0.75 FM": 1280, "B-SDP resample FM": 1696}
    assert all(s % quality_horizon.EVALS == 0 for s in steps.values())
    runs = quality_report.load(FIXTURE)
    assert quality_report.best_flop_matched(runs[16]) == "B-SDP FM"
    assert quality_report.best_flop_matched({"B-SDP FM": runs[16]["B-SDP FM"]}) is None  # no DDP, no gap
