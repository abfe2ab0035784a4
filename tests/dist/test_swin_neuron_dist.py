"""Swin at neuron level with 2 gloo ranks: after N-SDP and Nb-SDP steps at C = 0.5 the owners of every
piece (MLP hidden ranges and shared tensors) hold bit-identical values and optimizer state."""

from __future__ import annotations

import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.sdp.pieces import LocalIndex, full_tensors, global_items
from subnetdp.train.loop import train
from tests.helpers import plugin_manager, run_ranks, small_config

SWIN = ["model.name=swin", "model.variant=cifar", "model.patch_size=2", "model.window_size=2", "model.embed_dim=16",
        "model.depths=[2,2]", "model.num_heads=[2,4]", "model.stochastic_depth_prob=0.0", "data.name=digits",
        "data.image_size=8", "train.batch_size=8", "train.steps=3", "eval.batches=1", "optim.name=adamw",
        "optim.lr=0.002", "masker.granularity=neuron", "masker.units_per_layer=4", "masker.coverage=0.5"]


def _key(item) -> tuple:
    return (item.name, item.dim, item.start, item.stop)


def _run(rank: int, world: int, init_method: str, regime: str) -> dict:
    cfg = small_config(*SWIN, f"masker.regime={regime}", f"comm.init_method={init_method}-{regime}",
                       f"run.name=swin-n-{regime}", recipe=None, run_dir=init_method.removeprefix("file://") + "-runs")
    run = train(cfg, LaunchEnv(rank, world, rank, world, "test"), plugin_manager())
    items = list(global_items(run.state.partition, run.state.plan))
    index = LocalIndex(run.state.model, run.state.pmap)
    params, state = {}, {}
    for it in items:
        if rank not in it.owners:
            continue
        params[_key(it)] = index.view(it).detach().clone()
        local_name, _, start, stop = index.find(it)
        p = index.tensors[local_name]
        for k, v in run.state.optimizer.state[p].items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                state[_key(it) + (k,)] = (v if it.dim is None else v.narrow(it.dim, start, stop - start)).clone()
    full = {}
    if regime == "backward":
        names = run.state.partition.shared + [s.name for u in run.state.partition.units for s in u.slices]
        full = full_tensors(run.state.model, run.state.pmap, run.state.partition, names)
    return {"owners": {_key(it): it.owners for it in items}, "params": params, "state": state, "full": full,
            "owned": run.state.plan.owned[rank], "numel": sum(p.numel() for p in run.state.model.parameters()),
            "eval": run.result.eval_metrics}


def _worker(rank: int, world: int, init_method: str) -> dict:
    return {regime: _run(rank, world, init_method, regime) for regime in ("forward", "backward")}


def test_swin_neuron_owners_stay_identical(tmp_path):
    results = run_ranks(_worker, 2, tmp_path, timeout=240)
    for regime in ("forward", "backward"):
        r0, r1 = results[0][regime], results[1][regime]
        # C = 0.5 on 2 ranks with 4 ranges per block: each rank keeps 2 ranges of every block's MLP.
        assert len(r0["owned"]) == len(r1["owned"]) == 8
        shared = 0
        for key, owners in r0["owners"].items():
            if len(owners) == 2:
                shared += 1
                assert torch.equal(r0["params"][key], r1["params"][key]), (regime, key)
                for k in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(r0["state"][key + (k,)], r1["state"][key + (k,)]), (regime, key, k)
            for r, res in ((0, r0), (1, r1)):
                assert (key in res["params"]) == (r in owners), (regime, key, r)
        assert shared > 10, regime
        assert 0.0 <= r0["eval"]["accuracy"] <= 1.0
    # Forward masking: each rank's model is physically smaller than the backward-masked full one.
    assert results[0]["forward"]["numel"] < results[0]["backward"]["numel"]
    # Backward masking with refresh_every=1: every rank holds the identical full model.
    f0, f1 = results[0]["backward"]["full"], results[1]["backward"]["full"]
    assert f0.keys() == f1.keys() and len(f0) > 10
    for name in f0:
        assert torch.equal(f0[name], f1[name]), name
