"""What a checkpoint costs: bytes per rank, seconds to save, verify and load, against a training step.

One process (comm ``local``), ResNet-18 on digits at coverage 1 (the whole model on the rank: the
largest a rank's checkpoint gets). Prints a table and writes benchmarks/results/checkpoint_cost.json.

    .venv/bin/python benchmarks/checkpoint_cost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from subnetdp.train.checkpoints import files as ck
from subnetdp.train.configure import load_config
from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.setup import setup
from subnetdp.core.plugins import PluginManager
from subnetdp.train.checkpoints.checkpointer import Checkpointer
from subnetdp.train.checkpoints.source import CheckpointPieces
from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pm = PluginManager()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("resnet18_digits", ["comm.name=local", "masker.coverage=1", "launch.nproc=1", f"run.dir={tmp}",
                                          "run.name=bench", "train.batch_size=32", "checkpoint.keep=0"], pm.registries)
        ctx, st = setup(cfg, LaunchEnv(0, 1, 0, 1, "bench"), pm)
        # The run's own optimizer, schedule and synchroniser: what a checkpoint saves.
        opt, sched, averager = st.optimizer, st.scheduler, st.synchronizer
        loader = ctx.data.train_loader(0, 1, 32)
        batches = iter(loader)
        ckpt = Checkpointer(ctx, st, loader)
        ckpt.start()

        def step() -> float:
            t0 = time.perf_counter()
            averager.prepare()
            batch = next(batches)
            ctx.adapter.loss(st.model(batch[0]), batch).backward()
            averager.finish()
            opt.step()
            sched.step()
            return time.perf_counter() - t0

        step()  # warm-up
        steps = [step() for _ in range(args.repeats)]
        saves, verifies, loads = [], [], []
        for i in range(args.repeats):
            t0 = time.perf_counter()
            path = ckpt.save(i + 1)
            saves.append(time.perf_counter() - t0)
            manifest = ck.read_manifest(path)
            t0 = time.perf_counter()
            for name in manifest["files"]:
                ck.verify_file(path, name, manifest)
            verifies.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            st.replan(st.plan, CheckpointPieces(path, loader))  # a resume: the same plan, loaded in place
            loads.append(time.perf_counter() - t0)
        sizes = {n: e["bytes"] for n, e in manifest["files"].items()}
    row = {"params": sum(p.numel() for p in st.model.parameters()), "optimizer": str(cfg.optim.name),
           # one rank: it writes every piece (pieces_0), its buffers (rank_0) and its state
           "rank_bytes": sum(n for f, n in sizes.items() if f.endswith((".safetensors", ".pt"))),
           "step_s": statistics.median(steps), "save_s": statistics.median(saves),
           "verify_s": statistics.median(verifies), "load_s": statistics.median(loads)}
    row["save_over_step"] = row["save_s"] / row["step_s"]
    print(f"{'params':>11}  {'MiB/rank':>8}  {'step':>8}  {'save':>8}  {'verify':>8}  {'load':>8}  {'save/step':>9}")
    print(f"{row['params']:>11,}  {row['rank_bytes'] / 2**20:>8.1f}  {row['step_s'] * 1000:>6.0f}ms  "
          f"{row['save_s'] * 1000:>6.0f}ms  {row['verify_s'] * 1000:>6.0f}ms  {row['load_s'] * 1000:>6.0f}ms  "
          f"{row['save_over_step']:>9.2f}")
    out = results_dir() / "checkpoint_cost.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"repeats": args.repeats, "threads": 1, "result": row}, indent=2))


if __name__ == "__main__":
    main()
