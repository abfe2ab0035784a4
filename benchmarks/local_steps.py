"""Local steps (``sync.mode=local_steps``) against per-step synchronisation: LLaMA tiny, 4 gloo workers.

Task: the recipe ``llama_tiny_stdlib`` (LLaMA ``tiny``, byte tokenizer, the Python standard
library's source, AdamW 3e-3 with warm-up and cosine, clipping 1.0), 4 local gloo workers, block
level. Runs, all at the same number of inner steps and the same per-rank batch:

- DDP: coverage 1, synchronised every step (subnetdp at C = 1 is DDP: tested against torch's DDP);
- SDP C = 0.5 every step;
- SDP C = 0.5 with local steps, H = 4, 16, 64 (``sync.every``), twice: with outer SGD with Nesterov
  momentum at DiLoCo's values (``sync.outer_lr=0.7``, ``sync.outer_momentum=0.9``), and with plain
  averaging of the owners' parameters (outer lr 1, momentum 0: the default);
- SDP C = 0.5 with H = 16 and outer lr 0.8 without momentum, the best setting of the sweep in
  ``docs/local_steps.md`` (``--outer LR:MOMENTUM`` adds H = 16 rows of other settings).

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

Run: ``.venv/bin/python benchmarks/local_steps.py [--steps 256] [--seeds 3]`` (27 runs of 45-120 s
on 2 cores, 25-50 minutes). Writes
``benchmarks/results/local_steps.json`` (``--out`` another name).
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

RESULTS = Path(__file__).parent / "results"
NESTEROV = ["sync.outer_lr=0.7", "sync.outer_momentum=0.9"]  # DiLoCo's values
PLAIN = ["sync.outer_lr=1", "sync.outer_momentum=0"]  # the default: plain averaging of the owners' parameters
LOCAL = ["masker.coverage=0.5", "sync.mode=local_steps"]
RUNS = {  # label: overrides
    "DDP (C=1)": ["masker.coverage=1"],
    "SDP C=0.5, every step": ["masker.coverage=0.5"],
    **{f"SDP C=0.5, H={h}, Nesterov": [*LOCAL, f"sync.every={h}", *NESTEROV] for h in (4, 16, 64)},
    **{f"SDP C=0.5, H={h}, avg": [*LOCAL, f"sync.every={h}", *PLAIN] for h in (4, 16, 64)},
    # The best outer setting of the sweep (docs/local_steps.md): outer lr 0.8, no momentum.
    "SDP C=0.5, H=16, lr 0.8": [*LOCAL, "sync.every=16", "sync.outer_lr=0.8", "sync.outer_momentum=0"],
}


def run(label: str, overrides: list[str], seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    name = f"{label}-s{seed}".replace(" ", "").replace(",", "-").replace("=", "").replace("(", "").replace(")", "")
    cmd = [str(Path(sys.executable).parent / "subnetdp"), "train", "llama_tiny_stdlib", *overrides, f"seed={seed}",
           f"launch.nproc={args.workers}", "launch.threads_per_rank=1", f"train.steps={args.steps}",
           f"train.batch_size={args.batch_size}", "eval.every=0", f"eval.batches={args.eval_batches}",
           f"train.log_every={args.steps}", "checkpoint.enabled=false", f"run.dir={tmp}", f"run.name={name}",
           f"data.cache_dir={args.cache}", "train.progress=false"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    summary = json.loads((tmp / name / "summary.json").read_text())
    ranks = summary["ranks"]
    h = int(ranks[0].get("sync_every", 1)) if ranks[0]["sync_mode"] == "local_steps" else 1
    groups = statistics.mean(sum(1 for g in r["bytes_by_group"].values() if g["k"] > 1) for r in ranks)
    norm = 1 if h == 1 and any(g["k"] < args.workers for g in ranks[0]["bytes_by_group"].values()) else 0
    return {"label": label, "seed": seed, "command": " ".join(cmd[1:]), "wall_s": wall, "eval": summary["eval"],
            "sync_every": h, "bytes_per_step": statistics.mean(r["bytes_sent_per_step"] for r in ranks),
            "wire_bytes_per_step": statistics.mean(r["wire_bytes_per_step_ring"] for r in ranks),
            "step_time_s": statistics.mean(r["step_time_s"] for r in ranks),
            "collectives_per_step": groups / h + norm, "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
            "outer_state_bytes": ranks[0].get("outer_state_bytes", 0)}


def projected(r: dict, gbit: float, latency_s: float) -> float:
    return r["step_time_s"] + r["wire_bytes_per_step"] * 8 / (gbit * 1e9) + r["collectives_per_step"] * latency_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--latency-us", type=float, default=100.0)
    parser.add_argument("--only", nargs="*", help="labels to run (default: all)")
    parser.add_argument("--out", default="local_steps.json", help="file name in benchmarks/results/")
    parser.add_argument("--outer", nargs="*", default=[], metavar="LR:MOMENTUM",
                        help="extra H=16 rows with these outer settings (a sweep), labelled 'SDP C=0.5, H=16, lr LR m M'")
    args = parser.parse_args()
    for spec in args.outer:
        lr, mom = spec.split(":")
        label = f"SDP C=0.5, H=16, lr {lr} m {mom}"
        RUNS[label] = ["masker.coverage=0.5", "sync.mode=local_steps", "sync.every=16", f"sync.outer_lr={lr}",
                       f"sync.outer_momentum={mom}"]
        if args.only is not None:
            args.only.append(label)
    latency = args.latency_us * 1e-6
    with tempfile.TemporaryDirectory() as tmp:
        args.cache = Path(tmp) / "data"
        raw = []
        for label, ov in RUNS.items():
            for seed in range(args.seeds if not args.only or label in args.only else 0):
                raw.append(run(label, ov, seed, args, Path(tmp)))
                print(f"{label} seed {seed}: val loss {raw[-1]['eval']['loss']:.4f}, {raw[-1]['wall_s']:.0f} s", flush=True)
    rows = {}
    for label in RUNS:
        mine = [r for r in raw if r["label"] == label]
        if not mine:
            continue
        losses = [r["eval"]["loss"] for r in mine]
        mean = lambda k: statistics.mean(r[k] for r in mine)  # noqa: E731
        rows[label] = {"val_loss_mean": statistics.mean(losses),
                       "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                       "bytes_per_step": mean("bytes_per_step"), "wire_bytes_per_step": mean("wire_bytes_per_step"),
                       "step_time_s": mean("step_time_s"), "collectives_per_step": mean("collectives_per_step"),
                       "outer_state_bytes": mine[0]["outer_state_bytes"],
                       "peak_memory_bytes": max(r["peak_memory_bytes"] for r in mine)}
        for gbit in (1, 10):
            rows[label][f"projected_step_s_{gbit}gbit"] = statistics.mean(projected(r, gbit, latency) for r in mine)
    ddp, every = rows.get("DDP (C=1)"), rows.get("SDP C=0.5, every step")
    head = (f"{'run':>28} {'val loss':>15} {'- every step':>12} {'KiB/step':>9} {'vs DDP':>7} {'vs every':>8} "
            f"{'ms/step here':>12} {'ms @1Gb/s':>9} {'ms @10Gb/s':>10}")
    lines = [f"LLaMA tiny on the stdlib, {args.workers} gloo workers, {args.steps} inner steps, batch {args.batch_size} "
             f"x 128 tokens per rank, {args.seeds} seeds; latency {args.latency_us:g} us per collective", head,
             "-" * len(head)]
    for label, r in rows.items():
        rel = r["bytes_per_step"] / ddp["bytes_per_step"] if ddp else float("nan")
        r["bytes_vs_ddp"] = rel
        if every:
            r["val_loss_minus_every_step"] = r["val_loss_mean"] - every["val_loss_mean"]
            r["bytes_vs_every_step"] = r["bytes_per_step"] / every["bytes_per_step"]
        lines.append(f"{label:>28} {r['val_loss_mean']:>7.4f} ± {r['val_loss_std']:.4f} "
                     f"{r.get('val_loss_minus_every_step', float('nan')):>+12.4f} {r['bytes_per_step'] / 1024:>9.1f} "
                     f"{rel:>7.4f} {r.get('bytes_vs_every_step', float('nan')):>8.4f} {r['step_time_s'] * 1000:>12.0f} "
                     f"{r['projected_step_s_1gbit'] * 1000:>9.0f} {r['projected_step_s_10gbit'] * 1000:>10.0f}")
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "local_steps", "steps": args.steps, "seeds": args.seeds, "workers": args.workers,
           "batch_size": args.batch_size, "latency_us": args.latency_us, "platform": platform.platform(),
           "model": "t = measured step time + ring wire bytes * 8 / bandwidth + collectives per step * latency",
           "rows": rows, "runs": raw, "table": table}
    (RESULTS / args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {RESULTS / args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
