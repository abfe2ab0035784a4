"""Bytes by owner group across a re-formed world: a death renumbers the survivors, so the meter names
groups by worker ids and hands each world's bytes and steps to the next (docs/communication.md)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from subnetdp.core.contracts.communicator import ByteCounter
from subnetdp.train.meter import Meter, bytes_by_group


class _Comm:  # what the meter reads of a communicator: the counter, the world and who is who
    def __init__(self, counter: ByteCounter, origin: tuple[int, ...]) -> None:
        self.bytes, self.origin, self.world_size, self.device = counter, origin, len(origin), torch.device("cpu")


class _Unsharded:  # RankParallelism without FSDP: nothing to count, no tracker on unmeasured steps
    sharded, fsdp_bytes, fsdp_wire = False, 0, 0.0

    def counting(self, active: bool):
        return contextlib.nullcontext()


def _steps(meter: Meter, counter: ByteCounter, groups: dict[tuple[int, ...], int], steps: range) -> None:
    for step in steps:
        with meter.step(step, lambda: []):
            for g, n in groups.items():
                counter.add(g, n)


def test_bytes_by_group_name_workers_across_a_death_and_count_each_world_s_steps():
    counter = ByteCounter()
    four = Meter(_Comm(counter, (0, 1, 2, 3)), _Unsharded(), 1, 100, 100)
    _steps(four, counter, {(0, 1): 10, (2, 3): 20, (0, 1, 2, 3): 40}, range(1, 3))
    with pytest.raises(RuntimeError):  # worker 1 dies inside step 3: its bytes belong to no finished step
        with four.step(3, lambda: []):
            counter.add((0, 1, 2, 3), 1000)
            raise RuntimeError("peer lost")
    # The survivors are workers 0, 2, 3, now ranks 0, 1, 2: rank tuple (0, 1) is workers 0 and 2.
    three = Meter(_Comm(counter, (0, 2, 3)), _Unsharded(), 3, 100, 100)
    three.take_over(four.worker_group_bytes(finished=True))
    _steps(three, counter, {(0, 1): 7, (0, 1, 2): 30}, range(3, 6))
    payload, steps = three.worker_group_bytes()
    assert payload == {(0, 1): 20, (2, 3): 40, (0, 1, 2, 3): 80, (0, 2): 21, (0, 2, 3): 90}
    assert steps == {(0, 1): 2, (2, 3): 2, (0, 1, 2, 3): 2, (0, 2): 3, (0, 2, 3): 3}
    summary = bytes_by_group(payload, steps)
    assert summary["0-1"] == {"k": 2, "payload_bytes_per_step": 10.0, "wire_bytes_per_step_ring": 10.0, "steps": 2}
    assert summary["0-2"]["payload_bytes_per_step"] == 7.0 and summary["0-2-3"]["steps"] == 3
    # TensorBoard: this world's groups only, by worker ids, per step of this world
    tags = {k: v for k, v in three.rank_scalars(5).items() if k.startswith("rank/bytes_by_group/")}
    assert tags == {"rank/bytes_by_group/0-2": 7.0, "rank/bytes_by_group/0-2-3": 30.0}
    assert three.bytes_per_step(3)[0] == 37.0  # this world's payload per step


class _Tracked(_Unsharded):  # a real tracker on the measured step, and a record of the steps it ran on
    def __init__(self) -> None:
        self.tracked: list[int] = []
        self.step = 0

    def memory_tracker(self, baseline: int):
        from subnetdp.parallel.memory import TensorMemoryTracker

        self.tracked.append(self.step)
        return TensorMemoryTracker(baseline)


def _measure(meter: Meter, parallel: _Tracked, steps: range) -> None:
    for step in steps:
        parallel.step = step
        with meter.step(step, lambda: []):
            torch.ones(1000).sum()  # 4,000 bytes held at once


def test_a_re_formed_world_measures_at_its_own_memory_step_and_not_again_what_a_rank_held_before():
    counter, parallel = ByteCounter(), _Tracked()
    w4 = ("plan-4", (0, 1))
    first = Meter(_Comm(counter, (0, 1, 2, 3)), parallel, 1, 100, 2, w4)
    _measure(first, parallel, range(1, 6))
    assert parallel.tracked == [2] and first.peak_memory() >= 4000 and first.measured == {w4: first.peak_memory()}
    # A death at step 5: at W-1 this rank holds more; the new world's first step warms up, its second is measured.
    w3 = ("plan-3", (0, 1, 2))
    after_death = Meter(_Comm(counter, (0, 2, 3)), parallel, 6, 100, 2, w3, first.measured, continued=True)
    _measure(after_death, parallel, range(6, 12))
    assert parallel.tracked == [2, 7] and set(after_death.measured) == {w4, w3}
    # A join at step 11 returns to the W-rank plan: what this rank held at the start, measured then.
    after_join = Meter(_Comm(counter, (0, 1, 2, 3)), parallel, 12, 100, 2, w4, after_death.measured, continued=True)
    _measure(after_join, parallel, range(12, 20))
    assert parallel.tracked == [2, 7] and after_join.peak_memory() == first.peak_memory()
    assert after_join.measured_step is None and len(after_join.step_times) == 8  # every step timed
    # A newcomer has measured nothing: its world's second step.
    newcomer = Meter(_Comm(counter, (0, 4, 2, 3)), parallel, 12, 100, 2, w4, None, continued=True)
    _measure(newcomer, parallel, range(12, 15))
    assert parallel.tracked == [2, 7, 13]
