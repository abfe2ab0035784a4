"""The dispatch-level tracker measures tensor memory exactly."""

from __future__ import annotations

import torch

from subnetdp.parallel.memory import TensorMemoryTracker, live_state_bytes


def test_tracker_counts_storages_once_and_frees():
    with TensorMemoryTracker(baseline=100) as t:
        a = torch.ones(1000)  # 4000 bytes
        b = a.view(10, 100)  # a view: no new storage
        assert t.current == 4100
        c = a * 2  # 4000 more
        assert t.peak == 8100
        del c
        assert t.current == 4100
        del a, b
        assert t.current == 100
    assert t.peak == 8100


def test_tracker_sees_backward_and_live_state():
    model = torch.nn.Linear(256, 256)
    state = live_state_bytes(list(model.parameters()) + [model.weight])  # counted once
    assert state == (256 * 256 + 256) * 4
    x = torch.randn(64, 256)
    with TensorMemoryTracker(state) as t:
        model(x).sum().backward()
    # Gradients (same size as parameters) were allocated inside the block and are still alive.
    assert t.current - state >= (256 * 256 + 256) * 4
    assert t.peak >= t.current


def test_in_place_ops_and_views_of_existing_tensors_allocate_nothing():
    w = torch.zeros(1_000_000)  # 4 MB, alive before the block: part of the baseline
    with TensorMemoryTracker(baseline=live_state_bytes([w])) as t:
        w.add_(1.0)
        w.mul_(2.0).zero_()
        v = w.view(1000, 1000).t()
        torch.add(w, 1.0, out=w)
        assert t.current == 4_000_000 and t.peak == 4_000_000
        x = w + 1  # a fresh tensor does count
        assert t.peak == 8_000_000
        del x, v
