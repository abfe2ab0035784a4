"""FLOP ratios of a plan, counted on ``meta``, against the same count on the real CPU models."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from subnetdp.plan.report import plan_report
from subnetdp.sdp.construct import build_model
from subnetdp.sdp.flops import plan_flops
from subnetdp.sdp.variants import local_model
from subnetdp.train.setup import build_plan
from tests.helpers import plugin_manager, small_config


def _real_step_flops(adapter, model, batch) -> int:
    """Forward + backward FLOPs on the CPU. Attention runs its math kernel (matmuls, which the counter
    counts, as on ``meta``): the CPU's fused attention kernel has no FLOP formula in the counter."""
    model.train()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as f:
        adapter.loss(model(adapter.inputs(batch)), batch).backward()
    return f.get_total_flops()


@pytest.mark.parametrize("overrides", [
    ["masker.coverage=0.5"],
    ["masker.coverage=0.5", "masker.granularity=neuron"],
    ["masker.coverage=0.5", "masker.regime=backward"],
])
def test_meta_count_equals_the_real_models_count_and_sets_the_matched_steps(overrides):
    cfg = small_config("train.batch_size=2", "data.seq_len=32", "train.steps=40", *overrides, recipe="llama_tiny_stdlib")
    pm = plugin_manager()
    data, spec, adapter, full, partition, plan = build_plan(cfg, 4, pm)
    batch = next(iter(data.train_loader(0, 4, 2)))
    ratios = plan_flops(adapter, full, partition, plan, cfg.masker, batch)
    # The anchor: real models on the CPU, a real batch, every rank counted (no shape cache).
    torch.manual_seed(0)
    real_full = build_model(adapter, spec)
    full_count = _real_step_flops(adapter, copy.deepcopy(real_full), batch)
    real = []
    for owned in plan.owned:
        model, _ = local_model(adapter, copy.deepcopy(real_full), owned, partition, cfg.masker)
        real.append(_real_step_flops(adapter, model, batch) / full_count)
    assert ratios.full_train_step == full_count
    assert list(ratios.per_rank_train_step) == real
    assert ratios.train_step == sum(real) / len(real) < 1
    report = plan_report(cfg, 4, pm, only_rank=0)  # one dry run: the FLOP count covers every rank
    assert report["flops"]["train_step"] == ratios.train_step
    assert report["flops"]["flop_matched_steps"] == round(40 / ratios.train_step) > 40


def test_a_rank_that_owns_every_unit_counts_as_the_full_model():
    # C = 1 (neuron level: the narrowing, with its rescaling, that is most apt to differ): the count made
    # for the full model serves every rank, and it is the real full-width local model's count.
    cfg = small_config("train.batch_size=2", "data.seq_len=32", "masker.coverage=1", "masker.granularity=neuron",
                       recipe="llama_tiny_stdlib")
    data, spec, adapter, full, partition, plan = build_plan(cfg, 2, plugin_manager())
    batch = next(iter(data.train_loader(0, 2, 2)))
    ratios = plan_flops(adapter, full, partition, plan, cfg.masker, batch)
    assert ratios.per_rank_train_step == (1.0, 1.0) and ratios.train_step == ratios.forward == 1.0
    torch.manual_seed(0)
    real_full = build_model(adapter, spec)
    model, _ = local_model(adapter, copy.deepcopy(real_full), plan.owned[0], partition, cfg.masker)
    assert _real_step_flops(adapter, model, batch) == _real_step_flops(adapter, real_full, batch) == ratios.full_train_step
