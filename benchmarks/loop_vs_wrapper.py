"""The framework's loop against ``subnetdp.parallelize`` in a plain user loop: step time, same plan.

For a task of ``benchmarks/evidence_tasks.py`` (the 8-block LLaMA by default), its workers under one
torchrun agent, C = 0.5: each job trains ``--steps`` steps through the framework's loop
(``subnetdp.train``: set-up, then ``train_loop``), then, in the same processes and on the same plan,
data and seed, ``--steps`` steps of a user's loop over ``subnetdp.parallelize(model, units=adapter)``
(forward, the adapter's loss, backward, clipping when the task clips, AdamW, zero_grad). ``--jobs``
jobs; the figure is the median over jobs of the ratio wrapper / framework, each the slower rank's
mean step time after the first step. The framework's step is its meter's (the training step and a
re-plan when due, not logging or evaluation); the wrapper's is the user loop's whole iteration.

    .venv/bin/python benchmarks/loop_vs_wrapper.py [--task llama8] [--steps 20] [--jobs 3]

Writes ``loop_vs_wrapper_TASK.json`` under the results directory (``_results.py``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise
from evidence_tasks import TASKS

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
CACHE = Path(tempfile.gettempdir()) / "subnetdp-loop-vs-wrapper-cache"


def _worker(args: argparse.Namespace) -> None:
    """One rank of one job (under torchrun): the framework's loop, then the wrapper; rank 0 writes ``args.out``."""
    import torch
    import torch.distributed as dist

    import subnetdp
    from subnetdp.core.plugins import PluginManager
    from subnetdp.launchers import detect
    from subnetdp.sdp.construct import meta_model
    from subnetdp.train.configure import load_config
    from subnetdp.train.loop import train_loop
    from subnetdp.train.setup import build_plan, setup

    task = TASKS[args.task]
    extra = ["masker.coverage=0.5", "eval.every=0", "eval.batches=1", "eval.bn_recalibrate_batches=0",
             "checkpoint.enabled=false", "train.progress=false", "train.log_every=1000", "recovery.verify_every=0",
             f"run.dir={args.run_dir}", f"run.name={args.task}-{args.job}"]
    if task.data_cache:
        extra.append(f"data.cache_dir={CACHE}")
    pm = PluginManager()
    cfg = load_config(task.recipe, task.overrides_for(args.steps, extra), pm.registries)
    env = detect()
    ctx, st = setup(cfg, env, pm)
    try:
        result = train_loop(ctx, st)
    finally:
        ctx.comm.shutdown()
    framework = max(r["step_time_s"] for r in result.summary["ranks"])

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data, spec, adapter, _, _, plan = build_plan(cfg, world, pm)
    model = subnetdp.parallelize(meta_model(adapter, spec), units=adapter, coverage=0.5, seed=int(cfg.seed),
                                 init=adapter.init_module, spec=spec)
    same_plan = model.plan.owned == plan.owned
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg.optim.lr), betas=tuple(cfg.optim.betas),
                            eps=float(cfg.optim.eps), weight_decay=float(cfg.optim.weight_decay))
    clip = float(cfg.optim.clip_grad_norm)
    batches = iter(data.train_loader(rank, world, int(cfg.train.batch_size)))
    times = []
    for _ in range(args.steps):  # a user's loop: the adapter lends its loss only
        t0 = time.perf_counter()
        adapter.training_loss(model, next(batches)).backward()
        if clip > 0:
            model.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    mine = statistics.fmean(times[1:])
    everyone = [None] * world
    dist.all_gather_object(everyone, {"wrapper_s": mine, "same_plan": same_plan})  # collective
    if rank == 0:
        out = {"framework_step_s": framework, "wrapper_step_s": max(e["wrapper_s"] for e in everyone),
               "same_plan": all(e["same_plan"] for e in everyone), "world_size": world}
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _job(task: str, job: int, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{task}-{job}.json"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(TASKS[task].world_size), __file__, "--worker",
           "--task", task, "--job", str(job), "--steps", str(args.steps), "--run-dir", str(tmp / "runs"),
           "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"{task} job {job} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="llama8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)
    if args.task not in TASKS:
        ap.error(f"--task {args.task}: unknown task; choose from {', '.join(TASKS)}")
    if args.steps < 3 or args.jobs < 1:
        ap.error(f"--steps {args.steps} --jobs {args.jobs}: need --steps 3 or more (the first step is not timed) "
                 "and --jobs 1 or more")
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [_job(args.task, j, args, Path(tmp)) for j in range(args.jobs)]
    ratios = [j["wrapper_step_s"] / j["framework_step_s"] for j in jobs]
    out = {"task": args.task, "coverage": 0.5, "steps": args.steps, "jobs": jobs, "ratios": ratios,
           "median_ratio": statistics.median(ratios), "same_plan": all(j["same_plan"] for j in jobs),
           "load": list(os.getloadavg()),
           "command": " ".join(["benchmarks/loop_vs_wrapper.py", *sys.argv[1:]])}
    path = results_dir() / f"loop_vs_wrapper_{args.task}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"{'job':>4} {'framework':>10} {'wrapper':>10} {'ratio':>7}")
    for i, (j, r) in enumerate(zip(jobs, ratios)):
        print(f"{i:>4} {j['framework_step_s'] * 1000:>7.1f} ms {j['wrapper_step_s'] * 1000:>7.1f} ms {r:>7.3f}")
    print(f"median wrapper / framework: {out['median_ratio']:.3f} (same plan: {out['same_plan']}); wrote {path}")


if __name__ == "__main__":
    main()
