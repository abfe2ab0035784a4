"""Every registered model adapter on 2 gloo ranks: coverage 1 is torch DDP, and below it the owners of
every tensor stay bit-identical (values and optimizer state), exactly the owners hold a unit's tensors,
and rank 0 evaluates the union model.

One test per adapter, parametrised over the plugin registry (as timm's test_models.py runs over
``list_models()``): a new adapter is tested by registering it and adding its tiny variant to ``TINY``;
a registered adapter without one fails ``test_every_registered_adapter_has_a_tiny_variant``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.plugins.data.tokens import TokensConfig, TokensData
from subnetdp.train.loop import train
from tests.helpers import ddp_reference_params, plugin_manager, run_ranks, small_config

ADAMW = ("optim.name=adamw", "optim.lr=0.002", "optim.weight_decay=0.05")
SGD = ("optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.05")


@dataclass(frozen=True)
class Tiny:
    """A model small enough for two ranks on two cores, and what its plan at ``coverage`` must be."""

    recipe: str | None
    overrides: tuple[str, ...]
    steps: int
    coverage: float  # below 1: some units with two owners, some with one
    owners: list[tuple[int, ...]] | None  # each unit's owners at that coverage (None: not pinned)
    optimizers: tuple[tuple[str, ...], ...] = (ADAMW,)  # each one compared with DDP at coverage 1
    tokens: bool = False  # needs the token corpus built before the ranks start
    dense_bytes: bool = False  # check that C = 1 sends 4 bytes per parameter and step


# 8x8 digits, patch 2: 4x4 tokens and 2x2 windows in stage 1 (shifted windows at work), 2x2 tokens in
# stage 2; stochastic depth on, so training-mode randomness is compared too.
SWIN = ("model.name=swin", "model.variant=cifar", "model.patch_size=2", "model.window_size=2", "model.embed_dim=16",
        "model.depths=[2,4]", "model.num_heads=[2,4]", "model.stochastic_depth_prob=0.2", "data.name=digits",
        "data.image_size=8", "train.batch_size=8", "eval.batches=1")
LLAMA = ("train.batch_size=4", "data.seq_len=32", "data.stdlib_max_mb=0.5", "eval.batches=2", "optim.clip_grad_norm=0")

TINY: dict[str, Tiny] = {
    # ResNet-18: SGD with momentum and AdamW both match DDP; C = 0.5 gives each rank half the blocks.
    "resnet": Tiny("resnet18_digits", ("train.batch_size=16", "eval.batches=1"), 5, 0.5, None,
                   optimizers=(SGD, ("optim.name=adamw", "optim.lr=0.001", "optim.weight_decay=0.01")), dense_bytes=True),
    # C = 0.75: stage 1 (2 blocks) is held whole by both, stage 2 keeps 3 of 4 blocks per rank.
    "swin": Tiny(None, SWIN, 4, 0.75, [(0, 1), (0, 1), (0, 1), (0,), (0, 1), (1,)]),
    # C = 0.75 of 4 blocks (cyclic): rank 0 holds 0, 1, 2; rank 1 holds 2, 3, 0.
    "llama": Tiny("llama_tiny_stdlib", LLAMA, 4, 0.75, [(0, 1), (0,), (0, 1), (1,)],
                  optimizers=(("optim.name=adamw", "optim.lr=1e-3", "optim.weight_decay=0.1"),), tokens=True),
}


def _config(tiny: Tiny, init_method: str, cache: str, *overrides: str):
    data = [f"data.cache_dir={cache}"] if tiny.tokens else []
    return small_config(*tiny.overrides, f"train.steps={tiny.steps}", *data, f"comm.init_method={init_method}",
                        *overrides, recipe=tiny.recipe, run_dir=init_method.removeprefix("file://") + "-runs")


def _held(run) -> tuple[dict, dict]:
    names = {n: run.state.pmap.pieces[n][0].global_name for n, _ in run.state.model.named_parameters()}
    params = {names[n]: p.detach().clone() for n, p in run.state.model.named_parameters()}
    state = {f"{names[n]}/{k}": (v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v))
             for n, p in run.state.model.named_parameters() for k, v in run.state.optimizer.state[p].items()}
    return params, state


def _worker(rank: int, world: int, init_method: str, name: str, cache: str) -> dict:
    tiny, env, pm = TINY[name], LaunchEnv(rank, world, rank, world, "test"), plugin_manager()
    out: dict = {"c1": []}
    for i, optim in enumerate(tiny.optimizers):
        cfg = _config(tiny, f"{init_method}-c1-{i}", cache, "masker.coverage=1", f"run.name=c1-{i}", *optim)
        run = train(cfg, env, pm)
        out["c1"].append({"params": _held(run)[0], "bytes": run.result.summary["ranks"][rank]["bytes_sent_per_step"],
                          "ddp": ddp_reference_params(cfg, rank, world, f"{init_method}-c1-{i}", tiny.steps)})
    run = train(_config(tiny, f"{init_method}-sdp", cache, f"masker.coverage={tiny.coverage}", "run.name=sdp",
                        *tiny.optimizers[-1]), env, pm)
    params, state = _held(run)
    plan = run.state.plan
    out["sdp"] = {"params": params, "state": state, "owned": list(plan.owned[rank]),
                  "owners": [tuple(plan.owners(u)) for u in range(plan.num_units)],
                  "unit_of": {run.state.pmap.pieces[n][0].global_name: u for n, u in run.state.pmap.unit_of.items()},
                  "eval": run.result.eval_metrics, "held": run.result.summary["ranks"][rank]["params_held"],
                  "full": run.result.summary["full_model_params"]}
    return out


def test_every_registered_adapter_has_a_tiny_variant():
    registered = set(plugin_manager().registries["model"].names())
    assert registered - set(TINY) == set(), (f"model adapters {sorted(registered - set(TINY))} have no tiny variant in "
                                             "tests/dist/test_adapters.py's TINY: add one so that they are tested")
    assert set(TINY) <= registered, sorted(set(TINY) - registered)


@pytest.mark.parametrize("name", sorted(TINY))
def test_adapter_matches_ddp_at_full_coverage_and_owners_stay_identical(name: str, tmp_path: Path):
    tiny = TINY[name]
    cache = tmp_path / "data"
    if tiny.tokens:  # build the corpus once, before the ranks start
        TokensData(TokensConfig(root="stdlib", cache_dir=str(cache), stdlib_max_mb=0.5), seed=0).check()
    results = run_ranks(_worker, 2, tmp_path, name, str(cache), timeout=420)

    # C = 1 is DDP: the same parameters as torch DDP after the last step, on both ranks, for each optimizer.
    for i in range(len(tiny.optimizers)):
        runs = [res["c1"][i] for res in results]
        for r, res in enumerate(runs):
            assert res["params"].keys() == res["ddp"].keys()
            for key, ref in res["ddp"].items():
                torch.testing.assert_close(res["params"][key], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {r} {key}: {m}")
        for key, ref in runs[0]["params"].items():  # every rank holds the identical model
            assert torch.equal(runs[1]["params"][key], ref), key
        if tiny.dense_bytes:  # the whole gradient crossed the wire once per step: 4 bytes x parameters
            nparams = sum(t.numel() for t in runs[0]["params"].values())
            assert abs(runs[0]["bytes"] - 4 * nparams) < 64

    # Below coverage 1: exactly the owners hold a unit's tensors, and co-owners are bit-identical.
    sdp = [res["sdp"] for res in results]
    owners = sdp[0]["owners"]
    assert sdp[1]["owners"] == owners
    if tiny.owners is not None:
        assert owners == tiny.owners, owners
    for r in range(2):  # each rank's units are those it owns
        assert sorted(sdp[r]["owned"]) == [u for u, held_by in enumerate(owners) if r in held_by], (r, owners)
    assert sorted(sdp[0]["owned"]) != sorted(sdp[1]["owned"])
    unit_of = {**sdp[0]["unit_of"], **sdp[1]["unit_of"]}
    both = 0
    for key in set(sdp[0]["params"]) | set(sdp[1]["params"]):
        unit = unit_of.get(key)
        holders = list(owners[unit]) if unit is not None else [0, 1]
        for r in range(2):
            assert (key in sdp[r]["params"]) == (r in holders), (key, r)
        if len(holders) == 2:
            both += 1
            assert torch.equal(sdp[0]["params"][key], sdp[1]["params"][key]), key
            for skey, value in sdp[0]["state"].items():
                if skey.startswith(key + "/"):
                    assert torch.equal(sdp[1]["state"][skey], value), skey
    assert both > 5
    assert all(s["held"] < s["full"] for s in sdp)  # each rank holds less than the whole model
    # Rank 0 assembled and evaluated the union model.
    ev = sdp[0]["eval"]
    if "accuracy" in ev:
        assert 0.0 <= ev["accuracy"] <= 1.0
    else:  # next-token prediction: loss and perplexity
        assert 0 < ev["loss"] < 6 and abs(ev["perplexity"] - torch.tensor(ev["loss"]).exp().item()) < 1e-3 * ev["perplexity"]
