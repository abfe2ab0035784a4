"""With coverage 1, subnetdp is DDP: parameters match DistributedDataParallel step for step."""

from __future__ import annotations

import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.loop import train
from tests.helpers import ddp_reference_params, plugin_manager, run_ranks, small_config

STEPS = 5




def _worker(rank: int, world: int, init_method: str, optim: list[str]) -> dict:
    cfg = small_config("masker.coverage=1", f"train.steps={STEPS}", "train.batch_size=16",
                       f"comm.init_method={init_method}", "eval.batches=1", "run.name=ddp-eq", *optim,
                       run_dir=init_method.removeprefix("file://") + "-runs")
    run = train(cfg, LaunchEnv(rank, world, rank, world, "test"), plugin_manager())
    sdp = {run.state.pmap.pieces[n][0].global_name: p.detach().clone() for n, p in run.state.model.named_parameters()}
    return {"sdp": sdp, "ddp": ddp_reference_params(cfg, rank, world, init_method, STEPS), "bytes": run.result.summary["ranks"][rank]}


def _check(results: list[dict]) -> None:
    for r, res in enumerate(results):
        assert res["sdp"].keys() == res["ddp"].keys()
        for name, ref in res["ddp"].items():
            torch.testing.assert_close(res["sdp"][name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} {name}: {m}")
    # Every rank holds the identical model after each step (C = 1 is DDP).
    for name, ref in results[0]["sdp"].items():
        assert torch.equal(results[1]["sdp"][name], ref), name
    # The whole gradient crossed the wire once per step: payload = 4 bytes x parameters.
    nparams = sum(t.numel() for t in results[0]["sdp"].values())
    assert abs(results[0]["bytes"]["bytes_sent_per_step"] - 4 * nparams) < 64


def test_sgd_momentum_matches_ddp(tmp_path):
    _check(run_ranks(_worker, 2, tmp_path, ["optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.05"]))


def test_adamw_matches_ddp(tmp_path):
    _check(run_ranks(_worker, 2, tmp_path, ["optim.name=adamw", "optim.lr=0.001", "optim.weight_decay=0.01"]))
