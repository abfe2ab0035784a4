"""LLaMA on token shards with 2 gloo ranks: N-SDP owners hold bit-identical pieces.

Block-level ownership and coverage 1 against torch DDP are tested for every adapter in test_adapters.py.
"""

from __future__ import annotations

import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.loop import train
from subnetdp.plugins.data.tokens import TokensConfig, TokensData
from tests.helpers import plugin_manager, run_ranks, small_config

STEPS = 4


def _config(init_method: str, cache: str, *overrides: str):
    return small_config(f"train.steps={STEPS}", "train.batch_size=4", "data.seq_len=32", "data.stdlib_max_mb=0.5",
                        f"data.cache_dir={cache}", "eval.batches=2", "optim.clip_grad_norm=0",
                        "optim.name=adamw", "optim.lr=1e-3", "optim.weight_decay=0.1", f"comm.init_method={init_method}",
                        *overrides, recipe="llama_tiny_stdlib", run_dir=init_method.removeprefix("file://") + "-runs")


def _neuron_worker(rank: int, world: int, init_method: str, cache: str) -> dict:
    """N-SDP at C = 0.5 (4 hidden ranges per layer): every piece's owners and their values."""
    from subnetdp.sdp.pieces import LocalIndex, global_items

    env = LaunchEnv(rank, world, rank, world, "test")
    run = train(_config(init_method + "-n", cache, "masker.granularity=neuron", "masker.coverage=0.5",
                        "masker.units_per_layer=4", "run.name=nsdp"), env, plugin_manager())
    index = LocalIndex(run.state.model, run.state.pmap)
    items = [it for it in global_items(run.state.partition, run.state.plan) if rank in it.owners]
    return {"owners": {(it.name, it.dim, it.start, it.stop): it.owners for it in items},
            "params": {(it.name, it.dim, it.start, it.stop): index.view(it).detach().clone() for it in items},
            "held": sum(p.numel() for p in run.state.model.parameters()), "full": run.result.summary["full_model_params"],
            "loss": run.result.eval_metrics.get("loss")}  # rank 0 evaluates


def test_llama_neuron_level_owners_hold_bit_identical_pieces(tmp_path):
    cache = tmp_path / "data"
    TokensData(TokensConfig(root="stdlib", cache_dir=str(cache), stdlib_max_mb=0.5), seed=0).check()
    results = run_ranks(_neuron_worker, 2, tmp_path, str(cache), timeout=300)
    shared_pieces = 0
    for key, holders in results[0]["owners"].items():
        if len(holders) == 2:
            assert results[1]["owners"][key] == holders
            assert torch.equal(results[0]["params"][key], results[1]["params"][key]), key
            shared_pieces += 1
    sliced = [k for k in set(results[0]["owners"]) | set(results[1]["owners"]) if k[1] is not None]
    assert sliced and all("feed_forward" in k[0] for k in sliced)
    assert shared_pieces >= len([k for k in results[0]["owners"] if k[1] is None])  # attention, norms, embeddings
    for r in range(2):  # a piece with one owner is held by that rank only
        for key, holders in results[r]["owners"].items():
            if len(holders) == 1:
                assert holders == (r,) and key not in results[1 - r]["params"], key
    assert all(r["held"] < r["full"] for r in results)  # each rank holds narrower MLPs
    assert 0 < results[0]["loss"] < 6  # the union model was evaluated
