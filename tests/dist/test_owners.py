"""Coverage 0.5 on 4 ranks: owners of a unit stay bit-identical; averages are owners' means."""

from __future__ import annotations

import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.loop import train_loop
from subnetdp.train.setup import setup
from tests.helpers import assert_mean_of, digest, plugin_manager, run_ranks, sample, small_config


def _global(st, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {st.pmap.pieces[n][0].global_name: t for n, t in tensors.items()}


def _worker(rank: int, world: int, init_method: str, optim: str, lr: str) -> dict:
    cfg = small_config("masker.coverage=0.5", "train.steps=4", "train.batch_size=8", f"optim.name={optim}",
                       f"optim.lr={lr}",
                       f"comm.init_method={init_method}", "eval.batches=1", "run.name=owners",
                       run_dir=init_method.removeprefix("file://") + "-runs")
    pm = plugin_manager()
    ctx, st = setup(cfg, LaunchEnv(rank, world, rank, world, "test"), pm)
    try:
        # One step by hand with the run's synchroniser: local gradients first (no communication), then
        # the averaged ones.
        averager = st.synchronizer
        averager.prepare()
        x, y = next(iter(ctx.data.train_loader(rank, world, 8)))
        with averager.no_sync():
            ctx.adapter.loss(st.model(x), (x, y)).backward()
        # Small results: gradients as fixed coordinate samples, values and optimizer state as digests.
        local = {n: sample(p.grad, st.pmap.pieces[n][0].global_name) for n, p in st.model.named_parameters()}
        averager.finish()
        averaged = {n: sample(p.grad, st.pmap.pieces[n][0].global_name) for n, p in st.model.named_parameters()}
        # Then several real steps through the loop.
        train_loop(ctx, st)
        params = {n: digest(p) for n, p in st.model.named_parameters()}
        state = {}
        for n, p in st.model.named_parameters():
            for k, v in st.optimizer.state[p].items():
                state[f"{n}/{k}"] = digest(v if isinstance(v, torch.Tensor) else torch.tensor(v))
        return {"owned": st.plan.owned[rank], "owners": [st.plan.owners(u) for u in range(st.plan.num_units)],
                "unit_of": {st.pmap.pieces[n][0].global_name: u for n, u in st.pmap.unit_of.items()},
                "local": _global(st, local), "averaged": _global(st, averaged), "params": _global(st, params),
                "state": state}
    finally:
        ctx.comm.shutdown()


def test_owners_bit_identical_and_gradients_are_owner_means(tmp_path):
    results = run_ranks(_worker, 4, tmp_path, "adamw", "1e-3")
    owners = results[0]["owners"]
    unit_of = {}
    for r in results:
        unit_of.update(r["unit_of"])
    # Every residual block is held by exactly 2 of the 4 ranks (coverage 0.5).
    assert all(len(o) == 2 for o in owners)
    checked_units = set()
    for name, unit in unit_of.items():
        if name not in results[0]["params"] and all(name not in r["params"] for r in results):
            continue  # a buffer
        holders = list(owners[unit]) if unit is not None else list(range(4))
        if not any(name in results[r]["params"] for r in holders):
            continue
        first = holders[0]
        for r in holders[1:]:
            assert results[r]["params"][name] == results[first]["params"][name], (name, r)
            for key, value in results[first]["state"].items():
                if key.startswith(name + "/"):
                    assert results[r]["state"][key] == value, (key, r)
        # The averaged gradient is the mean of the owners' local gradients.
        for r in holders:
            assert_mean_of(results[r]["averaged"][name], [results[o]["local"][name] for o in holders], (name, r))
        # Ranks outside the owner set do not hold the unit at all.
        for r in set(range(4)) - set(holders):
            assert name not in results[r]["params"], (name, r)
        if unit is not None:
            checked_units.add(unit)
    assert checked_units == set(range(len(owners)))
    # Owners hold different units: the ranks' subnetworks really differ.
    assert results[0]["owned"] != results[2]["owned"]
