"""``subnetdp.parallelize`` in a plain user loop: DDP at coverage 1, owner-exact below it, bad input refused."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import subnetdp
from subnetdp.core.errors import ConfigError
from tests.helpers import run_ranks

D, L = 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))  # pre-norm: the residual is inside the block


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, D)
        self.layers = nn.ModuleList(Block() for _ in range(L))
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _meta() -> Net:
    with torch.device("meta"):
        return Net()


def _batches(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(6, 4, generator=g) for _ in range(2)]


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int, clip) -> None:
    first, last = _batches(rank, step)
    # Gradient accumulation: the first micro-batch stays local under no_sync on even steps; on odd
    # steps both backward passes average and the second adds to the first's averages (as DDP does).
    with model.no_sync() if step % 2 == 0 else contextlib.nullcontext():
        (model(first).pow(2).mean() / 2).backward()
    (model(last).pow(2).mean() / 2).backward()
    clip()
    opt.step()
    opt.zero_grad()


def _against_ddp(rank: int, make_opt) -> list[float]:
    """Largest parameter difference to DDP after each of 3 steps (accumulation and clipping at 0.5)."""
    sdp = subnetdp.parallelize(_meta(), units="layers.*", coverage=1.0, seed=3, skip="identity")
    ref = Net()
    ref.load_state_dict(sdp.state_dict_full())
    ddp = DistributedDataParallel(ref)
    opt_s, opt_d = make_opt(sdp.parameters()), make_opt(ddp.parameters())
    diffs = []
    for step in range(3):
        _step(sdp, opt_s, rank, step, lambda: sdp.clip_grad_norm_(0.5))
        _step(ddp, opt_d, rank, step, lambda: nn.utils.clip_grad_norm_(ddp.parameters(), 0.5))
        ours = dict(sdp.module.named_parameters())
        diffs.append(max((ours[n] - p).abs().max().item() for n, p in ref.named_parameters()))
    return diffs


def _worker(rank: int, world: int, init_method: str) -> dict:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    out: dict = {"sgd": _against_ddp(rank, lambda ps: torch.optim.SGD(ps, lr=0.5)),
                 "adamw": _against_ddp(rank, lambda ps: torch.optim.AdamW(ps, lr=0.05))}
    # Below coverage 1: 3 of 4 layers each (cyclic: rank 0 holds 0-2, rank 1 holds 2, 3, 0).
    sdp = subnetdp.parallelize(_meta(), units="layers.*", coverage=0.75, seed=3, skip="identity")
    opt = torch.optim.AdamW(sdp.parameters(), lr=0.05)
    out["copies"], out["grads"], out["norms"] = [], [], []

    def clip() -> None:  # the averaged gradients as they stand before clipping, and the norm clipped by
        out["grads"].append({sdp.pmap.pieces[n][0].global_name: p.grad.clone() for n, p in sdp.module.named_parameters()})
        out["norms"].append(float(sdp.clip_grad_norm_(0.5)))

    for step in range(3):
        _step(sdp, opt, rank, step, clip)
        out["copies"].append({sdp.pmap.pieces[n][0].global_name: p.detach().clone()
                              for n, p in sdp.module.named_parameters()})
    out["units"], out["held"], out["bytes"] = sdp.units_held, sdp.params_held, sdp.bytes_per_step
    out["layers"] = [type(m).__name__ for m in sdp.module.layers]
    out["union"] = sdp.state_dict_full()
    out["shares"] = {k: sorted(v) for k, v in sdp.unit_state_dict().items()}
    # DCP: saved after 3 steps, loaded into a fresh wrapper and optimizer, one more step on each.
    ck = os.path.join(os.path.dirname(init_method.removeprefix("file://")), "dcp")
    sdp.save(ck, opt)
    again = subnetdp.parallelize(_meta(), units="layers.*", coverage=0.75, seed=4, skip="identity")
    opt2 = torch.optim.AdamW(again.parameters(), lr=0.05)
    again.load(ck, opt2)
    out["loaded"] = all(torch.equal(a, b) for a, b in zip(sdp.parameters(), again.parameters()))
    _step(sdp, opt, rank, 3, lambda: sdp.clip_grad_norm_(0.5))
    _step(again, opt2, rank, 3, lambda: again.clip_grad_norm_(0.5))
    out["resumed"] = all(torch.equal(a, b) for a, b in zip(sdp.parameters(), again.parameters()))
    meta = dcp.FileSystemReader(ck).read_metadata()
    out["written"] = sorted(i.fqn for i in meta.storage_data if i.fqn.startswith("model."))
    errors = []
    for kwargs in ({"units": "blocks.*"}, {"units": ["layers.*", "layers.1.fc"]}, {"units": "layers.*"}):
        model = Net() if kwargs == {"units": "layers.*"} else _meta()  # the last one: not on meta
        try:
            subnetdp.parallelize(model, skip="identity", **kwargs)
        except ConfigError as e:
            errors.append(str(e))
    with torch.device("meta"):
        seq = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    try:
        subnetdp.parallelize(seq, units="1")  # no skip rule for a plain Sequential
    except ConfigError as e:
        errors.append(str(e))
    out["errors"] = errors
    dist.destroy_process_group()
    return out


def test_parallelize_in_a_user_loop(tmp_path):
    r0, r1 = run_ranks(_worker, 2, tmp_path)
    for res in (r0, r1):
        # Coverage 1 is DDP step for step (float64 vs float32 clipping norms: not bit-exact).
        assert max(res["sgd"]) < 1e-6 and max(res["adamw"]) < 1e-6, (res["sgd"], res["adamw"])
    # Coverage 0.75: owners of a tensor hold the identical value after every step.
    assert r0["units"] == ["layers.0", "layers.1", "layers.2"] and r1["units"] == ["layers.0", "layers.2", "layers.3"]
    for a, b in zip(r0["copies"], r1["copies"]):
        common = sorted(set(a) & set(b))
        assert {n.split(".")[1] for n in common if n.startswith("layers.")} == {"0", "2"}
        assert all(torch.equal(a[n], b[n]) for n in common)
    # The clipping norm is the union gradient's, each co-owned block counted once.
    for a, b, n0, n1 in zip(r0["grads"], r1["grads"], r0["norms"], r1["norms"]):
        assert all(torch.equal(a[n], b[n]) for n in set(a) & set(b))
        union = {**a, **b}
        assert len(union) == len(list(Net().parameters()))
        expected = torch.sqrt(sum(g.double().pow(2).sum() for g in union.values())).item()
        assert n0 == n1 and n0 == pytest.approx(expected, rel=1e-6)  # returned as float32, as torch does
    # A rank holds exactly its units: the shared tensors and three blocks, the skipped one as SkipBlock.
    net = Net()
    block = sum(p.numel() for p in net.layers[0].parameters())
    shared = sum(p.numel() for n, p in net.named_parameters() if not n.startswith("layers."))
    assert r0["held"] == r1["held"] == shared + 3 * block
    assert r0["layers"] == ["Block", "Block", "Block", "SkipBlock"]
    assert r1["layers"] == ["Block", "SkipBlock", "Block", "Block"]
    # Averaged: the shared tensors and the two co-owned blocks, plus 2 flag slots per rank (float32).
    assert r0["bytes"] == 4 * (shared + 2 * block + 2 * 2)
    # The union: every tensor once, each written by its lowest owner only (layer 3 by rank 1).
    assert list(r0["union"]) == [n for n, _ in net.named_parameters()] + [n for n, _ in net.named_buffers()]
    assert set(r0["shares"]) == {"shared", "layers.0", "layers.1", "layers.2"} and set(r1["shares"]) == {"layers.3"}
    torch.testing.assert_close(r0["union"]["layers.3.fc.weight"], r1["copies"][-1]["layers.3.fc.weight"])
    # DCP carries the model and AdamW state: a fresh wrapper (another init seed) resumes bit for bit,
    # and each tensor of the model is written once although both owners hand co-owned blocks in.
    assert r0["loaded"] and r1["loaded"] and r0["resumed"] and r1["resumed"]
    assert r0["written"] == sorted(f"model.{n}" for n in r0["union"])
    # Bad input: one line each, naming the key.
    e = r0["errors"]
    assert len(e) == 4 and all("\n" not in m for m in e), e
    assert e[0].startswith("units='blocks.*'") and "matches no module" in e[0]
    assert "lies inside unit 'layers.1'" in e[1]
    assert e[2].startswith("model=") and "torch.device('meta')" in e[2]
    assert "'1' (Sequential) has no known skip rule" in e[3] and "skip=" in e[3]


def test_parallelize_needs_a_process_group():
    with pytest.raises(ConfigError, match="init_process_group"):
        subnetdp.parallelize(_meta(), units="layers.*")


def _framework_and_wrapper(rank: int, world: int, init_method: str, cache: str) -> dict:
    from subnetdp.sdp.construct import meta_model
    from subnetdp.sdp.sync import OwnerGroupAverager
    from subnetdp.train.setup import build_plan
    from tests.helpers import lm_config, plugin_manager, train_gathered

    # Where each averaging runs: inside a backward (autograd's end-of-backward callback, a graph task is
    # current) or after it; counted only when it averages (finish is idempotent within a step).
    paths: list[str] = []
    finish = OwnerGroupAverager.finish

    def counted(self) -> None:
        if getattr(self, "_phase", None) != "finished":
            paths.append("backward" if torch._C._current_graph_task_id() != -1 else "after")
        finish(self)

    OwnerGroupAverager.finish = counted
    cfg = lm_config(init_method, cache, "masker.coverage=0.5", "optim.warmup_steps=0", "optim.schedule=constant")
    framework, _, _ = train_gathered(cfg, rank, world)  # the framework's loop, then its group is gone
    out = {"framework": framework, "framework_paths": paths[:]}
    dist.init_process_group("gloo", init_method=init_method + "-own", rank=rank, world_size=world)
    paths.clear()
    data, spec, adapter, _, _, plan = build_plan(cfg, world, plugin_manager())
    for way, units in (("glob", "layers.*"), ("adapter", adapter)):  # units by path, or the adapter's partition
        model = subnetdp.parallelize(meta_model(adapter, spec), units=units, coverage=0.5, seed=int(cfg.seed),
                                     init=adapter.init_module, spec=spec)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
        batches = iter(data.train_loader(rank, world, int(cfg.train.batch_size)))
        for _ in range(int(cfg.train.steps)):  # a user's loop: the adapter only lends its loss
            adapter.training_loss(model, next(batches)).backward()
            opt.step()
            opt.zero_grad()
        out[way] = {model.pmap.pieces[n][0].global_name: p.detach().clone() for n, p in model.module.named_parameters()}
        out[f"{way}_paths"], paths[:] = paths[:], []
        out[f"{way}_plan"] = plan.owned == model.plan.owned
    dist.destroy_process_group()
    return out


def test_framework_loop_and_user_loop_agree(tmp_path):
    """The same plan, data and seed give the same parameters through the framework's loop and the wrapper,
    and both average on one path: once a step, from autograd's end-of-backward callback."""
    from subnetdp.plugins.data.tokens import TokensConfig, TokensData

    cache = tmp_path / "cache"
    TokensData(TokensConfig(root="stdlib", cache_dir=str(cache), stdlib_max_mb=0.5), seed=0).check()  # once, before the ranks
    for r, res in enumerate(run_ranks(_framework_and_wrapper, 2, tmp_path, str(cache), timeout=300)):
        steps = len(res["glob_paths"])
        assert steps > 0 and res["glob_paths"] == ["backward"] * steps  # the user's loop: DDP's place
        assert res["framework_paths"] == res["glob_paths"] == res["adapter_paths"], f"rank {r}"
        for way in ("glob", "adapter"):
            assert res[f"{way}_plan"]
            assert res["framework"].keys() == res[way].keys()
            for name, value in res["framework"].items():
                assert torch.equal(value, res[way][name]), f"rank {r} {way} {name}"
