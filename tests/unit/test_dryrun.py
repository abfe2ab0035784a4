"""The plan's dry run: models whose initialisers read values (Swin's ``trunc_normal_``) and clipping."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from subnetdp.plan.dryrun import fake_module
from subnetdp.plan.report import plan_report
from tests.helpers import plugin_manager, small_config


def test_swin_plan_dry_run_estimates_memory_and_block_sdp_at_half_coverage_holds_less():
    # torchvision's Swin initialises its bias tables with trunc_normal_, whose rejection loop reads
    # tensor values; gradient clipping reads the norm. Neither has a value under FakeTensorMode.
    reports = {}
    for coverage in (1.0, 0.5):
        cfg = small_config("model.name=swin", "model.variant=cifar", "model.embed_dim=24", "model.depths=[2,2]",
                           "model.num_heads=[2,4]", "data.image_size=16", "train.batch_size=4",
                           "optim.name=adamw", "optim.clip_grad_norm=5.0", f"masker.coverage={coverage}", recipe=None)
        reports[coverage] = plan_report(cfg, 2, plugin_manager())
    peak = {c: max(r["peak_memory_bytes"] for r in rep["ranks"]) for c, rep in reports.items()}
    held = {c: max(r["params_held"] for r in rep["ranks"]) for c, rep in reports.items()}
    assert peak[1.0] > 0 and peak[0.5] > 0
    assert peak[0.5] < peak[1.0]
    assert held[0.5] < held[1.0] == reports[1.0]["full_model_params"]
    # fp32 parameters, gradients and AdamW's two moments are live through the step, so the peak holds them.
    for c in peak:
        assert peak[c] >= 16 * held[c]
    # Every rank has its own estimate, and each sends its gradients.
    assert all(r["peak_memory_bytes"] > 0 and r["bytes_per_step"] > 0 for r in reports[0.5]["ranks"])


def test_fake_module_keeps_shapes_strides_flags_and_ties():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False), nn.BatchNorm1d(5))
    model[1].weight = model[0].weight  # tied, as LLaMA's embedding and head can be
    model[2].bias.requires_grad_(False)
    mode = FakeTensorMode()
    fake_module(model, mode)
    assert model[1].weight is model[0].weight and isinstance(model[0].weight, nn.Parameter)
    assert len(list(model.parameters())) == 3
    for t in list(model.parameters()) + list(model.buffers()):
        assert isinstance(t, FakeTensor) and t.device.type == "cpu"
    assert model[0].weight.shape == (5, 3) and model[0].weight.stride() == (3, 1)
    assert model[2].running_var.shape == (5,) and model[2].num_batches_tracked.dtype == torch.long
    assert not model[2].bias.requires_grad and model[2].weight.requires_grad
    with mode:
        out = model[1](model[0](torch.tensor([[0, 4]])))
    assert isinstance(out, FakeTensor) and out.shape == (1, 2, 5)


def test_the_dry_run_and_local_communicators_share_the_null_collectives():
    from subnetdp.core.contracts import LaunchEnv, NullCommunicator
    from subnetdp.plan.dryrun import DryRunCommunicator
    from subnetdp.plugins.comm.local import LocalCommunicator

    local, dry = LocalCommunicator(None, LaunchEnv()), DryRunCommunicator(1, 4)
    assert isinstance(local, NullCommunicator) and isinstance(dry, NullCommunicator)
    for comm, world in ((local, (0,)), (dry, (0, 1, 2, 3))):
        t = torch.arange(3.0)
        comm.all_reduce(t, (0, 1)[:len(world)]).wait()
        comm.broadcast(t, 0)
        assert torch.equal(t, torch.arange(3.0))  # nothing moves
        assert comm.all_gather_object("x") == ["x"] * len(world) and comm.device == torch.device("cpu")
    assert local.bytes.total() == 0 and local.bytes.calls == 0  # a local run sends nothing
    # The dry run counts what a real backend would have been handed: 12 bytes to (0, 1), 12 to the world.
    assert dry.bytes.by_group == {(0, 1): 12, (0, 1, 2, 3): 12} and (dry.rank, dry.world_size) == (1, 4)
