"""Host memory and set-up cost of owner-local construction, before and after, in one table.

For each model, W ranks (real gloo processes) run set-up, one evaluation of the union model and one
checkpoint save, and each rank measures with the kernel's own counters (``/proc/self/status``):

- the interpreter's baseline: resident memory after torch and subnetdp are imported;
- set-up peak: the high-water mark of resident memory (VmHWM) at the end of set-up;
- evaluation peak: VmHWM over the evaluation alone (reset with ``/proc/self/clear_refs``);
- its owned state: the bytes of the parameters and buffers it holds;
- set-up time; and, for the checkpoint, bytes on disk and save time.

"Before" is the same measurement on another commit of this repository (``--before REV``, checked out
into a temporary git worktree and put first on ``PYTHONPATH``), so both rows come from one
invocation on one machine. Targets (issue "owner-local"): set-up peak within 1.15x of owned state +
baseline on every rank, rank 0's evaluation peak within 1.25x of it, checkpoint bytes = model +
optimizer state once.

    .venv/bin/python benchmarks/owner_local.py --before 6830a23            # LLaMA 500M and ResNet-18, W = 4
    .venv/bin/python benchmarks/owner_local.py --models resnet18 --world-size 2   # quicker
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

MODELS = {
    # LLaMA 500M (fp32, SGD without momentum: the optimizer holds nothing) on the standard library's
    # text, short sequences so one evaluation batch is cheap on a CPU.
    "llama500m": ("llama_tiny_stdlib", ["model.variant=500m", "data.seq_len=64", "eval.batch_size=1", "eval.batches=1",
                                        "model.loss_chunk=0", "train.batch_size=1"]),
    "resnet18": ("resnet18_digits", ["eval.batch_size=32", "eval.batches=2", "eval.bn_recalibrate_batches=2", "train.batch_size=16"]),
}
COMMON = ["masker.coverage=0.5", "optim.name=sgd", "optim.momentum=0", "optim.lr=0.01",
          "train.progress=false", "launch.threads_per_rank=1", "optim.warmup_steps=0", "comm.name=gloo"]


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def _trim() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back, so the next peak starts from what is live
    except OSError:
        pass


def _rank(rank: int, world: int, store: str, recipe: str, overrides: list[str], out: str) -> None:
    os.environ.update({"OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(world)})
    import torch

    torch.set_num_threads(1)
    from subnetdp.train.configure import load_config
    from subnetdp.core.contracts import LaunchEnv
    from subnetdp.core.plugins import PluginManager
    from subnetdp.train.checkpoints.checkpointer import Checkpointer
    from subnetdp.train.evaluation import evaluate_run
    from subnetdp.train.setup import setup

    pm = PluginManager()
    cfg = load_config(recipe, overrides + [f"comm.init_method=file://{store}"], pm.registries)
    # The baseline holds the libraries and the data set-up loads (not the model): import them first.
    import torch.utils.tensorboard  # noqa: F401

    pm.registries["data"].create(cfg.data.name, cfg.data, seed=int(cfg.seed)).spec()
    _trim()
    baseline = _status()["VmRSS"]
    _reset_peak()
    t0 = time.perf_counter()
    ctx, st = setup(cfg, LaunchEnv(rank, world, rank, world, "bench"), pm)
    setup_s = time.perf_counter() - t0
    setup_peak = _status()["VmHWM"]
    owned = sum(t.numel() * t.element_size() for t in list(st.model.parameters()) + list(st.model.buffers()))
    ctx.comm.barrier()
    _trim()
    _reset_peak()
    eval_base = _status()["VmRSS"]
    metrics = evaluate_run(ctx, st, 1).metrics
    eval_peak = _status()["VmHWM"]
    loader = ctx.data.train_loader(rank, world, int(cfg.train.batch_size))
    ckpt = Checkpointer(ctx, st, loader)
    ctx.comm.barrier()
    t0 = time.perf_counter()
    path = ckpt.save(1)
    save_s = time.perf_counter() - t0
    disk = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if rank == 0 else 0
    full = sum(torch.Size(shape).numel() * st.partition.dtypes[n].itemsize for n, shape in st.partition.shapes.items())
    result = {"rank": rank, "baseline": baseline, "setup_peak": setup_peak, "owned": owned, "setup_s": setup_s,
              "eval_base": eval_base, "eval_peak": eval_peak, "save_s": save_s, "checkpoint_bytes": disk,
              "full_bytes": full, "metrics": metrics}
    ctx.comm.shutdown()
    Path(out).write_text(json.dumps(result))


def _measure(model: str, world: int, tree: Path, tmp: Path) -> list[dict]:
    """One spawn of ``world`` ranks with ``tree`` first on the path; each rank's figures."""
    recipe, extra = MODELS[model]
    tag = f"{model}-{tree.name}-{world}"
    store = tmp / f"store-{tag}"
    overrides = COMMON + extra + [f"run.dir={tmp / 'runs'}", f"run.name={tag}"]
    outs = [tmp / f"{tag}-{r}.json" for r in range(world)]
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{HERE}", OMP_NUM_THREADS="1")
    code = ("import sys, json; from owner_local import _rank; a = json.loads(sys.argv[1]); "
            "_rank(a['rank'], a['world'], a['store'], a['recipe'], a['overrides'], a['out'])")
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(
        {"rank": r, "world": world, "store": str(store), "recipe": recipe, "overrides": overrides, "out": str(outs[r])})],
        env=env, cwd=tree) for r in range(world)]
    codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise SystemExit(f"{model} on {tree}: ranks exited with {codes}")
    return [json.loads(o.read_text()) for o in outs]


def _worktree(rev: str, tmp: Path) -> Path:
    path = tmp / f"before-{rev}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="a commit to measure beside the working tree (e.g. the last one before "
                                     "owner-local construction)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--world-size", type=int, default=4)
    args = ap.parse_args()
    from _results import results_dir

    rows = []
    with tempfile.TemporaryDirectory(prefix="owner-local-") as t:
        tmp = Path(t)
        trees = [("after", ROOT)]
        before = _worktree(args.before, tmp) if args.before else None
        if before is not None:
            trees.insert(0, (f"before ({args.before})", before))
        try:
            for model in args.models:
                for label, tree in trees:
                    for r in _measure(model, args.world_size, tree, tmp):
                        rows.append({"model": model, "tree": label, "world_size": args.world_size, **r})
        finally:
            if before is not None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
    mib = 2.0 ** 20
    print(f"{'model':>10} {'tree':>18} {'rank':>4} {'owned':>9} {'base':>8} {'setup peak':>10} {'x':>5} "
          f"{'eval peak':>10} {'x':>5} {'setup s':>8} {'ckpt MiB':>9} {'save s':>7}")
    for r in rows:
        floor = r["owned"] + r["baseline"]
        print(f"{r['model']:>10} {r['tree']:>18} {r['rank']:>4} {r['owned'] / mib:>9.1f} {r['baseline'] / mib:>8.1f} "
              f"{r['setup_peak'] / mib:>10.1f} {r['setup_peak'] / floor:>5.2f} {r['eval_peak'] / mib:>10.1f} "
              f"{r['eval_peak'] / floor:>5.2f} {r['setup_s']:>8.2f} "
              f"{(r['checkpoint_bytes'] / mib if r['rank'] == 0 else float('nan')):>9.1f} {r['save_s']:>7.2f}")
    print("x = peak / (owned state + the interpreter's baseline); MiB of resident memory (VmHWM), per rank.")
    out = results_dir() / "owner_local.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
