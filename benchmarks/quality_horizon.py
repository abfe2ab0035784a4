"""Does SDP's quality hold as training goes on? The gap to DDP along training, iteration- and
FLOP-matched, on the evidence study's ``llama8`` task, and the settings that might narrow it.

Every run is ``subnetdp train`` with 4 local gloo workers (``benchmarks/evidence_tasks.py``'s
``llama8``: 8-block LLaMA, BPE 4,096 on the standard library, 4 x 2 sequences of 256 tokens per step,
AdamW, cosine) at ``optim.lr=1.5e-3`` (``LR``), validated on the task's fixed held-out batches every
1/8 of the run. The learning rate, from the stored 1,024-step local-steps runs of this task
(``benchmarks/results/local_steps_llama8_1024*.json``, per-step B-SDP at C = 0.5): at the task's 3e-3
seeds 0-2 end at 5.196, 4.933, 4.876 (std 0.170); at 2.4e-3 seeds 0-1 at 4.919, 4.878; at 1.5e-3 at
4.892, 4.907 (std 0.010): the same mean as 2.4e-3 at a third of its spread, DDP measured there too
(4.580, 4.640: this study's DDP runs can be checked against them), and the FLOP-matched runs here are
longer than any stored one (1,696 to 3,392 steps), where a lower peak is the safer side.

Rows (C = 0.5, cyclic masker, unless named otherwise):

- part 1: ``DDP``; ``B-SDP``, ``N-SDP`` at DDP's steps; ``B-SDP FM``, ``N-SDP FM``, ``Bb-SDP FM``
  FLOP-matched: steps = DDP's / the measured training-FLOPs ratio (forward + backward of the ranks'
  local models over the full model's, ``FlopCounterMode`` on one real batch per rank, as the
  evidence study measures it), rounded to a multiple of 8 so the 8 evaluations land on steps. For
  forward masking that ratio equals the forward ratio; backward masking runs the full forward but
  fewer weight gradients, so its FLOP-matched run is longer than DDP's.
- part 2, FLOP-matched: ``B-SDP C=0.75 FM``; ``B-SDP resample FM`` (``masker.resample_every`` =
  ``RESAMPLE_EVERY``); backward masking is ``Bb-SDP FM`` above; the union at x1 against rescaled is
  ``eval.breakdown`` at the last evaluation of every block-level forward run (the loop gives the
  breakdown only at the last step).

Seeds outermost at ``--horizon`` DDP steps, then ``--long-horizon`` for DDP and the best
FLOP-matched row (smallest mean paired gap at the end of the first horizon, chosen once and kept in
``meta.json``) over ``--long-seeds``. Each run writes ``OUT/runs/h<H>/<row>-s<seed>.json`` (the
validation curve with the tokens seen and training FLOPs at each evaluation, wall time, the load
average before and after); a run whose JSON exists is skipped, so an interrupted study resumes::

    .venv/bin/python benchmarks/quality_horizon.py --plan                       # the matrix, no runs
    nice -n 19 .venv/bin/python benchmarks/quality_horizon.py --out DIR         # run or resume
    .venv/bin/python benchmarks/quality_horizon.py --report DIR --docs docs/quality.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import evidence  # noqa: E402
from benchmarks.evidence_tasks import TASKS, Task  # noqa: E402

TASK = TASKS["llama8"]
LR = 1.5e-3
EVALS = 8  # evaluations per run, at 1/8, 2/8, ... of its steps
# Masks re-drawn every 128 steps: 13 re-draws (seeded offsets among the family's 8 rotations) in the
# 1,696-step FM run, so every block passes through several owner sets, while AdamW, whose state
# starts fresh at every re-draw (sdp/resample.py), re-warms its second moment (beta2 = 0.95, ~20
# steps) for under a sixth of the steps. IST-style re-draws every few steps would make fresh
# optimizer state the norm.
RESAMPLE_EVERY = 128
MATCH_ON = "train_step"  # FLOP matching on forward + backward FLOPs (``flops.json`` keeps the forward ratio too)
CONFIGS: dict[str, list[str]] = {  # FLOP ratios are measured once per configuration
    "DDP": evidence.row_overrides("DDP", TASK),
    "B-SDP": evidence.row_overrides("B-SDP", TASK),
    "N-SDP": evidence.row_overrides("N-SDP", TASK),
    "Bb-SDP": evidence.row_overrides("Bb-SDP", TASK),
    "B-SDP C=0.75": ["masker.coverage=0.75", "masker.granularity=block", "masker.regime=forward"],
    "B-SDP resample": [*evidence.row_overrides("B-SDP", TASK), f"masker.resample_every={RESAMPLE_EVERY}"],
}
# Seconds per step on 2 idle cores, for --plan: DDP and B-SDP from the stored local-steps runs at
# 1,024 steps (benchmarks/results/local_steps_llama8_1024_lr15_c1.json: 0.45 and 0.23-0.30 s); the
# others scaled from B-SDP by their step-time ratios in the evidence study's llama8 runs.
SECONDS_PER_STEP = {"DDP": 0.45, "B-SDP": 0.26, "N-SDP": 0.30, "Bb-SDP": 0.31, "B-SDP C=0.75": 0.36,
                    "B-SDP resample": 0.27}
SECONDS_PER_RUN = 75.0  # start-up, 8 evaluations (11 with the breakdown), the memory-measured step


@dataclass(frozen=True)
class Row:
    """One row of the matrix: a configuration, iteration- or FLOP-matched."""

    name: str
    config: str
    flop_matched: bool
    part: int

    @property
    def breakdown(self) -> bool:  # the union at x1 and rescaled: block-level forward masking only
        return self.config.startswith("B-SDP")


ROWS = [Row("DDP", "DDP", False, 1), Row("B-SDP", "B-SDP", False, 1), Row("B-SDP FM", "B-SDP", True, 1),
        Row("N-SDP", "N-SDP", False, 1), Row("N-SDP FM", "N-SDP", True, 1), Row("Bb-SDP FM", "Bb-SDP", True, 1),
        Row("B-SDP C=0.75 FM", "B-SDP C=0.75", True, 2), Row("B-SDP resample FM", "B-SDP resample", True, 2)]
BY_NAME = {r.name: r for r in ROWS}


def config_overrides(config: str, task: Task) -> list[str]:
    """A configuration's overrides (``evidence.flop_ratios`` calls it with the configuration's name)."""
    return list(CONFIGS[config])


def run_steps(row: Row, horizon: int, flops: dict[str, dict[str, float]]) -> int:
    """DDP's ``horizon`` steps, or for a FLOP-matched row ``horizon / ratio`` to a multiple of ``EVALS``."""
    if not row.flop_matched:
        return horizon
    return max(EVALS, round(horizon / flops[row.config][MATCH_ON] / EVALS) * EVALS)


def record_path(out: Path, horizon: int, row: str, seed: int) -> Path:
    return out / "runs" / f"h{horizon}" / f"{row.replace(' ', '_')}-s{seed}.json"


def run_one(row: Row, seed: int, horizon: int, out: Path, flops: dict[str, dict[str, float]]) -> dict | None:
    """One ``subnetdp train`` run and its record (None if it failed: the stderr tail is kept beside)."""
    path = record_path(out, horizon, row.name, seed)
    if path.is_file():
        return json.loads(path.read_text())
    steps = run_steps(row, horizon, flops)
    name = f"h{horizon}-{row.name.replace(' ', '_').replace('=', '')}-s{seed}"
    rundir = out / "rundirs" / name
    shutil.rmtree(rundir, ignore_errors=True)  # a run cut short leaves a partial metrics.jsonl
    extra = [*CONFIGS[row.config], f"optim.lr={LR:g}", f"seed={seed}", f"run.dir={out / 'rundirs'}",
             f"run.name={name}", *evidence._cache(TASK), "train.progress=false", "checkpoint.enabled=false",
             "run.tensorboard=false", f"eval.every={steps // EVALS}", f"train.log_every={max(1, steps // 32)}"]
    if row.breakdown:
        extra.append("eval.breakdown=true")
    cmd = TASK.command(extra, steps=steps)
    load_start, t0 = os.getloadavg(), time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    wall, load_end = time.perf_counter() - t0, os.getloadavg()
    if proc.returncode != 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".failed.txt").write_text(f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stderr[-8000:]}")
        return None
    rec = read_run(rundir, row, seed, horizon, steps, flops)
    rec.update({"command": " ".join(["subnetdp", *cmd[1:]]), "wall_s": wall, "load_avg_start": list(load_start),
                "load_avg_end": list(load_end), "nice": os.nice(0)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))
    path.with_suffix(".failed.txt").unlink(missing_ok=True)
    return rec


def read_run(rundir: Path, row: Row, seed: int, horizon: int, steps: int, flops: dict[str, dict[str, float]]) -> dict:
    """The record of a finished run directory: curves in tokens seen and training FLOPs."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(rundir / "config.yaml")
    world = int(cfg.launch.nproc)
    tokens_per_step = world * int(cfg.train.batch_size) * int(cfg.train.grad_accum) * int(cfg.data.seq_len)
    flops_per_step = world * int(cfg.train.grad_accum) * flops[row.config]["train_step_flops"]
    summary = json.loads((rundir / "summary.json").read_text())
    lines = [json.loads(line) for line in (rundir / "metrics.jsonl").read_text().splitlines()]
    metric = f"eval/{TASK.metric}"
    curve = [{"step": r["step"], "loss": r[metric], "tokens": r["step"] * tokens_per_step,
              "train_flops": r["step"] * flops_per_step} for r in lines if metric in r]
    ranks = summary["ranks"]
    return {"task": TASK.name, "row": row.name, "config": row.config, "part": row.part,
            "flop_matched": row.flop_matched, "seed": seed, "horizon": horizon, "steps": steps, "lr": LR,
            "flops": flops[row.config], "flops_ddp": flops["DDP"], "tokens_per_step": tokens_per_step,
            "train_flops_per_step": flops_per_step, "curve": curve, "eval": summary["eval"],
            "train_curve": [(r["step"], r["train/loss"]) for r in lines if "train/loss" in r],
            "eval_union": summary.get("eval_union", {}), "step_time_s": [r["step_time_s"] for r in ranks],
            "owned_units": [r["owned_units"] for r in ranks]}


def measured_flops(out: Path) -> dict[str, dict[str, float]]:
    """Every configuration's FLOP ratios, measured once per results folder (``flops.json``)."""
    path = out / "flops.json"
    if path.is_file():
        return json.loads(path.read_text())
    flops = evidence.flop_ratios(TASK, list(CONFIGS), overrides=config_overrides)
    path.write_text(json.dumps(flops, indent=1))
    return flops


def matrix(args: argparse.Namespace, flops: dict[str, dict[str, float]], long_row: str | None) -> list[tuple]:
    """``(horizon, row, seed)`` in run order: seeds outermost, the first horizon's seeds first."""
    rows = [BY_NAME[r] for r in args.rows]
    runs = [(args.horizon, row, seed) for seed in args.seeds for row in rows]
    if args.long_horizon and long_row:
        runs += [(args.long_horizon, BY_NAME[name], seed) for seed in args.long_seeds for name in ("DDP", long_row)]
    return runs


def estimate_s(row: Row, horizon: int, flops: dict[str, dict[str, float]]) -> float:
    return run_steps(row, horizon, flops) * SECONDS_PER_STEP[row.config] + SECONDS_PER_RUN


def choose_long_row(out: Path, args: argparse.Namespace, meta: dict) -> str | None:
    """The row the long horizon runs beside DDP: ``--long-row``, the stored choice, or the FLOP-matched
    row with the smallest mean paired gap at the end of the first horizon (chosen once, then kept)."""
    from benchmarks.quality_report import best_flop_matched, load

    if args.long_row or meta.get("long_row"):
        return args.long_row or meta["long_row"]
    best = best_flop_matched(load(out).get(args.horizon, {}))
    if best is not None:
        meta["long_row"], meta["long_row_chosen"] = best, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return best


def run_study(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    evidence._CACHE[0] = str(Path(args.cache or out / "data").resolve())
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta.update({"task": TASK.name, "lr": LR, "evals": EVALS, "resample_every": RESAMPLE_EVERY, "match_on": MATCH_ON,
                 "horizon": args.horizon, "long_horizon": args.long_horizon, "seeds": args.seeds,
                 "long_seeds": args.long_seeds, "rows": args.rows, "platform": platform.platform(),
                 "cpus": os.cpu_count(), "finished": False})
    sittings = meta.setdefault("sittings", [])
    sittings.append({"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv[1:],
                     "pid": os.getpid(), "nice": os.nice(0)})
    meta_path.write_text(json.dumps(meta, indent=1))
    t0 = time.perf_counter()
    flops = measured_flops(out)
    failed = 0
    for phase_long in (False, True):
        long_row = choose_long_row(out, args, meta) if phase_long else None
        meta_path.write_text(json.dumps(meta, indent=1))
        for horizon, row, seed in matrix(args, flops, long_row):
            if (horizon == args.long_horizon) != phase_long:
                continue
            rec = run_one(row, seed, horizon, out, flops)
            if rec is None:
                failed += 1
                failure = record_path(out, horizon, row.name, seed).with_suffix(".failed.txt")
                print(f"h{horizon} {row.name:18} seed {seed}  FAILED (see {failure})", flush=True)
                continue
            print(f"h{horizon} {row.name:18} seed {seed}  {rec['steps']:5} steps  {rec['wall_s']:6.0f} s  "
                  f"loss {rec['eval'].get('loss', float('nan')):.4f}  load {rec['load_avg_start'][0]:.1f}"
                  f"->{rec['load_avg_end'][0]:.1f}", flush=True)
            sittings[-1]["wall_s"] = time.perf_counter() - t0
            meta_path.write_text(json.dumps(meta, indent=1))
    sittings[-1]["wall_s"] = time.perf_counter() - t0
    meta["finished"] = failed == 0
    meta_path.write_text(json.dumps(meta, indent=1))
    return 1 if failed else 0


def print_plan(args: argparse.Namespace) -> None:
    """The matrix with its steps and expected seconds on 2 idle cores (the long row assumed if not chosen)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    evidence._CACHE[0] = str(Path(args.cache or out / "data").resolve())
    flops = measured_flops(out)
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").is_file() else {}
    long_row = args.long_row or meta.get("long_row") or "B-SDP FM"
    total = 0.0
    print(f"{'horizon':>7} {'row':18} {'seed':>4} {'steps':>6} {'ratio':>6} {'est. s':>7}")
    for horizon, row, seed in matrix(args, flops, long_row):
        est = estimate_s(row, horizon, flops)
        total += est
        done = " done" if record_path(out, horizon, row.name, seed).is_file() else ""
        print(f"{horizon:>7} {row.name:18} {seed:>4} {run_steps(row, horizon, flops):>6} "
              f"{flops[row.config][MATCH_ON]:>6.3f} {est:>7.0f}{done}")
    print(f"expected: {total:.0f} s = {total / 3600:.2f} h on 2 idle cores"
          + ("" if args.long_row or meta.get("long_row") else f" (long row assumed {long_row})"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="results folder (runs, flops.json, meta.json, rundirs/, data/)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--horizon", type=int, default=1024, help="DDP steps of the first horizon")
    parser.add_argument("--long-horizon", type=int, default=2048, help="DDP steps of the second (0: none)")
    parser.add_argument("--long-seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--long-row", choices=[r.name for r in ROWS if r.flop_matched],
                        help="the row run at the long horizon beside DDP (default: the best at the first horizon)")
    parser.add_argument("--rows", nargs="+", default=[r.name for r in ROWS], choices=[r.name for r in ROWS])
    parser.add_argument("--cache", help="data.cache_dir of every run (default OUT/data)")
    parser.add_argument("--plan", action="store_true", help="print the matrix and its expected time, run nothing")
    parser.add_argument("--report", metavar="DIR", help="only render the report from DIR's stored results")
    parser.add_argument("--docs", metavar="MD", help="with --report: splice it into this Markdown file, figures beside")
    args = parser.parse_args(argv)
    if "DDP" not in args.rows:
        parser.error("--rows: DDP is every gap's reference; keep it in the list")
    from benchmarks.quality_report import write_report

    if args.report:
        write_report(Path(args.report), Path(args.docs) if args.docs else None)
        return 0
    if not args.out:
        parser.error("--out DIR is needed to run (or --report DIR to render)")
    if args.plan:
        print_plan(args)
        return 0
    rc = run_study(args)
    write_report(Path(args.out))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
