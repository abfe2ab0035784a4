"""The four SDP variants (B, N, Bb, Nb) on ResNet-18 with 2 and 4 real gloo ranks.

One spawn per world size runs every variant, so each spawn's start-up is paid once. For every
variant: owners of every piece hold bit-identical values and optimizer state after several steps;
the averaged gradient of each piece is the mean of its owners' local gradients. Backward masking
(refresh_every=1) also leaves every rank with the identical full model after every step. With 4
ranks, grouped and dense synchronisation average to the same gradients.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json

import torch

from subnetdp import cli
from subnetdp.sdp.backward import apply_backward_masking
from subnetdp.sdp.construct import initial_model
from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.hookspecs import hookimpl
from subnetdp.sdp.pieces import LocalIndex, full_tensors, global_items
from subnetdp.train.loop import train_loop
from subnetdp.train.setup import setup
from subnetdp.sdp.resample import family
from subnetdp.sdp.sync import OwnerGroupAverager
from tests.helpers import assert_mean_of, digest, plugin_manager, run_ranks, sample, small_config

VARIANTS = {"B": ("block", "forward"), "N": ("neuron", "forward"),
            "Bb": ("block", "backward"), "Nb": ("neuron", "backward")}
STEPS = 3


def _key(item) -> tuple:
    return (item.name, item.dim, item.start, item.stop)


def _full_params(st) -> dict[str, torch.Tensor]:
    """The rank's full-model parameters (shared buffers are per-rank statistics, as in DDP)."""
    names = st.partition.shared + [s.name for u in st.partition.units for s in u.slices]
    return full_tensors(st.model, st.pmap, st.partition, names)


class _FullModelDigest:
    """Records, after every step, a hash of the rank's full model (backward masking holds it all)."""

    def __init__(self) -> None:
        self.digests: list[str] = []
        self.plans: list[str] = []

    @hookimpl
    def subnetdp_on_step_end(self, state) -> None:
        h = hashlib.sha256()
        for name, t in sorted(_full_params(state).items()):
            h.update(name.encode())
            h.update(t.numpy().tobytes())
        self.digests.append(h.hexdigest())
        self.plans.append(state.plan.digest())


def _overrides(variant: str, coverage: float, extra: list[str]) -> list[str]:
    granularity, regime = VARIANTS[variant]
    return [f"masker.granularity={granularity}", f"masker.regime={regime}", f"masker.coverage={coverage}",
            "masker.units_per_layer=4", f"train.steps={STEPS}", "train.batch_size=8",
            "optim.name=adamw", "optim.lr=1e-3", "eval.batches=1", "eval.batch_size=32", *extra]


def _one_variant(rank: int, world: int, init_method: str, variant: str, coverage: float, extra: list[str]) -> dict:
    regime = VARIANTS[variant][1]
    tag = f"{variant}-{'-'.join(extra) or 'default'}".replace("=", "").replace(".", "")
    cfg = small_config(*_overrides(variant, coverage, extra),
                       f"comm.init_method={init_method}-{tag}", f"run.name={tag}",
                       run_dir=init_method.removeprefix("file://") + "-runs")
    if extra == RESAMPLE:
        # lr 0 isolates re-drawing from learning (every held piece must stay the initial one's).
        # A user is refused it, a run that cannot learn, so it is set on the composed config.
        cfg.optim.lr = 0.0
    pm = plugin_manager()
    recorder = _FullModelDigest()
    ctx, st = setup(cfg, LaunchEnv(rank, world, rank, world, "test"), pm)
    plan0 = st.plan
    try:
        items = [it for it in global_items(st.partition, st.plan) if rank in it.owners]
        index = LocalIndex(st.model, st.pmap)
        # One step by hand with the run's synchroniser: local gradients first (no communication), then
        # the averaged ones.
        averager = st.synchronizer
        averager.prepare()
        x, y = next(iter(ctx.data.train_loader(rank, world, 8)))
        with averager.no_sync():
            ctx.adapter.loss(st.model(x), (x, y)).backward()
        # Gradients go back as digests (bit-identity) and fixed coordinate samples (the mean checks).
        local = {_key(it): index.view(it, grad=True) for it in items}
        local_digest = {k: digest(g) for k, g in local.items()}
        local = {k: sample(g, k) for k, g in local.items()}
        averager.finish()
        averaged = {_key(it): index.view(it, grad=True) for it in items}
        averaged_digest = {k: digest(g) for k, g in averaged.items()}
        averaged = {k: sample(g, k) for k, g in averaged.items()}
        # Then several real steps through the loop.
        pm.pm.register(recorder)
        try:
            result = train_loop(ctx, st)
        finally:
            pm.pm.unregister(recorder)
        owners0 = {_key(it): it.owners for it in global_items(st.partition, plan0)}
        # The plan (and model) may have been re-drawn: read the final ones.
        items = [it for it in global_items(st.partition, st.plan) if rank in it.owners]
        index = LocalIndex(st.model, st.pmap)
        params = {_key(it): digest(index.view(it)) for it in items}
        state = {}
        for it in items:
            local_name = index.find(it)[0]
            p = index.tensors[local_name]
            for k, v in st.optimizer.state[p].items():
                if isinstance(v, torch.Tensor) and v.shape == p.shape:
                    sl = v if it.dim is None else v.narrow(it.dim, *(lambda f: (f[2], f[3] - f[2]))(index.find(it)))
                    state[_key(it) + (k,)] = digest(sl)
        owners = {_key(it): it.owners for it in global_items(st.partition, st.plan)}
        full = {n: digest(t) for n, t in _full_params(st).items()} if regime == "backward" else {}
        return {"owners": owners, "owners0": owners0, "plans": recorder.plans, "local": local, "averaged": averaged,
                "local_digest": local_digest, "averaged_digest": averaged_digest, "params": params, "state": state,
                "full": full, "digests": recorder.digests, "summary": result.summary["ranks"][rank],
                "num_units": st.plan.num_units, "owned": st.plan.owned[rank]}
    finally:
        ctx.comm.shutdown()


def _family_gradients(rank: int, world: int, init_method: str, variant: str) -> dict:
    """Backward masking: this rank's full local gradient, and the averaged gradient under every plan
    of the rotation family, all on the same batch and the same initial weights."""
    granularity = VARIANTS[variant][0]
    cfg = small_config(f"masker.granularity={granularity}", "masker.regime=backward", "masker.coverage=0.5",
                       "masker.units_per_layer=4", f"comm.init_method={init_method}-fam{variant}",
                       f"run.name=fam{variant}", run_dir=init_method.removeprefix("file://") + "-runs")
    ctx, st = setup(cfg, LaunchEnv(rank, world, rank, world, "test"), plugin_manager())
    try:
        x, y = next(iter(ctx.data.train_loader(rank, world, 8)))

        def fresh():
            torch.manual_seed(int(cfg.seed))
            return ctx.adapter.build(ctx.spec)

        full = fresh()
        ctx.adapter.loss(full(x), (x, y)).backward()
        grads = {n: p.grad for n, p in full.named_parameters()}
        local = {_key(it): sample(grads[it.name] if it.dim is None else grads[it.name].narrow(it.dim, it.start, it.stop - it.start), _key(it))
                 for it in global_items(st.partition, st.plan)}
        del full, grads
        per_plan = []
        for plan in family(st.plan, st.partition):
            model, pmap = apply_backward_masking(fresh(), st.partition, plan.owned[rank])
            averager = OwnerGroupAverager(model, pmap, plan, st.partition, ctx.comm)
            averager.prepare()
            ctx.adapter.loss(model(x), (x, y)).backward()
            averager.finish()
            averager.remove_hooks()
            index = LocalIndex(model, pmap)
            per_plan.append({_key(it): (it.owners, sample(index.view(it, grad=True), _key(it)))
                             for it in global_items(st.partition, plan) if rank in it.owners})
        return {"local": local, "per_plan": per_plan}
    finally:
        ctx.comm.shutdown()


def _worker(rank: int, world: int, init_method: str, cases: list[tuple[str, float, list[str]]],
            unbiased: tuple[str, ...] = ()) -> dict:
    out = {f"{v}/{c}/{' '.join(e)}": _one_variant(rank, world, init_method, v, c, e) for v, c, e in cases}
    for variant in unbiased:
        out[f"family/{variant}"] = _family_gradients(rank, world, init_method, variant)
    return out


def _check_unbiased(results: list[dict], world: int) -> None:
    """Averaged over every plan of the family, the aggregated gradient is the full-batch gradient.

    Each plan's piece is a mean over its k <= world owners, and the family mean adds ``members`` more
    terms, so a coordinate passes through at most ``world + members + 2`` roundings, each of at most
    u times the mean absolute local gradient (every rank is an owner equally often in the family).
    """
    members = len(results[0]["per_plan"])
    assert members > 1
    total: dict[tuple, torch.Tensor] = {}
    for d in range(members):
        seen = {}
        for r in range(world):
            for key, (owners, g) in results[r]["per_plan"][d].items():
                if r == owners[0]:  # the aggregated gradient of a piece, as its first owner holds it
                    seen[key] = g
        for key, g in seen.items():
            total[key] = total.get(key, 0) + g / members
    assert set(total) == set(results[0]["local"])
    for key, g in total.items():
        assert_mean_of(g, [r["local"][key] for r in results], key, roundings=world + members + 2)


def _check_variant(results: list[dict], world: int, backward: bool, refresh_every: int = 1) -> None:
    owners = results[0]["owners"]
    assert all(r["owners"] == owners for r in results)
    assert any(len(o) < world for o in owners.values()), "some piece must be held by fewer than all ranks"
    for key, holders in owners.items():
        first = holders[0]
        for r in holders:
            assert key in results[r]["params"], (key, r)
            # Owners hold bit-identical values and optimizer state.
            assert results[r]["params"][key] == results[first]["params"][key], (key, r)
            for skey, value in results[first]["state"].items():
                if skey[:4] == key:
                    assert results[r]["state"][skey] == value, (skey, r)
        for r in set(range(world)) - set(holders):
            assert key not in results[r]["params"], (key, r)  # nobody else trains it
    for key, holders in results[0]["owners0"].items():
        # The averaged gradient of a piece is the mean of its owners' local gradients (first step).
        for r in holders:
            assert_mean_of(results[r]["averaged"][key], [results[o]["local"][key] for o in holders], (key, r))
    if backward and refresh_every > 1:
        # Non-owned copies go stale between refreshes and agree again right after one.
        for step in range(1, STEPS + 1):
            same = all(r["digests"][step - 1] == results[0]["digests"][step - 1] for r in results)
            assert same == (step % refresh_every == 0), step
    elif backward:
        # refresh_every=1: every rank holds the identical full model after every step.
        for r in results[1:]:
            assert r["digests"] == results[0]["digests"] and len(r["digests"]) == STEPS
            assert r["full"].keys() == results[0]["full"].keys() and len(r["full"]) > 60
            for name, d in results[0]["full"].items():
                assert r["full"][name] == d, name
    else:
        # Forward masking: a rank holds fewer parameters than the full model.
        assert all(r["summary"]["params_held"] < results[0]["summary"]["params_held"] * 2 for r in results)


def _check_resampled(results: list[dict], variant: str) -> None:
    """With lr 0 nothing learns, so after re-draws every held piece must equal the initial model's."""
    assert len(set(results[0]["plans"])) > 1, "the plan was re-drawn"
    granularity = VARIANTS[variant][0]
    cfg = small_config(f"masker.granularity={granularity}", "masker.units_per_layer=4")
    pm = plugin_manager()
    data = pm.get("data", cfg.data.name)(cfg.data, seed=int(cfg.seed))
    adapter = pm.get("model", cfg.model.name)(cfg.model)
    initial = dict(initial_model(adapter, data.spec(), int(cfg.seed)).named_parameters())
    for res in results:
        assert res["params"]
        for (name, dim, start, stop), value in res["params"].items():
            ref = initial[name] if dim is None else initial[name].narrow(dim, start, stop - start)
            assert value == digest(ref), name


RESAMPLE = ["masker.resample_every=1"]  # with optim.lr 0, set in _one_variant
REFRESH2 = ["masker.refresh_every=2"]
CASES_2 = [(v, 0.5, []) for v in VARIANTS] + [("N", 0.5, RESAMPLE), ("Bb", 0.5, RESAMPLE), ("Nb", 0.5, REFRESH2)]


def test_every_variant_on_two_ranks_and_plan_estimates(tmp_path):
    results = run_ranks(_worker, 2, tmp_path, CASES_2, timeout=300)
    for v, c, e in CASES_2:
        key = f"{v}/{c}/{' '.join(e)}"
        _check_variant([r[key] for r in results], 2, VARIANTS[v][1] == "backward", 2 if e == REFRESH2 else 1)
        if e == RESAMPLE:
            _check_resampled([r[key] for r in results], v)
    # Refreshing every second step halves the broadcast bytes per step.
    for r in results:
        every1, every2 = r["Nb/0.5/"]["summary"], r[f"Nb/0.5/{REFRESH2[0]}"]["summary"]
        assert every2["bytes_sent_per_step"] < 0.8 * every1["bytes_sent_per_step"]
    _check_plan_estimates(results, 2, ["N", "Bb"])


def _check_plan_estimates(results: list[dict], world: int, variants: list[str]) -> None:
    """`subnetdp plan` (a dry run under FakeTensorMode) predicts the peak the real step measured."""
    for v in variants:
        base = ["train.progress=false", "launch.threads_per_rank=1", "eval.bn_recalibrate_batches=0",
                "train.log_every=1000", "optim.warmup_steps=0"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["plan", "resnet18_digits", *base, *_overrides(v, 0.5, []), "-n", str(world), "--json"]) == 0
        report = json.loads(out.getvalue())
        for r in range(world):
            measured = results[r][f"{v}/0.5/"]["summary"]
            estimated = report["ranks"][r]
            assert estimated["params_held"] == measured["params_held"]
            assert abs(estimated["peak_memory_bytes"] / measured["peak_memory_bytes"] - 1) < 0.05, (v, r, estimated, measured)
            assert abs(estimated["bytes_per_step"] / measured["bytes_sent_per_step"] - 1) < 0.01, (v, r)


DENSE = ["sync.max_groups=1"]
CASES_4 = [(v, 0.5, []) for v in VARIANTS] + [("N", 0.5, DENSE)]


def test_every_variant_on_four_ranks_dense_sync_and_unbiasedness(tmp_path):
    results = run_ranks(_worker, 4, tmp_path, CASES_4, ("Bb", "Nb"), timeout=420)
    for v, c, e in CASES_4:
        key = f"{v}/{c}/{' '.join(e)}"
        _check_variant([r[key] for r in results], 4, VARIANTS[v][1] == "backward")
    # Grouped and dense synchronisation average the same gradients. Compared on the first step, where
    # both start from the same weights and batch: the local gradients are bit-identical (the same
    # arithmetic), and each mode's average is the owners' mean up to the order of one fp32 sum
    # (_check_variant bounds both by what that order can explain). Parameters after several steps are
    # not compared: AdamW normalises each coordinate's update, so where a gradient is near zero one
    # rounding of difference becomes a whole step, and which coordinates those are depends on the CPU.
    grouped, dense = "N/0.5/", f"N/0.5/{' '.join(DENSE)}"
    for rank, r in enumerate(results):
        assert r[grouped]["local"].keys() == r[dense]["local"].keys() == r[dense]["averaged"].keys()
        for k, d in r[grouped]["local_digest"].items():
            assert r[dense]["local_digest"][k] == d, (rank, k)
        for k, d in r[grouped]["averaged_digest"].items():
            holders = r[grouped]["owners0"][k]
            if len(holders) == 1:  # nothing to sum: both modes hand back the rank's own gradient
                assert r[dense]["averaged_digest"][k] == d, (rank, k)
        assert r[dense]["summary"]["sync"] == "dense" and r[grouped]["summary"]["sync"] == "grouped"
        # Dense mode sends the whole model's gradient over the world; grouped only owned pieces.
        assert r[dense]["summary"]["bytes_sent_per_step"] > r[grouped]["summary"]["bytes_sent_per_step"]
    _check_plan_estimates(results, 4, ["N", "Bb"])
    for variant in ("Bb", "Nb"):
        _check_unbiased([r[f"family/{variant}"] for r in results], 4)
