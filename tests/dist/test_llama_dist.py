"""LLaMA on token shards with 2 gloo ranks: owners stay bit-identical; coverage 1 is torch DDP."""

from __future__ import annotations

import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.loop import train
from subnetdp.plugins.data.tokens import TokensConfig, TokensData
from tests.helpers import ddp_reference_params, plugin_manager, run_ranks, small_config

STEPS = 4


def _config(init_method: str, cache: str, *overrides: str):
    return small_config(f"train.steps={STEPS}", "train.batch_size=4", "data.seq_len=32", "data.stdlib_max_mb=0.5",
                        f"data.cache_dir={cache}", "eval.batches=2", "optim.clip_grad_norm=0",
                        "optim.name=adamw", "optim.lr=1e-3", "optim.weight_decay=0.1", f"comm.init_method={init_method}",
                        *overrides, recipe="llama_tiny_stdlib", run_dir=init_method.removeprefix("file://") + "-runs")


def _state(run) -> dict:
    params = {n: p.detach().clone() for n, p in run.state.model.named_parameters()}
    state = {f"{n}/{k}": (v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v))
             for n, p in run.state.model.named_parameters() for k, v in run.state.optimizer.state[p].items()}
    return {"params": params, "state": state, "owned": run.state.plan.owned[run.context.rank],
            "owners": [run.state.plan.owners(u) for u in range(run.state.plan.num_units)],
            "unit_of": dict(run.state.pmap.unit_of), "eval": run.result.eval_metrics, "summary": run.result.summary}




def _worker(rank: int, world: int, init_method: str, cache: str) -> dict:
    env = LaunchEnv(rank, world, rank, world, "test")
    # Coverage 0.75 of 4 blocks: each rank holds 3, so blocks 0 and 2 have two owners, 1 and 3 one.
    sdp = _state(train(_config(init_method, cache, "masker.coverage=0.75", "run.name=sdp"), env, plugin_manager()))
    cfg = _config(init_method + "-c1", cache, "masker.coverage=1", "run.name=c1")
    full = _state(train(cfg, env, plugin_manager()))
    return {"sdp": sdp, "c1": full["params"], "ddp": ddp_reference_params(cfg, rank, world, init_method, STEPS)}


def test_llama_owners_bit_identical_and_coverage_1_matches_ddp(tmp_path):
    cache = tmp_path / "data"
    data = TokensData(TokensConfig(root="stdlib", cache_dir=str(cache), stdlib_max_mb=0.5), seed=0)
    data.check()  # build the corpus once, before the ranks start
    results = run_ranks(_worker, 2, tmp_path, str(cache), timeout=300)

    sdp = [r["sdp"] for r in results]
    owners = sdp[0]["owners"]
    assert owners == [(0, 1), (0,), (0, 1), (1,)], owners  # cyclic: rank 0 holds 0, 1, 2; rank 1 holds 2, 3, 0
    for name in set(sdp[0]["params"]) | set(sdp[1]["params"]):
        unit = sdp[0]["unit_of"].get(name, sdp[1]["unit_of"].get(name))
        holders = list(owners[unit]) if unit is not None else [0, 1]
        for r in range(2):  # exactly the owners hold a unit's tensors
            assert (name in sdp[r]["params"]) == (r in holders), (name, r)
        if len(holders) == 2:  # owners bit-identical: values and optimizer state
            assert torch.equal(sdp[0]["params"][name], sdp[1]["params"][name]), name
            for key, value in sdp[0]["state"].items():
                if key.startswith(name + "/"):
                    assert torch.equal(sdp[1]["state"][key], value), key
    assert sdp[0]["owned"] != sdp[1]["owned"] and len(sdp[0]["owned"]) == 3
    # The union model was evaluated: loss and perplexity of next-token prediction.
    ev = sdp[0]["eval"]
    assert 0 < ev["loss"] < 6 and abs(ev["perplexity"] - torch.tensor(ev["loss"]).exp().item()) < 1e-3 * ev["perplexity"]
    held = [r["summary"]["ranks"][i]["params_held"] for i, r in enumerate(sdp)]
    assert all(h < sdp[0]["summary"]["full_model_params"] for h in held)

    # Coverage 1 is DDP: every parameter matches torch's DistributedDataParallel.
    for r, res in enumerate(results):
        assert res["c1"].keys() == res["ddp"].keys()
        for name, ref in res["ddp"].items():
            torch.testing.assert_close(res["c1"][name], ref, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {r} {name}: {m}")
    for name, ref in results[0]["c1"].items():
        assert torch.equal(results[1]["c1"][name], ref), name


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
