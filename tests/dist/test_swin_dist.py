"""Swin with 2 gloo ranks: C = 1 is torch DDP; at C = 0.75 the owners of every tensor stay bit-identical."""

from __future__ import annotations

import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.loop import train
from tests.helpers import ddp_reference_params, plugin_manager, run_ranks, small_config

STEPS = 4
# 8x8 digits, patch 2: 4x4 tokens and 2x2 windows in stage 1 (shifted windows at work), 2x2 tokens in
# stage 2; stochastic depth on, so training-mode randomness is compared too.
SWIN = ["model.name=swin", "model.variant=cifar", "model.patch_size=2", "model.window_size=2", "model.embed_dim=16",
        "model.depths=[2,4]", "model.num_heads=[2,4]", "model.stochastic_depth_prob=0.2", "data.name=digits",
        "data.image_size=8", "train.batch_size=8", f"train.steps={STEPS}", "eval.batches=1", "optim.name=adamw",
        "optim.lr=0.002", "optim.weight_decay=0.05"]


def _run(rank: int, world: int, init_method: str, coverage: float) -> tuple[dict, dict, dict]:
    cfg = small_config(*SWIN, f"masker.coverage={coverage}", f"comm.init_method={init_method}",
                       f"run.name=swin-c{coverage}", recipe=None, run_dir=init_method.removeprefix("file://") + "-runs")
    run = train(cfg, LaunchEnv(rank, world, rank, world, "test"), plugin_manager())
    params = {run.state.pmap.pieces[n][0].global_name: p.detach().clone() for n, p in run.state.model.named_parameters()}
    state = {f"{run.state.pmap.pieces[n][0].global_name}/{k}": v.clone()
             for n, p in run.state.model.named_parameters() for k, v in run.state.optimizer.state[p].items()}
    info = {"owned": run.state.plan.owned[rank], "owners": [run.state.plan.owners(u) for u in range(run.state.plan.num_units)],
            "unit_of": {run.state.pmap.pieces[n][0].global_name: u for n, u in run.state.pmap.unit_of.items()},
            "eval": run.result.eval_metrics, "cfg": cfg}
    return params, state, info




def _worker(rank: int, world: int, init_method: str) -> dict:
    full, _, info = _run(rank, world, init_method, 1.0)
    reference = ddp_reference_params(info["cfg"], rank, world, init_method, STEPS)
    params, state, sdp = _run(rank, world, init_method + "-sdp", 0.75)
    return {"full": full, "ddp": reference, "params": params, "state": state, "sdp": sdp}


def test_swin_matches_ddp_at_full_coverage_and_owners_stay_identical(tmp_path):
    results = run_ranks(_worker, 2, tmp_path, timeout=240)
    # C = 1 is DDP: the same parameters as torch DDP after every step, on both ranks.
    for r, res in enumerate(results):
        assert res["full"].keys() == res["ddp"].keys()
        for name, ref in res["ddp"].items():
            torch.testing.assert_close(res["full"][name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} {name}: {m}")
    for name, ref in results[0]["full"].items():
        assert torch.equal(results[1]["full"][name], ref), name

    # C = 0.75 on 2 ranks: stage 1 (2 blocks) is held whole by both, stage 2 keeps 3 of 4 blocks per rank.
    sdp = results[0]["sdp"]
    assert results[0]["sdp"]["owned"] == [0, 1, 2, 3, 4] and results[1]["sdp"]["owned"] == [0, 1, 2, 4, 5]
    unit_of = {**results[0]["sdp"]["unit_of"], **results[1]["sdp"]["unit_of"]}
    both = 0
    for name in set(results[0]["params"]) | set(results[1]["params"]):
        unit = unit_of[name]
        holders = sorted(r for r in range(2) if name in results[r]["params"])
        assert holders == (list(sdp["owners"][unit]) if unit is not None else [0, 1]), name
        if len(holders) == 2:
            both += 1
            assert torch.equal(results[0]["params"][name], results[1]["params"][name]), name
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(results[0]["state"][f"{name}/{key}"], results[1]["state"][f"{name}/{key}"]), name
    assert both > 10
    # Rank 0 assembled and evaluated the union model.
    assert 0.0 <= results[0]["sdp"]["eval"]["accuracy"] <= 1.0
