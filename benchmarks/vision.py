"""Vision benchmark: per-rank peak memory and accuracy of block- and neuron-level SDP against DDP (Swin, ResNet-18).

1. Memory. One rank's training step (forward, backward, optimizer step) at 32x32, batch 64 per
   worker, measured with the dispatch-level :class:`TensorMemoryTracker` under ``FakeTensorMode``
   (exact tensor bytes without computing; on a GPU the CUDA allocator would be used). DDP is the
   full model's step (with ``gradient_as_bucket_view=True`` DDP's buckets are the gradients, and
   SDP's synchroniser does the same, so neither adds tensors beyond what is measured; NCCL's or
   gloo's own buffers are not seen). B-SDP is the largest rank's subnetwork of a 4-rank cyclic plan.
   N-SDP (neuron level, ``masker.units_per_layer=8``) is the largest rank's physically narrower
   subnetwork of the same kind of plan (Swin: MLP hidden ranges; ResNet: inner channels of blocks).
2. Accuracy. scikit-learn's digits resized to 32x32 (``data.image_size=32``), 2 gloo ranks, one
   thread each: torch DDP for S steps; B-SDP (block level) and N-SDP (neuron level,
   ``masker.granularity=neuron``, 8 hidden ranges per layer) at C = 0.5, each for S steps (same
   steps) and for S / C steps (FLOP-matched by the method's rule: an SDP step runs about C of
   DDP's FLOPs). The column ``fwd FLOPs`` is the measured forward FLOPs per image of the largest
   rank's model relative to the full model (``FlopCounterMode``), which says how close to C a step
   really is (shared parts such as the stem, patch embedding and head are always computed). The
   union model is evaluated on the 360 held-out images by the same code for every row.

Usage: python benchmarks/vision.py [--swin-steps S] [--resnet-steps S] [--batch-size B] [--skip-accuracy]
Writes benchmarks/results/vision.json and prints both tables.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from subnetdp.train.configure import load_config  # noqa: E402
from subnetdp.core.contracts import LaunchEnv  # noqa: E402
from subnetdp.parallel.memory import TensorMemoryTracker, live_state_bytes, training_state_tensors  # noqa: E402
from subnetdp.train.optim import build_optimizer, build_schedule  # noqa: E402
from subnetdp.core.plan import make_plan  # noqa: E402
from subnetdp.core.plugins import PluginManager  # noqa: E402
from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise

MEMORY_MODELS = {
    # Swin-T's widths, depths and heads with the small-image patching of configs/recipes/swin_t_cifar10.yaml.
    "Swin-T (patch 2, window 4)": ["model.name=swin", "model.variant=t", "model.patch_size=2", "model.window_size=4",
                                   "optim.name=adamw", "optim.weight_decay=0.05"],
    "ResNet-18 (CIFAR stem)": ["model.name=resnet", "model.variant=resnet18", "optim.name=sgd"],
}
ACCURACY_MODELS = {
    "Swin (variant cifar)": ["model.name=swin", "model.variant=cifar", "optim.name=adamw", "optim.lr=0.002",
                             "optim.weight_decay=0.05", "eval.bn_recalibrate_batches=0"],
    "ResNet-18 (CIFAR stem)": ["model.name=resnet", "model.variant=resnet18", "optim.name=sgd", "optim.lr=0.05",
                               "eval.bn_recalibrate_batches=10"],
}


def _fake(model: torch.nn.Module, mode: Any) -> None:
    """Replace every parameter and buffer of ``model`` by a fake tensor of the same shape."""
    for m in model.modules():
        for n, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[n] = torch.nn.Parameter(mode.from_tensor(p.detach()), p.requires_grad)
        for n, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[n] = mode.from_tensor(b)


def step_peak(adapter: Any, full: torch.nn.Module, partition: Any, owned: list[int], optim_cfg: Any,
              batch: int) -> dict:
    """Peak tensor bytes of one rank's second training step (the first creates gradients and state)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, _ = adapter.materialize(copy.deepcopy(full), owned, partition)
    params = sum(p.numel() for p in model.parameters())
    mode = FakeTensorMode()
    _fake(model, mode)
    with mode:
        opt = build_optimizer(optim_cfg, model.parameters())
        x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
        for step in range(2):
            # Gradients persist between steps (bucket views, as in DDP and in SDP's synchroniser).
            tracker = (TensorMemoryTracker(live_state_bytes(training_state_tensors(model, opt)))
                       if step else contextlib.nullcontext())
            with tracker:
                opt.zero_grad(set_to_none=False)
                adapter.loss(model(x), (x, y)).backward()
                opt.step()
    return {"peak_bytes": tracker.peak, "state_bytes": tracker.baseline, "params": params,
            "units_held": len(owned) / len(partition.units)}


def memory_table(batch: int, pm: PluginManager, world: int = 4) -> list[dict]:
    rows = []
    for label, overrides in MEMORY_MODELS.items():
        cfg = load_config(None, overrides + ["data.name=synthetic", "data.image_size=32", "data.in_channels=3",
                                         "data.num_classes=10"], pm.registries)
        spec = pm.get("data", "synthetic")(cfg.data).spec()
        adapter = pm.get("model", cfg.model.name)(cfg.model)
        torch.manual_seed(0)
        full = adapter.build(spec)
        partitions = {"block": adapter.partition(full, "block", spec),
                      "neuron": adapter.partition(full, "neuron", spec, units_per_layer=8)}
        base = None
        for method, coverage in (("DDP", 1.0), ("B-SDP", 0.75), ("B-SDP", 0.5), ("N-SDP", 0.75), ("N-SDP", 0.5)):
            partition = partitions["neuron" if method == "N-SDP" else "block"]
            cfg.masker.coverage = coverage
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the effective coverage is shown in the table
                plan = make_plan(pm.get("masker", cfg.masker.name)(cfg.masker), partition, world, 0, 1)
            ranks = range(world) if coverage < 1 else range(1)
            worst = max((step_peak(adapter, full, partition, plan.owned[r], cfg.optim, batch) for r in ranks),
                        key=lambda m: m["peak_bytes"])
            base = base or worst
            rows.append({"model": label, "method": method, "coverage": coverage,
                         "units_held": worst["units_held"], "params_held": worst["params"],
                         "peak_mib": worst["peak_bytes"] / 2**20, "state_mib": worst["state_bytes"] / 2**20,
                         "peak_vs_ddp": worst["peak_bytes"] / base["peak_bytes"]})
    return rows


# --------------------------------------------------------------------------- accuracy (2 gloo ranks)


def _sdp_run(rank: int, world: int, init: str, overrides: list[str]) -> dict:
    from subnetdp.train.loop import train

    cfg = load_config(None, overrides + [f"comm.init_method={init}"], PluginManager().registries)
    t0 = time.perf_counter()
    run = train(cfg, LaunchEnv(rank, world, rank, world, "benchmark"))
    mine = run.result.summary["ranks"][rank]
    return {"eval": run.result.eval_metrics, "wall_s": time.perf_counter() - t0, "params_held": mine["params_held"],
            "step_time_s": mine["step_time_s"]}


def _ddp_run(rank: int, world: int, init: str, overrides: list[str]) -> dict:
    """torch DDP on the same model, data, optimizer, schedule and evaluation as the SDP runs."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from subnetdp.sdp.union import evaluate

    pm = PluginManager()
    cfg = load_config(None, overrides, pm.registries)
    data = pm.get("data", cfg.data.name)(cfg.data, seed=int(cfg.seed))
    adapter = pm.get("model", cfg.model.name)(cfg.model)
    t0 = time.perf_counter()
    torch.manual_seed(int(cfg.seed))
    model = adapter.build(data.spec())
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        ddp = DDP(model, gradient_as_bucket_view=True)
        opt = build_optimizer(cfg.optim, ddp.parameters())
        sched = build_schedule(cfg.optim, opt, int(cfg.train.steps))
        batches = iter(data.train_loader(rank, world, int(cfg.train.batch_size)))
        model.train()
        times = []
        for _ in range(int(cfg.train.steps)):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            x, y = next(batches)
            adapter.loss(ddp(x), (x, y)).backward()
            opt.step()
            sched.step()
            times.append(time.perf_counter() - t)
        metrics = evaluate(model, adapter, data, cfg) if rank == 0 else {}
        warm = times[1:] or times
        return {"eval": metrics, "wall_s": time.perf_counter() - t0,
                "params_held": sum(p.numel() for p in model.parameters()), "step_time_s": sum(warm) / len(warm)}
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world: int, init: str, jobs: list[tuple[str, list[str]]], out: str) -> None:
    """Every job of one model, one after the other, in the same two processes (imports paid once)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    results = [(_ddp_run if kind == "ddp" else _sdp_run)(rank, world, f"{init}-{i}", overrides)
               for i, (kind, overrides) in enumerate(jobs)]
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def spawn(jobs: list[tuple[str, list[str]]], world: int = 2, timeout: float = 1200) -> list[dict]:
    """Run ``jobs`` on ``world`` spawned gloo ranks meeting over FileStores; rank 0's results."""
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{tmp}/store", f"{tmp}/result.json"
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, world, init, jobs, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        if any(p.exitcode != 0 for p in procs) or not Path(out).exists():
            raise RuntimeError(f"training ranks failed (exit codes {[p.exitcode for p in procs]})")
        return json.loads(Path(out).read_text())


def flop_fraction(overrides: list[str], world: int = 2) -> float:
    """Forward FLOPs per image of the largest rank's model over the full model's, for ``world`` ranks."""
    from torch.utils.flop_counter import FlopCounterMode

    from subnetdp.sdp.variants import local_model, partition_model

    pm = PluginManager()
    cfg = load_config(None, overrides, pm.registries)
    spec = pm.get("data", cfg.data.name)(cfg.data, seed=int(cfg.seed)).spec()
    adapter = pm.get("model", cfg.model.name)(cfg.model)
    torch.manual_seed(int(cfg.seed))
    full = adapter.build(spec)
    partition = partition_model(adapter, full, cfg.masker, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(pm.get("masker", cfg.masker.name)(cfg.masker), partition, world, int(cfg.seed), 1)
    x = torch.zeros(1, spec.in_channels or 3, spec.image_size, spec.image_size)

    def flops(model: torch.nn.Module) -> int:
        model.eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
        return counter.get_total_flops()

    ranks = [local_model(adapter, copy.deepcopy(full), plan.owned[r], partition, cfg.masker)[0] for r in range(world)]
    return max(flops(m) for m in ranks) / flops(full)


def accuracy_table(steps: dict[str, int], batch: int, coverage: float, run_dir: str) -> list[dict]:
    rows = []
    for label, model in ACCURACY_MODELS.items():
        s = steps[label]
        if s <= 0:
            continue
        common = model + ["data.name=digits", "data.image_size=32", f"train.batch_size={batch}", "optim.warmup_steps=5",
                          "optim.schedule=cosine", "launch.threads_per_rank=1", "train.progress=false",
                          "train.log_every=1000", "run.tensorboard=false", f"run.dir={run_dir}"]
        runs = [("DDP (torch)", "ddp", 1.0, s, "block")]
        for method, granularity in (("B-SDP", "block"), ("N-SDP", "neuron")):
            runs += [(f"{method}, same steps", "sdp", coverage, s, granularity),
                     (f"{method}, FLOP-matched", "sdp", coverage, round(s / coverage), granularity)]
        jobs = [(kind, common + [f"masker.coverage={c}", f"masker.granularity={g}", f"train.steps={n}",
                                 f"run.name={kind}-{g}-{c}-{n}"])
                for _, kind, c, n, g in runs]
        fraction = {g: flop_fraction(common + [f"masker.coverage={coverage}", f"masker.granularity={g}"])
                    for g in ("block", "neuron")}
        for (method, _, c, n, g), result in zip(runs, spawn(jobs)):
            rows.append({"model": label, "method": method, "coverage": c, "granularity": g, "steps": n,
                         "fwd_flops_vs_ddp": 1.0 if c == 1.0 else fraction[g],
                         "accuracy": result["eval"]["accuracy"], "eval_loss": result["eval"]["loss"],
                         "params_held": result["params_held"], "step_time_s": result["step_time_s"],
                         "wall_s": result["wall_s"]})
            print(f"  {label:<24} {method:<20} {n:>4} steps  accuracy {result['eval']['accuracy']:.4f}  "
                  f"({result['wall_s']:.0f} s)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--swin-steps", type=int, default=60,
                    help="Swin: DDP's steps S (FLOP-matched SDP: S / C); 0 skips")
    ap.add_argument("--resnet-steps", type=int, default=16, help="ResNet-18: DDP's steps S; 0 skips")
    ap.add_argument("--batch-size", type=int, default=16, help="per rank, accuracy runs")
    ap.add_argument("--memory-batch-size", type=int, default=64, help="per worker, memory step")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--out", default=str(results_dir() / "vision.json"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    pm = PluginManager()

    t0 = time.perf_counter()
    mem = [] if args.skip_memory else memory_table(args.memory_batch_size, pm)
    if mem:
        print(f"\nPer-rank peak tensor memory of one training step, 32x32, batch {args.memory_batch_size} per worker "
              "(FakeTensorMode + dispatch tracker; SDP: largest rank of 4)")
        print(f"{'model':<28} {'method':<6} {'C':>5} {'units held':>11} {'params held':>12} {'state MiB':>10} "
              f"{'peak MiB':>9} {'vs DDP':>7}")
        for r in mem:
            print(f"{r['model']:<28} {r['method']:<6} {r['coverage']:>5.2f} {r['units_held']:>11.0%} {r['params_held']:>12,} "
                  f"{r['state_mib']:>10.1f} {r['peak_mib']:>9.1f} {r['peak_vs_ddp']:>7.2f}")
    acc: list[dict] = []
    if not args.skip_accuracy:
        steps = dict(zip(ACCURACY_MODELS, (args.swin_steps, args.resnet_steps)))
        print(f"\nAccuracy on digits at 32x32, 2 gloo ranks x batch {args.batch_size}:", flush=True)
        with tempfile.TemporaryDirectory() as run_dir:
            acc = accuracy_table(steps, args.batch_size, 0.5, run_dir)
        print(f"\n{'model':<24} {'method':<20} {'C':>4} {'steps':>5} {'fwd FLOPs':>9} {'accuracy':>8} {'eval loss':>9} "
              f"{'params/rank':>11} {'step s':>7} {'acc - DDP':>9}")
        for r in acc:
            ddp = next(d for d in acc if d["model"] == r["model"] and d["coverage"] == 1.0)
            print(f"{r['model']:<24} {r['method']:<20} {r['coverage']:>4.2f} {r['steps']:>5} "
                  f"{r['fwd_flops_vs_ddp']:>9.2f} {r['accuracy']:>8.4f} "
                  f"{r['eval_loss']:>9.4f} {r['params_held']:>11,} {r['step_time_s']:>7.3f} "
                  f"{r['accuracy'] - ddp['accuracy']:>+9.4f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"memory": mem, "accuracy": acc, "args": vars(args),
                                          "torch": torch.__version__, "wall_s": time.perf_counter() - t0}, indent=2))
    print(f"\nwrote {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
