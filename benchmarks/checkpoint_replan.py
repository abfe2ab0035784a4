"""Checkpoint bytes on disk and save time of a multi-rank run (4 gloo ranks by default).

ResNet-18 on digits, block level, W ranks at coverage C, SGD with momentum; trains ``--steps``
steps with a checkpoint after each and reports, from the last checkpoint, the bytes of every kind
of file and the wall time of each save (the slowest rank's). The same script runs against an
older checkout (``PYTHONPATH=OLD_CHECKOUT``) to compare checkpoint formats: it only uses
``subnetdp train``'s Python entry point and times ``Checkpointer.save``.

    .venv/bin/python benchmarks/checkpoint_replan.py [--world-size 4] [--coverage 0.5] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path


def _worker(rank: int, world: int, store: str, run_dir: str, args: dict, out: str) -> None:
    os.environ.update({"OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    import torch

    torch.set_num_threads(1)
    from subnetdp.train.configure import load_config
    from subnetdp.core.contracts import LaunchEnv
    from subnetdp.core.plugins import PluginManager
    from subnetdp.train.checkpoints import checkpointer
    from subnetdp.train.loop import train

    times: list[float] = []
    save = checkpointer.Checkpointer.save

    def timed(self, step):  # the wall time of one save on this rank, barriers included
        began = time.perf_counter()
        try:
            return save(self, step)
        finally:
            times.append(time.perf_counter() - began)

    checkpointer.Checkpointer.save = timed
    pm = PluginManager()
    cfg = load_config("resnet18_digits", [f"comm.init_method=file://{store}", f"run.dir={run_dir}", "run.name=bench",
                                      f"masker.coverage={args['coverage']}", f"train.steps={args['steps']}",
                                      "train.batch_size=8", "checkpoint.every=1", "checkpoint.keep=1",
                                      "eval.every=0", "eval.batches=1", "eval.bn_recalibrate_batches=0",
                                      "train.progress=false", "launch.nproc=1", "launch.threads_per_rank=1",
                                      "optim.warmup_steps=0"], pm.registries)
    train(cfg, LaunchEnv(rank, world, rank, world, "bench"), pm)
    torch.save({"times": times}, out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--coverage", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    import torch
    import subnetdp

    with tempfile.TemporaryDirectory() as tmp:
        store, run_dir = str(Path(tmp) / "store"), str(Path(tmp) / "runs")
        outs = [str(Path(tmp) / f"out-{r}.pt") for r in range(a.world_size)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, a.world_size, store, run_dir, vars(a), outs[r]))
                 for r in range(a.world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(900)
        if any(p.exitcode != 0 for p in procs):
            sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        times = [torch.load(o)["times"] for o in outs]
        ckpt = sorted((Path(run_dir) / "bench" / "checkpoints").glob("step_*"))[-1]
        manifest = json.loads((ckpt / "MANIFEST.json").read_text())
        sizes = {f.name: f.stat().st_size for f in sorted(ckpt.iterdir())}
    kinds: dict[str, int] = {}
    for name, n in sizes.items():
        kind = name.split("_")[0] + "_*" + name[name.index("."):] if "_" in name and name[0] in "pr" and \
            name.split("_")[1][0].isdigit() else name
        kinds[kind] = kinds.get(kind, 0) + n
    saves = [max(t[i] for t in times) for i in range(len(times[0]))]
    result = {"label": a.label or manifest["format"], "format": manifest["format"], "world_size": a.world_size,
              "coverage": a.coverage, "subnetdp": str(Path(subnetdp.__file__).parent), "bytes_total": sum(sizes.values()),
              "bytes_by_kind": kinds, "largest_file": max(sizes.values()), "save_seconds": saves}
    print(f"{result['label']}: W={a.world_size} C={a.coverage:g}  checkpoint {result['bytes_total']:,} bytes "
          f"({result['bytes_total'] / 2**20:.1f} MiB), largest file {result['largest_file'] / 2**20:.1f} MiB")
    for kind, n in kinds.items():
        print(f"  {kind:28s} {n:>14,} bytes")
    print("  save time (slowest rank): " + ", ".join(f"{s:.2f} s" for s in saves))
    sys.path.insert(0, str(Path(__file__).parent))
    from _results import results_dir

    out = results_dir() / f"checkpoint_replan_{manifest['format'].split('/')[-1]}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
