"""``sync.mode=local_steps`` on LLaMA tiny (standard-library bytes) with 2 real gloo ranks, in one spawn.

- H = 1, outer lr 1, momentum 0 trains to the per-step synchroniser's parameters (C = 1 and C = 0.5).
  The inner optimizer is SGD with momentum 0.9 and weight decay: with H = 1 every rank starts each
  step from the same parameters, and SGD's update (momentum, weight decay, Nesterov or not) is linear
  in the gradients, so the mean of the ranks' deltas is exactly the delta of the mean gradient and
  the two runs agree up to rounding (the ranks' momentum buffers differ, their mean is the per-step
  buffer). AdamW (``m / sqrt(v)``) or clipping (local norms vs the averaged gradient's norm) would
  not be comparable. The model is LLaMA (SiLU, RMSNorm, softmax: smooth), not a ReLU network: there a
  rounding-sized difference can flip a pre-activation across zero and change a gradient by far more
  than rounding (ResNet-18 on digits jumps from 1e-7 to 2e-5 within three steps).
- H = 4 (neuron level, C = 0.75: pieces held by one rank, by both, and shared ones; AdamW inner, grad
  accumulation, clipping, outer Nesterov): owners differ between synchronisations and are
  bit-identical right after each one; the outer update equals, bit for bit, the step
  ``torch.optim.SGD(nesterov=True)`` takes from the owners' averaged deltas, the anchor and the
  momentum each rank had before the synchronisation; bytes per step are one
  synchronisation's payload over 4 steps (summary and TensorBoard).
- Resuming that run from its checkpoint at step 6 (the middle of a cycle) ends bit-identical to it:
  parameters, buffers and outer state of both ranks, and the union model's evaluation.
- Backward masking (block level, H = 2): every rank holds the identical full model after the run.

Runs in about a minute on 2 cores.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from subnetdp.train.checkpoints import files as ck
from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.hookspecs import hookimpl
from subnetdp.sdp.pieces import LocalIndex, full_tensors, global_items
from subnetdp.train.loop import train_loop
from subnetdp.train.setup import setup
from subnetdp.plugins.data.tokens import TokensConfig, TokensData
from tests.helpers import plugin_manager, run_ranks, small_config

EQUAL = ["optim.name=sgd", "optim.momentum=0.9", "optim.weight_decay=5e-4", "optim.lr=0.1", "train.steps=4",
         "optim.clip_grad_norm=0"]
PLAIN = ["sync.mode=local_steps", "sync.every=1", "sync.outer_lr=1", "sync.outer_momentum=0"]
H4 = ["sync.mode=local_steps", "sync.every=4", "sync.outer_lr=0.7", "sync.outer_momentum=0.9",
      "masker.granularity=neuron", "masker.units_per_layer=4", "masker.coverage=0.75", "optim.name=adamw",
      "optim.lr=1e-3", "optim.clip_grad_norm=1.0", "train.grad_accum=2", "train.steps=8",
      "checkpoint.enabled=true", "checkpoint.every=6", "checkpoint.keep=0"]
BACKWARD = ["sync.mode=local_steps", "sync.every=2", "masker.regime=backward", "masker.coverage=0.5",
            "optim.name=adamw", "optim.lr=1e-3", "train.steps=4"]


def _key(item) -> tuple:
    return (item.name, item.dim, item.start, item.stop)


class _Recorder:
    """Wraps the run's synchroniser to record, per synchronisation, every owned piece's parameter,
    anchor and outer momentum before it and the parameter after it; and a hash of the shared tensors
    after every step."""

    def __init__(self) -> None:
        self.syncs: list[dict] = []
        self.step_hashes: list[str] = []

    @hookimpl
    def subnetdp_on_run_start(self, context, state) -> None:
        sync = state.synchronizer
        items = [it for it in global_items(state.partition, state.plan) if context.rank in it.owners]
        index = LocalIndex(state.model, state.pmap)

        def pieces(tensors: dict[str, torch.Tensor]) -> dict[tuple, torch.Tensor]:
            out = {}
            for it in items:
                local, dim, start, stop = index.find(it)
                if local in tensors:
                    t = tensors[local].detach()
                    out[_key(it)] = (t if dim is None else t.narrow(dim, start, stop - start)).cpu().clone()
            return out

        original = sync.synchronise

        def recorded(step: int, signum: int = 0) -> dict:
            before = {"step": step, "params": pieces(sync.params), "anchor": pieces(sync._anchor),
                      "momentum": pieces(sync._momentum)}
            stops = original(step, signum)
            self.syncs.append({**before, "after": pieces(sync.params), "owners": {_key(it): it.owners for it in items}})
            return stops

        sync.synchronise = recorded

    @hookimpl
    def subnetdp_on_step_end(self, state) -> None:
        h = hashlib.sha256()
        params = dict(state.model.named_parameters())
        for name in state.partition.shared:
            h.update(name.encode() + params[name].detach().numpy().tobytes())
        self.step_hashes.append(h.hexdigest())


def _config(init_method: str, cache: str, tag: str, overrides: list[str]):
    """LLaMA tiny on half a megabyte of the standard library, 4 x 32 tokens per rank, its own run and store."""
    return small_config("train.batch_size=4", "data.seq_len=32", "data.stdlib_max_mb=0.5", f"data.cache_dir={cache}",
                        *overrides, "eval.every=0", "eval.batches=2", "eval.batch_size=8",
                        f"comm.init_method={init_method}-{tag}", f"run.name={tag}", recipe="llama_tiny_stdlib",
                        run_dir=init_method.removeprefix("file://") + "-runs")


def _run(rank: int, world: int, init_method: str, cache: str, tag: str, overrides: list[str],
         record: bool = False) -> dict:
    cfg = _config(init_method, cache, tag, overrides)
    pm = plugin_manager()
    recorder = _Recorder()
    ctx, st = setup(cfg, LaunchEnv(rank, world, rank, world, "test"), pm)
    try:
        if record:
            pm.pm.register(recorder)
        try:
            result = train_loop(ctx, st)
        finally:
            if record:
                pm.pm.unregister(recorder)
        params = {n: p.detach().clone() for n, p in st.model.named_parameters()}
        out = {"params": params, "summary": result.summary["ranks"][rank], "eval": result.summary["eval"],
               "run_dir": str(ctx.run_dir), "syncs": recorder.syncs, "hashes": recorder.step_hashes}
        if "masker.regime=backward" in overrides:
            names = [s.name for u in st.partition.units for s in u.slices] + st.partition.shared
            out["full"] = full_tensors(st.model, st.pmap, st.partition, names)
        out["buckets_payload"] = st.synchronizer.buckets.bytes_per_step() if record else None
        return out
    finally:
        ctx.comm.shutdown()


def _worker(rank: int, world: int, init_method: str, cache: str) -> dict:
    out = {}
    for c in ("1", "0.5"):
        out[f"step/{c}"] = _run(rank, world, init_method, cache, f"step{c}", EQUAL + [f"masker.coverage={c}"])
        out[f"plain/{c}"] = _run(rank, world, init_method, cache, f"plain{c}", EQUAL + PLAIN + [f"masker.coverage={c}"])
    out["h4"] = h4 = _run(rank, world, init_method, cache, "h4", H4, record=True)
    resume_from = str(ck.step_dir(Path(h4["run_dir"]), 6))
    out["resumed"] = _run(rank, world, init_method, cache, "resumed", H4 + [f"resume={resume_from}"])
    out["backward"] = _run(rank, world, init_method, cache, "backward", BACKWARD)
    return out


def _torch_nesterov_step(anchor: torch.Tensor, g: torch.Tensor, momentum: torch.Tensor, step: int, lr: float,
                         mu: float) -> torch.Tensor:
    """The outer step as ``torch.optim.SGD(nesterov=True)`` takes it: the anchor, the averaged pseudo-gradient."""
    p = torch.nn.Parameter(anchor.clone())
    p.grad = g.clone()
    opt = torch.optim.SGD([p], lr=lr, momentum=mu, nesterov=True, foreach=False)
    if step:  # from the second synchronisation on, the momentum buffer the ranks held before it
        opt.state[p]["momentum_buffer"] = momentum.clone()
    else:  # torch starts the buffer at the first gradient; the ranks' buffer starts at zero
        assert not momentum.any()
    opt.step()
    return p.detach()


def _check_outer_update(results: list[dict]) -> None:
    lr, mu = 0.7, 0.9
    syncs = [r["syncs"] for r in results]
    assert [s["step"] for s in syncs[0]] == [4, 8] and [s["step"] for s in syncs[1]] == [4, 8]
    for i in range(2):
        owners = {**syncs[0][i]["owners"], **syncs[1][i]["owners"]}
        assert {len(o) for o in owners.values()} == {1, 2}, "pieces with one owner and with two"
        for key, holders in owners.items():
            mine = [syncs[r][i] for r in holders]
            # Owners agree on the anchor and the momentum, and (between synchronisations) not on the params.
            for s in mine[1:]:
                assert torch.equal(s["anchor"][key], mine[0]["anchor"][key]), key
            deltas = [s["anchor"][key] - s["params"][key] for s in mine]  # each owner's minus delta
            g = (deltas[0] + deltas[1]) / 2 if len(deltas) == 2 else deltas[0]
            expected = _torch_nesterov_step(mine[0]["anchor"][key], g, mine[0]["momentum"][key], i, lr, mu)
            for s in mine:
                # Bit-identical owners after the synchronisation, at the independently computed update.
                assert torch.equal(s["after"][key], expected), key
        # Before it, the two owners of a piece had drifted apart.
        assert any(not torch.equal(syncs[0][i]["params"][k], syncs[1][i]["params"][k])
                   for k, o in owners.items() if len(o) == 2)
    # Between synchronisations the ranks' shared tensors differ; right after one they agree.
    h0, h1 = results[0]["hashes"], results[1]["hashes"]
    assert [a == b for a, b in zip(h0, h1)] == [False, False, False, True, False, False, False, True]


def test_local_steps_match_per_step_sync_update_owners_and_resume(tmp_path):
    cache = tmp_path / "data"
    data = TokensData(TokensConfig(root="stdlib", cache_dir=str(cache), stdlib_max_mb=0.5), seed=0)
    data.check()  # build the corpus once, before the ranks start
    results = run_ranks(_worker, 2, tmp_path, str(cache), timeout=600)
    # H = 1, plain averaging: the per-step synchroniser's parameters and bytes.
    for c in ("1", "0.5"):
        for r in results:
            step, plain = r[f"step/{c}"], r[f"plain/{c}"]
            assert step["params"].keys() == plain["params"].keys()
            for name, value in step["params"].items():
                torch.testing.assert_close(plain["params"][name], value, rtol=1e-5, atol=1e-6)
            assert plain["summary"]["sync_mode"] == "local_steps" and step["summary"]["sync_mode"] == "every_step"
            assert plain["summary"]["bytes_sent_per_step"] == step["summary"]["bytes_sent_per_step"] > 0
    # H = 4: owners and the outer update.
    _check_outer_update([r["h4"] for r in results])
    for r in results:
        summary = r["h4"]["summary"]
        # Two synchronisations in 8 steps, each one the buckets' payload: a quarter of it per step.
        assert summary["syncs"] == 2
        assert summary["bytes_sent_per_step"] == summary["bytes_per_step_cycle"] == r["h4"]["buckets_payload"] / 4
        assert summary["outer_state_bytes"] == 2 * 4 * sum(p.numel() for p in r["h4"]["params"].values())
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        tb = EventAccumulator(str(Path(r["h4"]["run_dir"]) / "tensorboard" / f"rank_{summary['rank']}"),
                              size_guidance={"scalars": 0})
        tb.Reload()
        assert [e.value for e in tb.Scalars("rank/bytes_sent_per_step_cycle")] == [summary["bytes_per_step_cycle"]]
    # Resumed in the middle of a cycle: bit-identical to the uninterrupted run.
    h4, resumed = (ck.step_dir(Path(results[0][k]["run_dir"]), 8) for k in ("h4", "resumed"))
    names = sorted(f.name for f in h4.glob("*.safetensors"))
    assert names == sorted(f.name for f in resumed.glob("*.safetensors"))
    outer = False
    for name in names:  # the pieces (values, optimizer and outer state) and each rank's buffers
        a, b = load_file(str(h4 / name)), load_file(str(resumed / name))
        assert a.keys() == b.keys()
        outer |= any(k.startswith("outer_momentum/") for k in a)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert outer
    assert results[0]["resumed"]["eval"] == results[0]["h4"]["eval"] and results[0]["h4"]["eval"]
    # Backward masking: the refresh after each synchronisation leaves one full model on every rank.
    full0, full1 = results[0]["backward"]["full"], results[1]["backward"]["full"]
    assert full0.keys() == full1.keys() and len(full0) > 20
    for name, t in full0.items():
        assert torch.equal(full1[name], t), name


# ---------------------------------------------------------------------------- sync.warmup_steps
WARM = ["masker.granularity=neuron", "masker.units_per_layer=4", "masker.coverage=0.75", "optim.name=adamw",
        "optim.lr=1e-3", "optim.clip_grad_norm=1.0", "train.grad_accum=2", "train.steps=8", "checkpoint.enabled=true",
        "checkpoint.every=3", "checkpoint.keep=0"]
WARM_LOCAL = ["sync.mode=local_steps", "sync.every=2", "sync.warmup_steps=4", "sync.outer_lr=0.7",
              "sync.outer_momentum=0.9"]


class _Pieces:
    """Every owned piece's value after every step, keyed by piece, with the owners of each."""

    def __init__(self) -> None:
        self.steps: list[dict[tuple, torch.Tensor]] = []
        self.owners: dict[tuple, tuple[int, ...]] = {}

    @hookimpl
    def subnetdp_on_step_end(self, state) -> None:
        rank = state.context.rank
        params = dict(state.model.named_parameters())
        index = LocalIndex(state.model, state.pmap)
        out = {}
        for it in global_items(state.partition, state.plan):
            if rank in it.owners:
                local, dim, start, stop = index.find(it)
                t = params[local].detach()
                out[_key(it)] = (t if dim is None else t.narrow(dim, start, stop - start)).clone()
                self.owners[_key(it)] = it.owners
        self.steps.append(out)


def _warm_run(rank: int, world: int, init_method: str, cache: str, tag: str, overrides: list[str]) -> dict:
    cfg = _config(init_method, cache, tag, overrides)
    pm = plugin_manager()
    pieces = _Pieces()
    ctx, st = setup(cfg, LaunchEnv(rank, world, rank, world, "test"), pm)
    try:
        pm.pm.register(pieces)
        try:
            result = train_loop(ctx, st)
        finally:
            pm.pm.unregister(pieces)
        return {"steps": pieces.steps, "owners": pieces.owners, "summary": result.summary["ranks"][rank],
                "run_dir": str(ctx.run_dir)}
    finally:
        ctx.comm.shutdown()


def _warm_worker(rank: int, world: int, init_method: str, cache: str) -> dict:
    out = {"every": _warm_run(rank, world, init_method, cache, "every", WARM),
           "warm": _warm_run(rank, world, init_method, cache, "warm", WARM + WARM_LOCAL)}
    start = str(ck.step_dir(Path(out["warm"]["run_dir"]), 3))
    out["resumed"] = _warm_run(rank, world, init_method, cache, "resumed", WARM + WARM_LOCAL + [f"resume={start}"])
    after = str(ck.step_dir(Path(out["warm"]["run_dir"]), 6))
    out["after"] = _warm_run(rank, world, init_method, cache, "after", WARM + WARM_LOCAL + [f"resume={after}"])
    return out


def test_warmup_steps_synchronise_every_step_then_local_steps_resume_across_the_boundary(tmp_path):
    """``sync.warmup_steps=4``, H = 2, 8 steps, 2 ranks, neuron C = 0.75 (pieces with one and two owners),
    AdamW with clipping, 2 micro-batches a step: steps 1-4 are the per-step synchroniser's, bit for bit,
    with owners identical after each; then owners drift apart between synchronisations (steps 5, 7) and agree at them (6, 8).
    The checkpoint of step 3 holds no outer state, step 6's does; resuming from step 3 (crossing the
    boundary) or from step 6 (after it, outer state and all) ends bit-identical to the uninterrupted run."""
    cache = tmp_path / "data"
    TokensData(TokensConfig(root="stdlib", cache_dir=str(cache), stdlib_max_mb=0.5), seed=0).check()
    results = run_ranks(_warm_worker, 2, tmp_path, str(cache), timeout=600)
    owners = {**results[0]["warm"]["owners"], **results[1]["warm"]["owners"]}
    shared = [k for k, o in owners.items() if len(o) == 2]
    assert shared and any(len(o) == 1 for o in owners.values())
    for r in results:
        every, warm = r["every"]["steps"], r["warm"]["steps"]
        assert len(every) == len(warm) == 8
        for step in range(4):  # the warm-up: the per-step synchroniser's values
            assert every[step].keys() == warm[step].keys()
            for key, value in every[step].items():
                assert torch.equal(warm[step][key], value), (step + 1, key)
        assert any(not torch.equal(warm[4][k], every[4][k]) for k in warm[4])  # step 5 is a local step
        summary = r["warm"]["summary"]
        assert summary["sync_warmup_steps"] == 4 and summary["syncs"] == 2 and summary["sync_mode"] == "local_steps"
    agree = [all(torch.equal(results[0]["warm"]["steps"][s][k], results[1]["warm"]["steps"][s][k]) for k in shared)
             for s in range(8)]
    assert agree == [True, True, True, True, False, True, False, True]
    run = Path(results[0]["warm"]["run_dir"])

    def outer_keys(step: int) -> set[str]:
        return {k for f in ck.step_dir(run, step).glob("*.safetensors") for k in load_file(str(f))
                if k.startswith("outer_")}

    assert not outer_keys(3) and any(k.startswith("outer_anchor/") for k in outer_keys(6))
    done = ck.step_dir(run, 8)
    names = sorted(f.name for f in done.glob("*.safetensors"))
    for resumed in (ck.step_dir(Path(results[0][k]["run_dir"]), 8) for k in ("resumed", "after")):
        assert names and names == sorted(f.name for f in resumed.glob("*.safetensors"))
        for name in names:
            a, b = load_file(str(done / name)), load_file(str(resumed / name))
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), (resumed, k)
    for s in range(3, 8):  # the resumed run's steps 4-8, piece by piece
        for r in results:
            for key, value in r["warm"]["steps"][s].items():
                assert torch.equal(r["resumed"]["steps"][s - 3][key], value), (s + 1, key)
