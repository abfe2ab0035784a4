"""Torch DDP against subnetdp at several coverages, side by side, on gloo ranks on the CPU.

One invocation trains ResNet-18 (CIFAR stem, 1 input channel, 10 classes) on scikit-learn's
``digits`` with ``--world-size`` spawned gloo processes: first a torch ``DistributedDataParallel``
baseline (``gradient_as_bucket_view=True``), then subnetdp (block-level forward masking, cyclic
masker) at each coverage in ``--coverages``. Each configuration is its own group of processes,
run one after the other. Per rank it measures:

- parameters held;
- peak tensor memory of one step taken after the optimizer state exists (``--memory-step``,
  default 3, since DDP rebuilds its gradient buckets in the forward of step 2, a one-off), with
  subnetdp's dispatch-level ``TensorMemoryTracker`` over the baseline of parameters, buffers,
  gradients and optimizer state, for DDP exactly as ``subnetdp.train.loop`` does for subnetdp;
- payload bytes handed to all-reduces per step and their ring estimate ``2(k-1)/k x payload``
  (DDP's counted by a communication hook wrapped around the default all-reduce);
- mean step time without the first and the memory-measured step.

Everything is reported as ratios to the DDP run of the same invocation.

Usage::

    .venv/bin/python benchmarks/ddp_vs_sdp.py --steps 30 --coverages 1 0.75 0.5

The table goes to stdout, the full results (per rank) to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import io
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from subnetdp.train.configure import load_config
from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import ConfigError
from subnetdp.parallel.memory import TensorMemoryTracker, live_state_bytes, training_state_tensors
from subnetdp.train.optim import build_optimizer, build_schedule
from subnetdp.core.plan import units_kept
from subnetdp.core.plugins import PluginManager
from subnetdp.sdp.union import evaluate
from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise

RECIPE = "resnet18_digits"  # configs/recipes: ResNet-18, CIFAR stem, digits, SGD, cyclic block masker
STAGE_BLOCKS = 2  # ResNet-18 has 2 blocks in every stage: the masker's default groups.
DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters
METRICS = ("params_held", "peak_memory_bytes", "bytes_sent_per_step", "wire_bytes_per_step_ring", "step_time_s")


def _overrides(args: argparse.Namespace, run_dir: str, name: str, store: str) -> list[str]:
    """The config overrides every run of the invocation shares (plus its own store and name)."""
    return [f"train.steps={args.steps}", f"train.batch_size={args.batch_size}", f"train.log_every={args.steps}",
            f"train.memory_step={args.memory_step}", "train.progress=false", f"launch.nproc={args.world_size}",
            "launch.threads_per_rank=1", "eval.bn_recalibrate_batches=0", "eval.batch_size=2048",
            f"comm.init_method=file://{store}", "comm.timeout_s=300", f"run.dir={run_dir}", f"run.name={name}",
            "run.tensorboard=false", "checkpoint.enabled=false"]


class _ByteCount:
    """State of :func:`_counting_allreduce_hook`: payload bytes handed to the all-reduce."""

    def __init__(self) -> None:
        self.payload = 0


def _counting_allreduce_hook(state, bucket):  # no annotations: DDP checks them as real types
    """DDP's default all-reduce hook, counting the bytes of every bucket it hands on.

    Args:
        state: a :class:`_ByteCount`.
        bucket: the ``dist.GradBucket`` DDP hands over.

    Returns:
        The future of the default all-reduce (which divides by the world size).
    """
    buf = bucket.buffer()
    state.payload += buf.numel() * buf.element_size()
    return default_hooks.allreduce_hook(None, bucket)


def _ddp_worker(rank: int, args: argparse.Namespace, run_dir: str, store: str, out: str) -> None:
    """One rank of the DDP baseline: the loop of ``subnetdp.train.loop`` with DDP in place of SDP."""
    torch.set_num_threads(1)
    pm = PluginManager()
    cfg = load_config(RECIPE, _overrides(args, run_dir, "ddp", store), pm.registries)
    world, steps = args.world_size, args.steps
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    data = pm.registries["data"].create(cfg.data.name, cfg.data, seed=int(cfg.seed))
    adapter = pm.registries["model"].create(cfg.model.name, cfg.model)
    torch.manual_seed(int(cfg.seed))  # the same full model every subnetdp rank starts from
    model = adapter.build(data.spec())
    # No buffer sync in forward: BatchNorm statistics stay per rank, as in subnetdp (no extra traffic).
    # Newer torch renames broadcast_buffers (deprecated) to forward_sync_buffers.
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in DDP_ARGS
               else {"broadcast_buffers": False})
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True,
                                  bucket_cap_mb=float(cfg.sync.bucket_cap_mb), **no_sync)
    count = _ByteCount()
    ddp.register_comm_hook(count, _counting_allreduce_hook)
    optimizer = build_optimizer(cfg.optim, ddp.parameters())
    scheduler = build_schedule(cfg.optim, optimizer, steps)
    batches = iter(data.train_loader(rank, world, args.batch_size))
    times, losses, peak = [], [], 0
    ddp.train()
    for step in range(1, steps + 1):
        measure = step == min(int(cfg.train.memory_step), steps)
        tracker = (TensorMemoryTracker(live_state_bytes(training_state_tensors(model, optimizer)))
                   if measure else contextlib.nullcontext())
        t0 = time.perf_counter()
        with tracker:
            optimizer.zero_grad(set_to_none=False)  # grads are bucket views: zero them in place
            batch = next(batches)
            loss = adapter.loss(ddp(adapter.inputs(batch)), batch)
            loss.backward()
            optimizer.step()
            scheduler.step()
        elapsed = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if measure:
            peak = tracker.peak  # as in the loop: the tracked step stays out of the timings
        else:
            times.append(elapsed)
    warm = times[1:] or times  # the first step pays one-off set-up costs
    mine = {"rank": rank, "params_held": sum(p.numel() for p in model.parameters()),
            "peak_memory_bytes": peak, "bytes_sent_per_step": count.payload / steps,
            "wire_bytes_per_step_ring": 2 * (world - 1) / world * count.payload / steps,
            "step_time_s": sum(warm) / len(warm), "train_loss": sum(losses) / len(losses)}
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        result = {"ranks": ranks, "eval": evaluate(model, adapter, data, cfg), "effective_coverage": 1.0,
                  "train_loss": sum(r["train_loss"] for r in ranks) / world}
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _sdp_worker(rank: int, args: argparse.Namespace, coverage: float, group_by: str, run_dir: str,
                store: str, out: str) -> None:
    """One rank of a subnetdp run through ``subnetdp.train.loop.train``."""
    from subnetdp.train.loop import train

    pm = PluginManager()
    name = f"sdp-c{coverage:g}"
    cfg = load_config(RECIPE, _overrides(args, run_dir, name, store)
                      + [f"masker.coverage={coverage}", f"masker.group_by={group_by}"], pm.registries)
    env = LaunchEnv(rank, args.world_size, rank, args.world_size, "benchmark")
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = train(cfg, env, pm)
    if rank == 0:
        eff = run.state.plan.effective_coverage(run.state.partition, group_by)
        per_rank = [sum(eff[g][r] for g in eff) / len(eff) for r in range(args.world_size)]
        records = [json.loads(line) for line in (run.context.run_dir / "metrics.jsonl").read_text().splitlines()]
        train_loss = [r["train/loss"] for r in records if "train/loss" in r][-1]
        result = {"ranks": run.result.summary["ranks"], "eval": run.result.summary["eval"], "group_by": group_by,
                  "train_loss": train_loss,
                  "effective_coverage": sum(per_rank) / len(per_rank), "effective_coverage_by_group": eff}
        Path(out).write_text(json.dumps(result))


def _spawn(worker: Any, args: argparse.Namespace, extra: tuple, tmp: Path, name: str) -> dict[str, Any]:
    """Run ``worker`` on ``--world-size`` spawned processes over a fresh file store; rank 0's result."""
    store, out = tmp / f"{name}.store", tmp / f"{name}.json"
    t0 = time.perf_counter()
    mp.start_processes(worker, args=(args, *extra, str(tmp), str(store), str(out)),
                       nprocs=args.world_size, join=True, start_method="spawn")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


def _group_by(coverage: float) -> str:
    """``auto`` (one group per stage) when stages can express the coverage, else one group."""
    return "auto" if abs(units_kept(coverage, STAGE_BLOCKS) / STAGE_BLOCKS - coverage) <= 0.05 else "model"


def _aggregate(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each per-rank metric as its minimum, maximum and mean over the ranks."""
    out = {}
    for key in METRICS:
        values = [r[key] for r in result["ranks"]]
        out[key] = {"min": min(values), "max": max(values), "mean": sum(values) / len(values)}
    return out


def _ratios(agg: dict[str, dict[str, float]], base: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``agg`` divided by the DDP run's mean of the same metric."""
    return {k: {s: v / base[k]["mean"] for s, v in agg[k].items()} for k in agg}


def _table(rows: list[dict[str, Any]]) -> str:
    """The printed comparison: ratios to DDP (``lo-hi`` where ranks differ), then DDP's own values."""
    head = (f"{'config':<11} {'eff C':>5}  {'params/rank':>11}  {'peak mem/rank':>13}  {'bytes/step':>10}  "
            f"{'ring/step':>9}  {'step time':>9}  {'train loss':>10}  {'test acc':>8}")
    lines = [head, "-" * len(head)]

    def cell(r: dict[str, float], spread: bool = True) -> str:
        return f"{r['min']:.2f}-{r['max']:.2f}" if spread and r["max"] - r["min"] > 5e-3 else f"{r['mean']:.3f}"

    for row in rows:
        q = row["ratios_to_ddp"]
        lines.append(f"{row['name']:<11} {row['effective_coverage']:>5.2f}  {cell(q['params_held']):>11}  "
                     f"{cell(q['peak_memory_bytes']):>13}  {cell(q['bytes_sent_per_step']):>10}  "
                     f"{cell(q['wire_bytes_per_step_ring']):>9}  {cell(q['step_time_s'], False):>9}  "
                     f"{row['train_loss']:>10.4f}  {row['eval'].get('accuracy', float('nan')):>8.3f}")
    base = rows[0]["agg"]
    mib = lambda key: base[key]["mean"] / 2**20  # noqa: E731
    lines.append(f"\nDDP per rank: {base['params_held']['mean']:,.0f} params, peak {mib('peak_memory_bytes'):.1f} MiB, "
                 f"{mib('bytes_sent_per_step'):.2f} MiB sent/step (ring {mib('wire_bytes_per_step_ring'):.2f} MiB), "
                 f"{base['step_time_s']['mean'] * 1e3:.0f} ms/step")
    lines.append("Ratios to DDP; 'lo-hi' = range over ranks; step time = mean over ranks. Memory: tensors\n"
                 "only (dispatch tracker), not gloo's own buffers. Test accuracy without BatchNorm recalibration.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run DDP, then subnetdp at every coverage; print the table and write the JSON.

    Args:
        argv: command-line arguments (``sys.argv[1:]`` if None).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps per configuration")
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks (spawned processes)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--memory-step", type=int, default=3,
                        help="the step whose peak tensor memory is measured (DDP rebuilds its buckets in step 2)")
    parser.add_argument("--coverages", type=float, nargs="+", default=[1.0, 0.75, 0.5],
                        help="subnetdp coverages C to compare with DDP")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the JSON results (default: the results folder's ddp_vs_sdp.json)")
    args = parser.parse_args(argv)
    if args.steps < max(2, args.memory_step) or args.memory_step < 2:
        parser.error("need 2 <= --memory-step <= --steps (after step 1 the optimizer state exists)")
    try:  # every rank's config, checked once here: a bad combination is one line, not a rank's traceback
        with warnings.catch_warnings():  # the ranks warn themselves
            warnings.simplefilter("ignore")
            tmp = tempfile.gettempdir()
            load_config(RECIPE, _overrides(args, tmp, "check", os.path.join(tmp, "store")))
    except ConfigError as e:
        parser.error(f"{e} (the recipe {RECIPE} with this invocation's options)")
    args.out = args.out or results_dir() / "ddp_vs_sdp.json"
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    t_start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddp_vs_sdp-") as tmp:
        print(f"DDP baseline on {args.world_size} gloo ranks ...", flush=True)
        ddp = _spawn(_ddp_worker, args, (), Path(tmp), "ddp")
        rows.append({"name": "ddp", "coverage": 1.0, **ddp})
        for c in args.coverages:
            group_by = _group_by(c)
            print(f"subnetdp C={c:g} (masker.group_by={group_by}) ...", flush=True)
            res = _spawn(_sdp_worker, args, (c, group_by), Path(tmp), f"sdp-c{c:g}")
            rows.append({"name": f"sdp C={c:g}", "coverage": c, **res})
    for row in rows:
        row["agg"] = _aggregate(row)
        row["ratios_to_ddp"] = _ratios(row["agg"], rows[0]["agg"])
    print()
    print(_table(rows))
    wall = time.perf_counter() - t_start
    load = os.getloadavg()[0]
    print(f"\nwall time {wall:.0f} s; results in {args.out}")
    if load > (os.cpu_count() or 1):
        print(f"note: load average {load:.1f} on {os.cpu_count()} cores: other processes shared the CPUs, "
              "so step times are unreliable")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"recipe": RECIPE, "steps": args.steps, "world_size": args.world_size, "batch_size": args.batch_size,
            "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "memory_step": args.memory_step, "wall_s": wall, "load_average_1min": load,
            "memory_measured_by": "dispatch tracker (tensors only; not gloo's buffers)"}
    args.out.write_text(json.dumps({"meta": meta, "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
