"""What the owners' verification costs (``recovery.verify_every``): its time against the step time.

For ResNet-18 digits and the 8-block LLaMA (``benchmarks/evidence_tasks.py``), 4 gloo workers under
one torchrun agent, C = 0.5, two runs of ``--steps`` steps each:

- ``verify_every=0`` (off) and ``verify_every=1`` (a verification after every step): the loop's
  wall time per step of each; their difference is what one verification costs inside a real run;
- in the first run, after training, ``--reps`` verifications timed alone (digest of every owned unit,
  the world's gather of the digests; the slowest rank counts), and the bytes each rank hashes.

The cost at ``verify_every=N`` is one verification per N steps: ``verification / (N x step)``,
printed for the schema's default N. Step times on a shared 2-core machine are noisy; the isolated
timing is the steadier figure, the difference of the two runs a check of it.

    .venv/bin/python benchmarks/verify_cost.py [--tasks resnet18,llama8 --steps 40 --reps 5]

Writes ``verify_cost.json`` under the results directory (``_results.py``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise
from evidence_tasks import TASKS

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
CACHE = Path(tempfile.gettempdir()) / "subnetdp-verify-cost-cache"


def _worker(args: argparse.Namespace) -> None:
    """One rank of one run (under torchrun): train, then time verifications alone; rank 0 writes ``args.out``."""
    from subnetdp.train.configure import load_config
    from subnetdp.sdp.verify import compare, unit_digests
    from subnetdp.train.loop import train_loop
    from subnetdp.train.setup import setup
    from subnetdp.launchers import detect
    from subnetdp.core.plugins import PluginManager

    task = TASKS[args.task]
    extra = ["masker.coverage=0.5", f"recovery.verify_every={args.verify_every}", "eval.every=0", "eval.batches=1",
             "eval.bn_recalibrate_batches=0", "checkpoint.enabled=false", "train.progress=false",
             "train.log_every=1000", f"run.dir={args.run_dir}", f"run.name={args.task}-{args.verify_every}"]
    if task.data_cache:
        extra.append(f"data.cache_dir={CACHE}")
    pm = PluginManager()
    cfg = load_config(task.recipe, task.overrides_for(args.steps, extra), pm.registries)
    ctx, st = setup(cfg, detect(), pm)
    comm = ctx.comm
    try:
        comm.barrier()
        t0 = time.perf_counter()
        result = train_loop(ctx, st)  # the last step evaluates one batch in both runs alike
        loop_s = time.perf_counter() - t0
        times = []
        for _ in range(args.reps):
            comm.barrier()  # collective: every rank starts the verification together, as at a step boundary
            t0 = time.perf_counter()
            mine = unit_digests(st.model, st.optimizer, st.pmap, st.partition, st.plan, comm.rank)
            verdict = compare(comm, st.plan, mine)  # collective
            times.append(time.perf_counter() - t0)
        hashed = sum(t.numel() * t.element_size() for t in st.model.parameters())
        hashed += sum(v.numel() * v.element_size() for s in st.optimizer.state.values() for v in s.values()
                      if hasattr(v, "numel"))
        mine = {"verify_s": min(times), "hashed_bytes": hashed, "mismatches": len(verdict.mismatches),
                "units": verdict.units}
        ranks = comm.all_gather_object(mine)  # collective
        if comm.rank == 0:
            steps = [r["step_time_s"] for r in result.summary["ranks"]]
            out = {"task": args.task, "verify_every": args.verify_every, "steps": args.steps,
                   "loop_s_per_step": loop_s / args.steps, "meter_step_s": max(steps),
                   "verify_s": max(r["verify_s"] for r in ranks), "hashed_bytes": [r["hashed_bytes"] for r in ranks],
                   "mismatches": sum(r["mismatches"] for r in ranks), "units": ranks[0]["units"]}
            Path(args.out).write_text(json.dumps(out))
    finally:
        comm.shutdown()


def _run(task: str, verify_every: int, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{task}-{verify_every}.json"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(TASKS[task].world_size), __file__, "--worker",
           "--task", task, "--verify-every", str(verify_every), "--steps", str(args.steps), "--reps", str(args.reps),
           "--run-dir", str(tmp / "runs"), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"{task} verify_every={verify_every} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="resnet18,llama8")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--verify-every", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)
    unknown = [t for t in args.tasks.split(",") if t not in TASKS]
    if unknown:
        ap.error(f"--tasks {args.tasks}: unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    if args.steps < 2 or args.reps < 1:
        ap.error(f"--steps {args.steps} --reps {args.reps}: need --steps 2 or more (the first step is not timed) "
                 "and --reps 1 or more")
    from subnetdp.core.config import RecoveryConfig

    default = RecoveryConfig().verify_every
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks.split(","):
            off, every = _run(task, 0, args, Path(tmp)), _run(task, 1, args, Path(tmp))
            step = off["meter_step_s"]
            rows.append({"task": task, "workers": TASKS[task].world_size, "coverage": 0.5, "steps": args.steps,
                         "step_s": step, "loop_s_per_step_off": off["loop_s_per_step"],
                         "loop_s_per_step_every_step": every["loop_s_per_step"],
                         "verify_s_isolated": off["verify_s"],
                         "verify_s_in_run": every["loop_s_per_step"] - off["loop_s_per_step"],
                         "hashed_mib_per_rank": max(off["hashed_bytes"]) / 2**20, "units_compared": off["units"],
                         "mismatches": off["mismatches"] + every["mismatches"], "default_verify_every": default,
                         "cost_at_default": off["verify_s"] / (default * step),
                         "cost_at_default_in_run": max(0.0, every["loop_s_per_step"] - off["loop_s_per_step"])
                         / (default * step)})
    path = results_dir() / "verify_cost.json"
    path.write_text(json.dumps({"rows": rows, "command": " ".join(["benchmarks/verify_cost.py", *sys.argv[1:]])},
                               indent=1))
    print(f"{'task':10} {'step':>9} {'verify (alone)':>15} {'verify (in run)':>16} {'MiB hashed':>11} "
          f"{'cost at N=' + str(default):>14}")
    for r in rows:
        print(f"{r['task']:10} {r['step_s'] * 1000:>6.0f} ms {r['verify_s_isolated'] * 1000:>12.1f} ms "
              f"{r['verify_s_in_run'] * 1000:>13.1f} ms {r['hashed_mib_per_rank']:>11.1f} {r['cost_at_default']:>13.3%}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
