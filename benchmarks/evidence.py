"""The evidence study: does SDP keep quality? DDP, its same-keep-rate regularisers and the four SDP
variants, iteration- and FLOP-matched, over seeds, through ``subnetdp train`` (real gloo workers).

Tasks (``benchmarks/evidence_tasks.py``): ``llama8`` (8-block LLaMA, BPE 4,096 on the standard
library, sequence 256) and ``resnet18`` (ResNet-18 on digits at 32 x 32). Rows, at coverage C = 0.5:

- ``DDP``: C = 1. ``DDP+SD``: C = 1 with ``model.stochastic_depth = 1 - C`` (the residual branches
  SDP's block level masks, keep rate C). ``DDP+HD``: C = 1 with ``model.hidden_dropout = 1 - C`` (the
  hidden channels neuron level masks, keep rate C).
- ``B-SDP``, ``N-SDP``, ``Bb-SDP``, ``Nb-SDP``: at DDP's number of steps, and FLOP-matched: steps
  scaled by the measured forward-FLOPs ratio of the ranks' local models to the full model
  (``FlopCounterMode`` on one real batch). Where the ratio is 1 (backward masking runs the full
  forward; stochastic depth and dropout compute every branch), the FLOP-matched row is the same run.
- ``DDP+AC`` and ``FSDP+AC`` (``fsdp.shard_size`` = world, ``train.activation_checkpointing=1``):
  memory and bytes only (their updates equal DDP's), a few steps, one seed.

Every run writes ``OUT/runs/<task>/<row>-s<seed>.json``; the report (``OUT/report.md``: tables with
mean ± sample standard deviation over seeds, the union breakdown, the gradient-alignment probe and a
verdict per claim) and the plots are made from those files alone, so::

    .venv/bin/python benchmarks/evidence.py --quick                      # ~5 min subset
    .venv/bin/python benchmarks/evidence.py --out /tmp/evidence-full     # the study (~90 min on 2 idle cores)
    .venv/bin/python benchmarks/evidence.py --report /tmp/evidence-full --docs docs/evidence.md

the last one rebuilds the report from any results folder and rewrites the generated part of
``docs/evidence.md`` (between its ``<!-- evidence:begin -->`` / ``<!-- evidence:end -->`` markers).
A run whose JSON exists is not run again (``--fresh`` re-runs), so an interrupted study resumes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.evidence_tasks import TASKS, Task  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
C = 0.5
SEEDS = (0, 1, 2)
SDP_ROWS = {"B-SDP": ("block", "forward"), "N-SDP": ("neuron", "forward"),
            "Bb-SDP": ("block", "backward"), "Nb-SDP": ("neuron", "backward")}
MEMORY_ROWS = ("DDP+AC", "FSDP+AC")
MEMORY_STEPS = 4


def row_overrides(row: str, task: Task) -> list[str]:
    """The overrides that make ``row`` of the matrix (FLOP matching only changes the step count)."""
    base = row.removesuffix(" FM")
    if base == "DDP":
        return ["masker.coverage=1"]
    if base == "DDP+SD":
        return ["masker.coverage=1", f"model.stochastic_depth={1 - C:g}"]
    if base == "DDP+HD":
        return ["masker.coverage=1", f"model.hidden_dropout={1 - C:g}"]
    if base == "DDP+AC":
        return ["masker.coverage=1", "train.activation_checkpointing=1"]
    if base == "FSDP+AC":
        return ["masker.coverage=1", "train.activation_checkpointing=1", f"fsdp.shard_size={task.world_size}"]
    gran, regime = SDP_ROWS[base]
    return [f"masker.coverage={C:g}", f"masker.granularity={gran}", f"masker.regime={regime}"]


def flop_ratios(task: Task, rows: list[str], overrides: Any = None) -> dict[str, dict[str, float]]:
    """Forward (and forward + backward) FLOPs of the ranks' local models relative to the full model,
    mean over ranks, measured with ``FlopCounterMode`` on one real training batch of each rank.

    ``overrides(row, task)`` gives a row's overrides (default :func:`row_overrides`; another study
    passes its own rows). Each row also gets its absolute figures, ``forward_flops`` and
    ``train_step_flops``: one rank's forward, and forward + backward, on one batch (mean over ranks).
    """
    overrides = overrides or row_overrides
    import torch
    from subnetdp.sdp.flops import step_flops
    from subnetdp.train.configure import load_config
    from subnetdp.train.setup import build_plan
    from subnetdp.core.plugins import PluginManager
    from subnetdp.sdp.variants import local_model

    pm = PluginManager()
    out: dict[str, dict[str, float]] = {}
    full_fwd = full_train = None
    for row in ["DDP"] + [r for r in rows if r != "DDP"]:
        cfg = load_config(task.recipe, task.overrides_for(1, overrides(row, task) + _cache(task)),
                          pm.registries)
        data, spec, adapter, full, partition, plan = build_plan(cfg, task.world_size, pm)
        fwd, train = [], []
        for rank in range(task.world_size):
            with torch.device("meta"):  # modules made while narrowing stay on meta too
                model, _ = local_model(adapter, copy.deepcopy(full), plan.owned[rank], partition, cfg.masker)
            batch = next(iter(data.train_loader(rank, task.world_size, int(cfg.train.batch_size))))
            # The full model, hence the local one, lives on ``meta``: nothing is computed, and the
            # counts are those of the real batch's shapes (the same count as subnetdp plan's).
            batch = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in batch)
            forward, step = step_flops(adapter, model, batch)
            fwd.append(forward)
            train.append(step)
        f_mean, t_mean = sum(fwd) / len(fwd), sum(train) / len(train)
        if row == "DDP":
            full_fwd, full_train = f_mean, t_mean
        out[row] = {"forward": f_mean / full_fwd, "train_step": t_mean / full_train, "forward_flops": f_mean,
                    "train_step_flops": t_mean}
    return out


_CACHE = [""]  # data.cache_dir shared by every run of one invocation


def _cache(task: Task) -> list[str]:
    return [f"data.cache_dir={_CACHE[0]}"] if task.data_cache else []


def run_one(task: Task, row: str, seed: int, steps: int, out: Path, flop: dict[str, float], fresh: bool,
            quick: bool = False) -> dict:
    """One ``subnetdp train`` run; its JSON record (read back from the run directory)."""
    path = out / "runs" / task.name / f"{row.replace(' ', '_')}-s{seed}.json"
    if path.is_file() and not fresh:
        return json.loads(path.read_text())
    name = f"{task.name}-{row.replace(' ', '_').replace('+', 'p')}-s{seed}"
    base = row.removesuffix(" FM")
    memory_only = base in MEMORY_ROWS
    base_steps, every = (task.quick_steps, task.quick_eval_every) if quick else (task.steps, task.eval_every)
    eval_every = 0 if memory_only else max(1, round(every * steps / base_steps))
    extra = [*row_overrides(row, task), f"seed={seed}", f"run.dir={out / 'rundirs'}", f"run.name={name}",
             *_cache(task), "train.progress=false", "checkpoint.enabled=false", "run.tensorboard=false",
             f"eval.every={eval_every}", f"train.log_every={max(1, eval_every or steps)}"]
    if base in ("B-SDP",):
        extra.append("eval.breakdown=true")
    if base in SDP_ROWS and not row.endswith(" FM"):
        extra.append(f"train.grad_alignment_every={max(2, steps // 4)}")
    cmd = task.command(extra, steps=steps)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rundir = out / "rundirs" / name
    summary = json.loads((rundir / "summary.json").read_text())
    records = [json.loads(line) for line in (rundir / "metrics.jsonl").read_text().splitlines()]
    ranks = summary["ranks"]
    rec = {"task": task.name, "row": row, "seed": seed, "steps": steps, "flops": flop, "wall_s": wall,
           "command": " ".join(["subnetdp", *cmd[1:]]), "eval": summary["eval"],
           "curve": [(r["step"], r[f"eval/{task.metric}"]) for r in records if f"eval/{task.metric}" in r],
           "train_curve": [(r["step"], r["train/loss"]) for r in records if "train/loss" in r],
           "peak_memory_bytes": [r["peak_memory_bytes"] for r in ranks],
           "params_held": [r["params_held"] for r in ranks], "full_model_params": summary["full_model_params"],
           "bytes_sent_per_step": [r["bytes_sent_per_step"] for r in ranks],
           "step_time_s": [r["step_time_s"] for r in ranks], "owned_units": [r["owned_units"] for r in ranks],
           "memory_measured_by": ranks[0]["memory_measured_by"], "eval_union": summary.get("eval_union", {}),
           "grad_alignment": summary.get("grad_alignment", []), "memory_only": memory_only,
           "load_avg": os.getloadavg()[0]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))
    return rec


def plan_rows(quick: bool) -> list[str]:
    return ["DDP", "DDP+SD", "DDP+HD", *SDP_ROWS]


def run_study(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _CACHE[0] = str(Path(args.cache).resolve())
    seeds = SEEDS[:1] if args.quick else tuple(args.seeds)
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "quick": args.quick, "seeds": list(seeds),
            "coverage": C, "platform": platform.platform(), "cpus": os.cpu_count(), "argv": sys.argv[1:]}
    meta_path = out / "meta.json"
    old = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta_path.write_text(json.dumps({**meta, "wall_s_total": old.get("wall_s_total", 0.0), "finished": False}, indent=1))
    t_start = time.perf_counter()
    tasks = [TASKS[t] for t in args.tasks]
    flops: dict[str, dict] = {}
    for task in tasks:
        flops_path = out / "runs" / task.name / "flops.json"
        if flops_path.is_file() and not args.fresh:
            flops[task.name] = json.loads(flops_path.read_text())
        else:
            flops[task.name] = flop_ratios(task, plan_rows(args.quick))
            flops_path.parent.mkdir(parents=True, exist_ok=True)
            flops_path.write_text(json.dumps(flops[task.name], indent=1))
    # Seeds outermost: an interrupted study holds whole seeds of every task, not one task's seeds.
    for i, seed in enumerate(seeds):
        for task in tasks:
            steps = max(1, round((task.quick_steps if args.quick else task.steps) * args.steps_scale))
            for row in plan_rows(args.quick):
                ratio = flops[task.name][row]["forward"]
                rec = run_one(task, row, seed, steps, out, flops[task.name][row], args.fresh, args.quick)
                print(f"{task.name:9} {row:8} seed {seed}  {rec['steps']:4} steps  {rec['wall_s']:6.0f} s  "
                      f"{task.metric} {rec['eval'].get(task.metric, float('nan')):.4f}", flush=True)
                if row in SDP_ROWS and ratio < 0.999:  # FLOP-matched: more steps for the cheaper forward
                    fm = run_one(task, row + " FM", seed, max(1, round(steps / ratio)), out, flops[task.name][row],
                                 args.fresh, args.quick)
                    print(f"{task.name:9} {row + ' FM':8} seed {seed}  {fm['steps']:4} steps  {fm['wall_s']:6.0f} s  "
                          f"{task.metric} {fm['eval'].get(task.metric, float('nan')):.4f}", flush=True)
            if i == 0:
                for row in MEMORY_ROWS:
                    run_one(task, row, 0, MEMORY_STEPS, out, {"forward": 1.0, "train_step": float("nan")}, args.fresh)
                    print(f"{task.name:9} {row:8} (memory and bytes, {MEMORY_STEPS} steps)", flush=True)
    meta["wall_s"] = time.perf_counter() - t_start
    meta["finished"] = True
    meta["wall_s_total"] = meta["wall_s"] + (old.get("wall_s_total", 0.0) if not args.fresh else 0.0)
    meta_path.write_text(json.dumps(meta, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, a few steps per run (~5 min)")
    parser.add_argument("--out", help="results folder (default benchmarks/results/evidence[_quick])")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply every task's step count")
    parser.add_argument("--cache", default=str(ROOT / "runs" / "data"), help="data.cache_dir of every run")
    parser.add_argument("--fresh", action="store_true", help="re-run runs whose JSON exists")
    parser.add_argument("--report", metavar="DIR", help="only rebuild the report and plots from DIR")
    parser.add_argument("--docs", metavar="MD", help="also rewrite the generated part of this Markdown file")
    args = parser.parse_args()
    from benchmarks.evidence_report import write_report

    if args.report:
        write_report(Path(args.report), Path(args.docs) if args.docs else None)
        return 0
    args.out = args.out or str(RESULTS / ("evidence_quick" if args.quick else "evidence"))
    run_study(args)
    write_report(Path(args.out), Path(args.docs) if args.docs else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
