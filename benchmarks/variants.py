"""The four SDP variants against DDP, stochastic depth and channel dropout, on gloo ranks on the CPU.

One invocation trains ResNet-18 (CIFAR stem, 1 input channel) on scikit-learn's ``digits``:

- with 4 ranks: torch DDP (``gradient_as_bucket_view=True``); then for each coverage C in 0.75 and
  0.5: B-SDP, N-SDP, Bb-SDP, Nb-SDP (cyclic masker), DDP with stochastic depth on the residual
  branches (``torchvision.ops.StochasticDepth``, survival rate C) and DDP with channel dropout on the
  blocks' inner channels (``nn.Dropout2d``, keep rate C);
- with 8 ranks: the same at C = 0.375.

ResNet-18 has 2 blocks per stage, which cannot express C = 0.75 or 0.375 per stage; block-level runs
at those coverages draw across all 8 blocks (``masker.group_by=model``). Neuron level keeps the
default groups (8 ranges per block). The table's ``C eff`` column is the coverage actually used.

Each configuration is its own group of spawned processes, one thread each. Per configuration it
reports the mean over ranks of the peak tensor memory of one step taken after the optimizer state
exists (``--memory-step``, default 3: DDP rebuilds its buckets during step 2), measured with
subnetdp's dispatch-level ``TensorMemoryTracker`` (tensors only: gloo's own buffers are not
seen), the payload bytes handed to collectives per step (DDP's counted by a communication hook;
SDP's include backward masking's refresh broadcasts), the mean step time without the first step,
all as ratios to the DDP run of the same world size in the same invocation, and the digits test
accuracy after the same number of steps (SDP: the union model; BatchNorm statistics recalibrated on
the same training batches for every model).

Usage::

    .venv/bin/python benchmarks/variants.py --steps 60
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torchvision.ops import StochasticDepth

from subnetdp.train.configure import load_config
from subnetdp.core.contracts import LaunchEnv
from subnetdp.parallel.memory import TensorMemoryTracker, live_state_bytes, training_state_tensors
from subnetdp.train.optim import build_optimizer, build_schedule
from subnetdp.core.plan import units_kept
from subnetdp.core.plugins import PluginManager
from subnetdp.sdp.union import evaluate
from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise

RECIPE = "resnet18_digits"
STAGE_BLOCKS = 2  # blocks per stage of ResNet-18
DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters
REGULARISED = {"stochastic_depth": "DDP+StochasticDepth", "channel_dropout": "DDP+Dropout2d"}
SDP = {"B-SDP": ("block", "forward"), "N-SDP": ("neuron", "forward"),
       "Bb-SDP": ("block", "backward"), "Nb-SDP": ("neuron", "backward")}


def _overrides(args: argparse.Namespace, world: int, run_dir: str, name: str, store: str) -> list[str]:
    return [f"train.steps={args.steps}", f"train.batch_size={args.batch_size}", f"train.log_every={args.steps}",
            f"train.memory_step={args.memory_step}", "train.progress=false", f"launch.nproc={world}",
            "launch.threads_per_rank=1", f"eval.bn_recalibrate_batches={args.recalibrate}", "eval.batch_size=512",
            f"comm.init_method=file://{store}", "comm.timeout_s=600", f"run.dir={run_dir}", f"run.name={name}",
            "run.tensorboard=false"]


class _Bytes:
    def __init__(self) -> None:
        self.payload = 0


def _counting_hook(state, bucket):  # no annotations: DDP checks them as real types
    """DDP's default all-reduce, counting the payload of every bucket."""
    buf = bucket.buffer()
    state.payload += buf.numel() * buf.element_size()
    return default_hooks.allreduce_hook(None, bucket)


class _ApplyOutput:
    """Forward hook: pass a layer's output through ``fn`` (a child module, so train/eval follow)."""

    def __init__(self, fn: nn.Module) -> None:
        self.fn = fn

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return self.fn(out)


def regularise(model: nn.Module, kind: str, keep: float) -> None:
    """DDP baselines: stochastic depth on every residual branch, or dropout of inner channels."""
    for stage in ("layer1", "layer2", "layer3", "layer4"):
        for block in getattr(model, stage):
            if kind == "stochastic_depth":
                block.stochastic_depth = StochasticDepth(1.0 - keep, mode="row")
                last_bn = block.bn3 if hasattr(block, "bn3") else block.bn2  # end of the residual branch
                last_bn.register_forward_hook(_ApplyOutput(block.stochastic_depth))
            else:
                block.channel_dropout = nn.Dropout2d(1.0 - keep)
                hidden_bn = block.bn2 if hasattr(block, "bn3") else block.bn1  # inner channels
                hidden_bn.register_forward_hook(_ApplyOutput(block.channel_dropout))


def _ddp_worker(rank: int, world: int, args: argparse.Namespace, kind: str, keep: float, run_dir: str,
                store: str, out: str) -> None:
    """One rank of DDP (optionally regularised): subnetdp's loop with DDP in place of SDP."""
    torch.set_num_threads(1)
    pm = PluginManager()
    cfg = load_config(RECIPE, _overrides(args, world, run_dir, kind, store), pm.registries)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    data = pm.registries["data"].get(cfg.data.name)(cfg.data, seed=int(cfg.seed))
    adapter = pm.registries["model"].get(cfg.model.name)(cfg.model)
    torch.manual_seed(int(cfg.seed))
    model = adapter.build(data.spec())
    if kind != "ddp":
        regularise(model, kind, keep)
    torch.manual_seed(int(cfg.seed) + 1000 + rank)  # independent drop patterns per rank
    # BatchNorm statistics stay per rank, as in subnetdp (newer torch renames broadcast_buffers).
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in DDP_ARGS else {"broadcast_buffers": False})
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=float(cfg.sync.bucket_cap_mb),
                                  **no_sync)
    count = _Bytes()
    ddp.register_comm_hook(count, _counting_hook)
    optimizer = build_optimizer(cfg.optim, ddp.parameters())
    scheduler = build_schedule(cfg.optim, optimizer, args.steps)
    batches = iter(data.train_loader(rank, world, args.batch_size))
    times, peak = [], 0
    ddp.train()
    for step in range(1, args.steps + 1):
        measure = step == min(args.memory_step, args.steps)
        tracker = (TensorMemoryTracker(live_state_bytes(training_state_tensors(model, optimizer)))
                   if measure else contextlib.nullcontext())
        t0 = time.perf_counter()
        with tracker:
            optimizer.zero_grad(set_to_none=False)
            batch = next(batches)
            adapter.loss(ddp(adapter.inputs(batch)), batch).backward()
            optimizer.step()
            scheduler.step()
        if measure:
            peak = tracker.peak
        else:
            times.append(time.perf_counter() - t0)
    warm = times[1:] or times
    mine = {"rank": rank, "params_held": sum(p.numel() for p in model.parameters()), "peak_memory_bytes": peak,
            "bytes_sent_per_step": count.payload / args.steps, "step_time_s": sum(warm) / len(warm)}
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": ranks, "eval": evaluate(model, adapter, data, cfg)}))
    dist.destroy_process_group()


def _sdp_worker(rank: int, world: int, args: argparse.Namespace, variant: str, coverage: float, run_dir: str,
                store: str, out: str) -> None:
    from subnetdp.train.loop import train

    torch.set_num_threads(1)
    granularity, regime = SDP[variant]
    pm = PluginManager()
    name = f"{variant}-c{coverage}-w{world}"
    cfg = load_config(RECIPE, _overrides(args, world, run_dir, name, store)
                      + [f"masker.granularity={granularity}", f"masker.regime={regime}", f"masker.coverage={coverage}",
                     f"masker.group_by={group_by(granularity, coverage)}"],
                  pm.registries)
    run = train(cfg, LaunchEnv(rank, world, rank, world, "benchmark"), pm)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": run.result.summary["ranks"], "eval": run.result.summary["eval"]}))


def group_by(granularity: str, coverage: float) -> str:
    """ResNet-18 stages have 2 blocks: a coverage 2 blocks cannot express (0.75, 0.375) is drawn
    across all 8 blocks instead (``masker.group_by=model``), so the effective coverage is C."""
    if granularity == "block" and abs(units_kept(coverage, STAGE_BLOCKS) / STAGE_BLOCKS - coverage) > 0.05:
        return "model"
    return "auto"


def effective_coverage(method: str, coverage: float) -> float:
    if method not in SDP:
        return coverage
    if SDP[method][0] == "neuron":
        return units_kept(coverage, 8) / 8  # masker.units_per_layer = 8
    k = 8 if group_by("block", coverage) == "model" else STAGE_BLOCKS
    return units_kept(coverage, k) / k


def _world_worker(rank: int, world: int, args: argparse.Namespace, cases: list[tuple], tmp: str) -> None:
    """Every configuration of one world size, one after the other, in the same processes
    (each with its own process group), so torch's import and start-up are paid once."""
    import warnings

    warnings.filterwarnings("ignore", message="group .* units kept")  # group_by=model is chosen on purpose
    for tag, kind, param in cases:
        store, out = os.path.join(tmp, f"store-{tag}"), os.path.join(tmp, f"out-{tag}.json")
        if kind in SDP:
            _sdp_worker(rank, world, args, kind, param, tmp, store, out)
        else:
            _ddp_worker(rank, world, args, kind, param, tmp, store, out)


def _spawn_world(world: int, args: argparse.Namespace, cases: list[tuple], tmp: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_world_worker, args=(r, world, args, cases, tmp)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"world {world}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    return {tag: json.loads(Path(tmp, f"out-{tag}.json").read_text()) for tag, _, _ in cases}


def _mean(ranks: list[dict], key: str) -> float:
    return sum(r[key] for r in ranks) / len(ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--memory-step", type=int, default=3)
    parser.add_argument("--recalibrate", type=int, default=10, help="BatchNorm recalibration batches")
    parser.add_argument("--settings", default="4:0.75,4:0.5,8:0.375", help="world:coverage pairs")
    parser.add_argument("--out", default=str(results_dir() / "variants.json"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    settings = [(int(w), float(c)) for w, c in (s.split(":") for s in args.settings.split(","))]
    rows: list[dict[str, Any]] = []
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for world in dict.fromkeys(w for w, _ in settings):
            # The first configuration in fresh processes pays one-off warm-up costs: a discarded DDP run.
            cases = [(f"warmup-w{world}", "ddp", 1.0), (f"ddp-w{world}", "ddp", 1.0)]
            for c in (c for w, c in settings if w == world):
                cases += [(f"{v}-w{world}-c{c}", v, c) for v in SDP]
                cases += [(f"{k}-w{world}-c{c}", k, c) for k in REGULARISED]
            results = _spawn_world(world, args, cases, tmp)
            base = results[f"ddp-w{world}"]
            for tag, kind, c in cases[1:]:
                label = kind if kind in SDP else REGULARISED.get(kind, "DDP")
                rows.append({"world": world, "coverage": c, "method": label,
                             "effective_coverage": effective_coverage(kind, c), **_summ(results[tag], base)})
            print(format_table([r for r in rows if r["world"] == world]), flush=True)
    table = format_table(rows)
    print(table)
    meta = {"steps": args.steps, "batch_size_per_rank": args.batch_size, "memory_step": args.memory_step,
            "bn_recalibrate_batches": args.recalibrate, "threads_per_rank": 1, "backend": "gloo (CPU)",
            "torch": torch.__version__, "machine": platform.platform(), "cpus": os.cpu_count(),
            "wall_s": round(time.time() - started, 1),
            "memory": "dispatch-level tensor tracker (tensors only; gloo's own buffers not seen)"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "table": table}, indent=2))
    print(f"\nwrote {args.out} ({meta['wall_s']} s)")


def _summ(res: dict, base: dict) -> dict[str, Any]:
    r, b = res["ranks"], base["ranks"]
    out = {"peak_memory_mib": _mean(r, "peak_memory_bytes") / 2**20,
           "bytes_per_step_mib": _mean(r, "bytes_sent_per_step") / 2**20,
           "step_time_ms": _mean(r, "step_time_s") * 1000, "params_held": _mean(r, "params_held"),
           "accuracy": res["eval"].get("accuracy")}
    out["memory_ratio"] = _mean(r, "peak_memory_bytes") / _mean(b, "peak_memory_bytes")
    out["bytes_ratio"] = _mean(r, "bytes_sent_per_step") / max(1e-9, _mean(b, "bytes_sent_per_step"))
    out["time_ratio"] = _mean(r, "step_time_s") / _mean(b, "step_time_s")
    out["max_peak_memory_mib"] = max(x["peak_memory_bytes"] for x in r) / 2**20
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'W':>2} {'C':>6} {'C eff':>6}  {'method':<20} {'peak MiB':>9} {'x DDP':>6} {'MiB/step':>9} {'x DDP':>6} "
            f"{'ms/step':>8} {'x DDP':>6} {'test acc':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['world']:>2} {r['coverage']:>6.3f} {r['effective_coverage']:>6.3f}  {r['method']:<20} {r['peak_memory_mib']:>9.1f} "
                     f"{r['memory_ratio']:>6.2f} {r['bytes_per_step_mib']:>9.2f} {r['bytes_ratio']:>6.2f} "
                     f"{r['step_time_ms']:>8.0f} {r['time_ratio']:>6.2f} {r['accuracy']:>8.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
