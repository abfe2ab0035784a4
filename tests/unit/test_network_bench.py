"""The arithmetic of the network benchmark (``benchmarks/network.py``, ``benchmarks/shaped_link.py``):
rates, the token bucket, where a curve crosses DDP's loss, and a local-steps row's step time. A slip
here would silently change every figure of docs/network.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import network, shaped_link  # noqa: E402


def test_rates_are_tc_decimal_units():
    assert shaped_link.rate_bits("100mbit") == 1e8
    assert shaped_link.rate_bits("1gbit") == 1e9
    assert shaped_link.rate_bits("10gbit") == 1e10
    assert shaped_link.rate_bits("2500kbit") == 2.5e6
    with pytest.raises(shaped_link.LinkError, match="not a tc rate"):
        shaped_link.rate_bits("1GB/s")


def test_the_bucket_holds_a_millisecond_and_never_less_than_lo_packets():
    assert shaped_link.burst_bytes(1e8) == 256 * 1024  # 12.5 kB/ms: the floor, above lo's 64 KiB packets
    assert shaped_link.burst_bytes(1e10) == 1_250_000


def test_crossing_interpolates_between_evaluations():
    curve = [(10, {"loss": 3.0}), (20, {"loss": 2.0}), (30, {"loss": 1.0})]
    assert network.crossing(curve, 1.5) == pytest.approx(25.0)
    assert network.crossing(curve, 2.0) == pytest.approx(20.0)
    assert network.crossing(curve, 3.5) == 10.0  # already there at the first evaluation
    assert network.crossing(curve, 0.5) is None  # never reached within the run


def _run(row: str, intervals: list[float], steps: int) -> dict:
    rank = {"steps": [{"step": i + 1, "interval_s": t, "loss": 1.0, "collectives": {}, "tx_bytes": None}
                      for i, t in enumerate(intervals)], "evals": [], "wall_s": 1.0,
            "load_before": [0.0, 0, 0], "load_after": [0.0, 0, 0], "summary_rank": {}}
    return {"run": {"row": row, "kind": "sdp", "steps": steps, "world_size": 1}, "ranks": [rank]}


def test_an_every_step_row_is_the_median_of_steps_three_to_the_one_before_last():
    # step 1 and 2 (set-up, DDP's bucket rebuild) and the last (final evaluation) are left out
    run = _run("c1", [9.0, 9.0, 1.0, 3.0, 2.0, 9.0], steps=6)
    assert network.summarise(run)["step_time_s"] == 2.0


def test_a_local_steps_row_weighs_one_synchronising_step_per_cycle():
    # H = 16: steps 3..15 local (1 s), step 16 synchronises (17 s), step 17 is the last
    intervals = [5.0, 5.0, *([1.0] * 13), 17.0, 5.0]
    run = _run("h16", intervals, steps=17)
    assert network.summarise(run)["step_time_s"] == pytest.approx((15 * 1.0 + 17.0) / 16)


def test_extra_pairs_stay_out_of_the_sweep_and_are_grouped_by_bucket_rule(tmp_path):
    # The sweep's DDP and C = 1 ran at 2 s a step; a later pair (-p0) ran under more load at 8 and
    # 4 s: it must not move the sweep's cells or ratios, only the pairs table, filed under its rule.
    def write(name: str, row: str, seconds: float, rule: str | None = None) -> None:
        run = _run(row, [seconds] * 6, steps=6)
        run["run"].update(name=name, seed=0, kind="ddp" if row == "ddp" else "sdp")
        if rule:
            run["ranks"][0]["bucket_rule"] = rule
        (tmp_path / f"{name}.json").write_text(json.dumps(run))

    write("1gbit-ddp", "ddp", 2.0)
    write("1gbit-c1", "c1", 2.0)
    write("1gbit-ddp-p0", "ddp", 8.0)
    write("1gbit-c1-p0", "c1", 4.0, rule="reach")
    rep = network.task_report("resnet18", tmp_path)
    cell = rep["rows"]["ddp"]["links"]["1gbit"]
    assert cell["runs"] == ["1gbit-ddp"] and cell["step_time_s"] == 2.0
    assert rep["rows"]["c1"]["links"]["1gbit"]["ratio_to_ddp"] == 1.0
    pairs = rep["rows"]["c1"]["paired_ratio_to_ddp"]
    assert pairs["1gbit, buckets: cap"]["ratios"] == [1.0]  # stored before the field: capped buckets
    assert pairs["1gbit, buckets: reach"]["ratios"] == [0.5]


def test_interleaved_c1_against_ddp_pairs_each_step_with_its_own_ddp_step():
    from benchmarks import c1_vs_ddp

    # Two ranks, 8 steps; C = 1 is 4% slower than DDP in every pair while the machine's speed swings 2x
    # from step to step: the paired median sees 1.04, the untimed steps (1, 2 and 8) do not count.
    speed = [9.0, 9.0, 1.0, 2.0, 1.0, 2.0, 1.0, 9.0]
    rank = {"sdp": [1.04 * s for s in speed], "ddp": speed, "losses": {"sdp": [2.0], "ddp": [2.0]},
            "load": [[0.5, 0.4, 0.3], [0.7, 0.6, 0.5]]}
    slow = {**rank, "sdp": [1.04 * s + (0.5 if i == 0 else 0.0) for i, s in enumerate(speed)]}
    s = c1_vs_ddp.summarise({"run": {}, "ranks": [rank, slow]})
    assert s["steps"] == 5
    assert s["median"] == pytest.approx(1.04)
    assert s["ci95"][0] == pytest.approx(1.04) and s["ci95"][1] == pytest.approx(1.04)
    assert s["ddp_s"] == pytest.approx(1.0)  # median of 1, 2, 1, 2, 1
    assert s["load"] == (0.5, 0.7)
