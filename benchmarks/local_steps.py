"""Local steps (``sync.mode=local_steps``) against per-step synchronisation: LLaMA tiny, 4 gloo workers.

Task (``--task tiny``, the default): the recipe ``llama_tiny_stdlib`` (LLaMA ``tiny``, byte
tokenizer, the Python standard library's source, AdamW 3e-3 with warm-up and cosine, clipping 1.0),
batch 8 x 128 tokens per rank, 4 local gloo workers, block level. ``--task llama8`` runs the same
rows on the evidence study's 8-block LLaMA (``benchmarks/evidence_tasks.py``, its own batch and
validation set). Runs, all at the same number of inner steps and the same per-rank batch:

- DDP: coverage 1, synchronised every step (subnetdp at C = 1 is DDP: tested against torch's DDP);
- SDP C = 0.5 every step;
- SDP C = 0.5 with local steps and plain averaging of the owners' parameters (outer lr 1, momentum
  0: the default) at H = 1 (``sync.every``: the inner optimizer on local gradients alone, averaged
  every step), 4, 16 and 64;
- SDP C = 0.5 with local steps, H = 4, 16, 64, with outer SGD with Nesterov momentum at DiLoCo's
  values (``sync.outer_lr=0.7``, ``sync.outer_momentum=0.9``);
- the control, DDP with local steps (coverage 1, H = 16, plain averaging), whose paired gap is to
  DDP: what the interval costs without SDP;
- ``--warm-start S`` adds, for each H of ``--warm-every`` (4, 8, 16), DiLoCo's recipe: S steps of
  per-step synchronisation (``sync.warmup_steps``), then local steps with the outer Nesterov at
  0.7 / 0.9, as SDP C = 0.5 and as DDP (C = 1, whose paired gap is to DDP): what local steps cost
  without SDP, and what SDP adds to it;
- ``--outer [H:]LR:MOMENTUM ...`` adds rows of other outer settings (the sweep in
  ``docs/local_steps.md``), ``--every-step-lr LR ...`` per-step SDP rows at other inner learning
  rates (the control for a damped outer step).

Each over ``--seeds`` seeds (the seed draws the initial weights and the data order). Reported: the
union model's validation loss after the last step (mean ± sample std over seeds), bytes handed to
collectives per step (the meter's payload, averaged over the run, so over the H-step cycles) relative
to DDP, time per step measured here, and a projected time per step on a 1 and a 10 Gbit/s link:

    t(link) = t_measured + wire_bytes_per_step * 8 / bandwidth + collectives_per_step * latency

with ``wire_bytes_per_step`` the ring all-reduce estimate ``2 (k - 1) / k x payload`` per owner group
(``wire_bytes_per_step_ring`` of ``summary.json``), ``collectives_per_step`` the owner groups a rank
all-reduces over per synchronisation (one bucket each at this size) divided by H, plus the gradient
norm's all-reduce at every step for per-step SDP below C = 1, and ``latency`` = ``--latency-us``
(default 100 us). ``t_measured`` already contains the local gloo traffic of these processes, so the
projection slightly over-counts communication; every figure is the mean over ranks and seeds.

Each row's gap to per-step SDP is also given paired over seeds (mean ± std of the per-seed
differences: a seed draws both runs' initial weights and data order), to per-step SDP except for
the control, whose gap is to DDP.

Run: ``.venv/bin/python benchmarks/local_steps.py [--steps 1024] [--seeds 3]`` (30 runs of 1.5-2.5
minutes on 2 idle cores, about an hour; ``--steps 256`` gave ``results/local_steps_256.json``).
Writes ``benchmarks/results/local_steps.json`` (``--out`` another name), and after every run a
``.partial`` file with the runs so far.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.evidence_tasks import TASKS as EVIDENCE_TASKS, Task  # noqa: E402

# The default task: the tiny LLaMA recipe at 8 x 128 tokens per rank (the table in docs/local_steps.md).
TINY = Task(name="tiny", recipe="llama_tiny_stdlib",
            overrides=("train.batch_size=8", "eval.batches=20", "launch.threads_per_rank=1"),
            metric="loss", higher_is_better=False, world_size=4, steps=1024, quick_steps=16, eval_every=0,
            description="LLaMA tiny on the stdlib, 8 x 128 tokens per rank")
TASKS = {"tiny": TINY, **EVIDENCE_TASKS}

RESULTS = Path(__file__).parent / "results"
NESTEROV = ["sync.outer_lr=0.7", "sync.outer_momentum=0.9"]  # DiLoCo's values
PLAIN = ["sync.outer_lr=1", "sync.outer_momentum=0"]  # the default: plain averaging of the owners' parameters
LOCAL = ["masker.coverage=0.5", "sync.mode=local_steps"]
RUNS = {  # label: overrides
    "DDP (C=1)": ["masker.coverage=1"],
    "SDP C=0.5, every step": ["masker.coverage=0.5"],
    # H = 1 with plain averaging: what changes when the inner optimizer steps on local gradients alone.
    "SDP C=0.5, H=1, avg": [*LOCAL, "sync.every=1", *PLAIN],
    **{f"SDP C=0.5, H={h}, avg": [*LOCAL, f"sync.every={h}", *PLAIN] for h in (4, 16, 64)},
    **{f"SDP C=0.5, H={h}, Nesterov": [*LOCAL, f"sync.every={h}", *NESTEROV] for h in (4, 16, 64)},
    # The control: local steps without SDP, to tell the interval's cost from its composition with SDP.
    "DDP (C=1), H=16, avg": ["masker.coverage=1", "sync.mode=local_steps", "sync.every=16", *PLAIN],
}
EVERY_STEP = "SDP C=0.5, every step"
BASELINE = {"DDP (C=1), H=16, avg": "DDP (C=1)"}  # a row's paired gap is to this row (default: EVERY_STEP)


def run(label: str, overrides: list[str], seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    name = f"{label}-s{seed}".replace(" ", "").replace(",", "-").replace("=", "").replace("(", "").replace(")", "")
    extra = [*args.set, *overrides, f"seed={seed}", f"launch.nproc={args.workers}", "launch.threads_per_rank=1",
             "eval.every=0", f"train.log_every={args.steps}", "checkpoint.enabled=false", f"run.dir={tmp}",
             f"run.name={name}", f"data.cache_dir={args.cache}", "train.progress=false"]
    if args.batch_size:
        extra.append(f"train.batch_size={args.batch_size}")
    if args.eval_batches:
        extra.append(f"eval.batches={args.eval_batches}")
    cmd = TASKS[args.task].command(extra, steps=args.steps)  # the task's overrides, then these (later win)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    summary = json.loads((tmp / name / "summary.json").read_text())
    ranks = summary["ranks"]
    h = int(ranks[0].get("sync_every", 1)) if ranks[0]["sync_mode"] == "local_steps" else 1
    groups = statistics.mean(sum(1 for g in r["bytes_by_group"].values() if g["k"] > 1) for r in ranks)
    every_step = ranks[0]["sync_mode"] != "local_steps"  # local steps clip by the rank's own norm: no collective
    norm = 1 if every_step and any(g["k"] < args.workers for g in ranks[0]["bytes_by_group"].values()) else 0
    return {"label": label, "seed": seed, "command": " ".join(cmd[1:]), "wall_s": wall, "eval": summary["eval"],
            "sync_every": h, "bytes_per_step": statistics.mean(r["bytes_sent_per_step"] for r in ranks),
            "wire_bytes_per_step": statistics.mean(r["wire_bytes_per_step_ring"] for r in ranks),
            "step_time_s": statistics.mean(r["step_time_s"] for r in ranks),
            "collectives_per_step": groups / h + norm, "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
            "outer_state_bytes": ranks[0].get("outer_state_bytes", 0)}


def task_batch(task: str, batch_size: int | None) -> int:
    """The per-rank batch a run of ``task`` uses: ``--batch-size``, else the task's own."""
    own = [int(o.split("=", 1)[1]) for o in TASKS[task].overrides if o.startswith("train.batch_size=")]
    return batch_size or own[-1]


def projected(r: dict, gbit: float, latency_s: float) -> float:
    return r["step_time_s"] + r["wire_bytes_per_step"] * 8 / (gbit * 1e9) + r["collectives_per_step"] * latency_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--task", default="tiny", choices=list(TASKS),
                        help="tiny: llama_tiny_stdlib (the table in docs/local_steps.md); llama8: the evidence study's "
                             "8-block LLaMA (benchmarks/evidence_tasks.py)")
    parser.add_argument("--batch-size", type=int, default=None, help="per-rank batch (default: the task's own)")
    parser.add_argument("--eval-batches", type=int, default=None, help="validation batches (default: the task's own)")
    parser.add_argument("--latency-us", type=float, default=100.0)
    parser.add_argument("--only", nargs="*", help="labels to run (default: all)")
    parser.add_argument("--out", default="local_steps.json", help="file name in benchmarks/results/")
    parser.add_argument("--reuse", type=Path, default=None, metavar="JSON",
                        help="a results file (or its .partial) of the same task and steps: its runs are kept, only "
                             "the missing (row, seed) pairs run; e.g. --seeds 5 --reuse results/local_steps.json")
    parser.add_argument("--outer", nargs="*", default=[], metavar="[H:]LR:MOMENTUM",
                        help="extra rows with these outer settings (a sweep; H = 16 unless given), labelled "
                             "'SDP C=0.5, H=H, lr LR m M'")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides on top of the task for every row (a row's own overrides win), e.g. "
                             "--set optim.lr=1.5e-3; part of the task for --reuse")
    parser.add_argument("--every-step-lr", nargs="*", type=float, default=[], metavar="LR",
                        help="extra per-step SDP rows at these inner learning rates (optim.lr), labelled "
                             "'SDP C=0.5, every step, lr LR': does a damped outer step only lower the learning rate?")
    parser.add_argument("--warm-start", type=int, default=0, metavar="S",
                        help="DiLoCo rows: S per-step synchronised steps (sync.warmup_steps), then local steps with "
                             "the outer Nesterov 0.7/0.9, SDP C=0.5 and DDP (C=1), for each H of --warm-every")
    parser.add_argument("--warm-every", nargs="*", type=int, default=[4, 8, 16], metavar="H")
    args = parser.parse_args(argv)

    def add_row(label: str, overrides: list[str]) -> None:  # a row asked for by a flag also runs under --only
        RUNS[label] = overrides
        if args.only is not None:
            args.only.append(label)

    for h in args.warm_every if args.warm_start else []:
        warm = [f"sync.every={h}", f"sync.warmup_steps={args.warm_start}", *NESTEROV]
        add_row(f"SDP C=0.5, H={h}, warm {args.warm_start}, Nesterov", [*LOCAL, *warm])
        ddp = f"DDP (C=1), H={h}, warm {args.warm_start}, Nesterov"
        add_row(ddp, ["masker.coverage=1", "sync.mode=local_steps", *warm])
        BASELINE[ddp] = "DDP (C=1)"
    for lr in args.every_step_lr:
        add_row(f"{EVERY_STEP}, lr {lr:g}", ["masker.coverage=0.5", f"optim.lr={lr:g}"])
    for spec in args.outer:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            parser.error(f"--outer {spec}: expected LR:MOMENTUM or H:LR:MOMENTUM, e.g. 16:0.3:0.7")
        h, lr, mom = parts if len(parts) == 3 else ["16", *parts]
        add_row(f"SDP C=0.5, H={h}, lr {lr} m {mom}",
                [*LOCAL, f"sync.every={h}", f"sync.outer_lr={lr}", f"sync.outer_momentum={mom}"])
    args.done = {}
    if args.reuse:
        old = json.loads(args.reuse.read_text())
        theirs = (old.get("task", "tiny"), old.get("steps", args.steps),
                  task_batch(old.get("task", "tiny"), old.get("batch_size")), old.get("set", []))
        mine = (args.task, args.steps, task_batch(args.task, args.batch_size), args.set)
        if theirs != mine:
            parser.error(f"--reuse {args.reuse}: task {theirs[0]}, {theirs[1]} steps, batch {theirs[2]}, --set "
                         f"{theirs[3]}; this run is task {mine[0]}, {mine[1]} steps, batch {mine[2]}, --set {mine[3]} "
                         "(--task, --steps, --batch-size, --set)")
        args.done = {(r["label"], r["seed"]): r for r in old["runs"]}
    return args


def collect(args: argparse.Namespace) -> list[dict]:
    """Every (row, seed) run: reused from ``--reuse`` or run now, seeds outermost."""
    raw: list[dict] = []
    partial = RESULTS / (args.out + ".partial")
    with tempfile.TemporaryDirectory() as tmp:
        args.cache = Path(tmp) / "data"
        for seed in range(args.seeds):  # seeds outermost: an interrupted run still has whole seeds
            for label, ov in RUNS.items():
                if (label, seed) in args.done:
                    raw.append(args.done[(label, seed)])
                    continue
                if args.only and label not in args.only:
                    continue
                raw.append(run(label, ov, seed, args, Path(tmp)))
                print(f"{label} seed {seed}: val loss {raw[-1]['eval']['loss']:.4f}, {raw[-1]['wall_s']:.0f} s",
                      flush=True)
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps({"task": args.task, "steps": args.steps, "runs": raw}, indent=2))
    return raw


def summarise(raw: list[dict], latency_s: float) -> dict[str, dict]:
    """One row per label: means over seeds, ratios to DDP and per-step SDP, the gap paired over seeds."""
    rows: dict[str, dict] = {}
    for label in RUNS:
        mine = [r for r in raw if r["label"] == label]
        if not mine:
            continue
        losses = [r["eval"]["loss"] for r in mine]
        mean = lambda k: statistics.mean(r[k] for r in mine)  # noqa: E731
        rows[label] = {"seeds": sorted(r["seed"] for r in mine), "val_loss_mean": statistics.mean(losses),
                       "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                       "bytes_per_step": mean("bytes_per_step"), "wire_bytes_per_step": mean("wire_bytes_per_step"),
                       "step_time_s": mean("step_time_s"), "collectives_per_step": mean("collectives_per_step"),
                       "outer_state_bytes": mine[0]["outer_state_bytes"],
                       "peak_memory_bytes": max(r["peak_memory_bytes"] for r in mine)}
        for gbit in (1, 10):
            rows[label][f"projected_step_s_{gbit}gbit"] = statistics.mean(projected(r, gbit, latency_s) for r in mine)
    ddp, every = rows.get("DDP (C=1)"), rows.get(EVERY_STEP)
    for label, r in rows.items():
        r["bytes_vs_ddp"] = r["bytes_per_step"] / ddp["bytes_per_step"] if ddp else float("nan")
        if every:
            r["val_loss_minus_every_step"] = r["val_loss_mean"] - every["val_loss_mean"]
            r["bytes_vs_every_step"] = r["bytes_per_step"] / every["bytes_per_step"]
        # Paired over seeds: a seed draws the initial weights and the data order of both runs.
        r["gap_to"] = BASELINE.get(label, EVERY_STEP)
        base = {x["seed"]: x["eval"]["loss"] for x in raw if x["label"] == r["gap_to"]}
        gaps = {x["seed"]: x["eval"]["loss"] - base[x["seed"]] for x in raw
                if x["label"] == label and x["seed"] in base}
        r["gap_per_seed"] = gaps
        if gaps:
            r["gap_mean"] = statistics.mean(gaps.values())
            r["gap_std"] = statistics.stdev(gaps.values()) if len(gaps) > 1 else 0.0
    return rows


def render(rows: dict[str, dict], args: argparse.Namespace) -> str:
    head = (f"{'run':>28} {'n':>2} {'val loss':>15} {'- every step (paired)':>18} {'KiB/step':>9} {'vs DDP':>7} "
            f"{'vs every':>8} {'ms/step here':>12} {'ms @1Gb/s':>9} {'ms @10Gb/s':>10}")
    batch = f"batch {args.batch_size} per rank" if args.batch_size else "the task's batch"
    batch += f", {' '.join(args.set)}" if args.set else ""
    lines = [f"{TASKS[args.task].description}; {args.workers} gloo workers, {args.steps} inner steps, {batch}, "
             "n seeds per row; "
             f"latency {args.latency_us:g} us per collective", head, "-" * len(head)]
    for label, r in rows.items():
        n_gaps = len(r.get("gap_per_seed", {}))
        gap_text = (f"{r['gap_mean']:+.4f} ± {r['gap_std']:.4f}" if n_gaps > 1 else
                    f"{r['gap_mean']:+.4f}" if n_gaps else "")
        lines.append(f"{label:>28} {len(r['seeds']):>2} {r['val_loss_mean']:>7.4f} ± {r['val_loss_std']:.4f} "
                     f"{gap_text:>18} {r['bytes_per_step'] / 1024:>9.1f} {r['bytes_vs_ddp']:>7.4f} "
                     f"{r.get('bytes_vs_every_step', float('nan')):>8.4f} {r['step_time_s'] * 1000:>12.0f} "
                     f"{r['projected_step_s_1gbit'] * 1000:>9.0f} {r['projected_step_s_10gbit'] * 1000:>10.0f}")
    others = sorted({f"{label}: {r['gap_to']}" for label, r in rows.items() if r["gap_to"] != EVERY_STEP})
    if others:
        lines.append(f"paired gap to '{EVERY_STEP}', except " + "; ".join(others))
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    raw = collect(args)
    rows = summarise(raw, args.latency_us * 1e-6)
    table = render(rows, args)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "local_steps", "task": args.task, "steps": args.steps, "seeds": args.seeds,
           "workers": args.workers, "batch_size": args.batch_size, "set": args.set, "latency_us": args.latency_us,
           "platform": platform.platform(),
           "model": "t = measured step time + ring wire bytes * 8 / bandwidth + collectives per step * latency",
           "rows": rows, "runs": raw, "table": table}
    (RESULTS / args.out).write_text(json.dumps(out, indent=2))
    (RESULTS / (args.out + ".partial")).unlink(missing_ok=True)
    print(f"\nwrote {RESULTS / args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
