"""Rank 0's tensor peak and bytes during a union evaluation: assembled on rank 0 (before) vs streamed (after).

ResNet-18 on digits (the default recipe's model and data), W = 2 gloo ranks (spawned processes), block
and neuron level, ``masker.coverage`` 0.5, the recipe's evaluation (BatchNorm recalibration on
``eval.bn_recalibrate_batches`` = 20 batches, then the whole held-out split). Each rank trains two
steps (so its optimizer state exists), then the same evaluation is measured twice on every rank:

- **assembled**: :func:`~subnetdp.sdp.union.assemble_union` builds the union model on rank 0, which
  evaluates it alone (what the loop did before);
- **streamed**: :func:`~subnetdp.sdp.union.evaluate_union`, what the loop does now.

Memory: the dispatch-level tensor tracker (:class:`~subnetdp.parallel.memory.TensorMemoryTracker`),
started from the rank's training state (parameters, gradients, optimizer state), as the meter
measures a step; gloo's own buffers are not seen. Bytes: the payload each rank hands to collectives
during the evaluation (broadcasts and all-reduces, counted at the communicator).

Run: ``.venv/bin/python benchmarks/union_eval.py`` (about a minute on 2 cores). Writes
``union_eval.json`` into the results directory (``benchmarks/_results.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from subnetdp.train.configure import load_config  # noqa: E402
from subnetdp.core.contracts import LaunchEnv  # noqa: E402
from subnetdp.parallel.memory import TensorMemoryTracker, live_state_bytes, training_state_tensors  # noqa: E402
from subnetdp.sdp.union import (StreamedUnion, assemble_union, evaluate, evaluate_union,  # noqa: E402
                                union_branch_scales)
from subnetdp.sdp.branches import fold_branch_scales  # noqa: E402
from subnetdp.train.loop import train_loop  # noqa: E402
from subnetdp.train.setup import setup  # noqa: E402
from tests.helpers import plugin_manager, run_ranks  # noqa: E402
from _results import results_dir  # noqa: E402

MIB = 2 ** 20


class Counted:
    """Counts the payload bytes this rank hands to the communicator's broadcasts and all-reduces."""

    def __init__(self, comm) -> None:
        self.comm, self.bytes = comm, 0
        self._broadcast, self._all_reduce = comm.broadcast, comm.all_reduce
        comm.broadcast = self.broadcast
        comm.all_reduce = self.all_reduce

    def broadcast(self, tensor, src, group=None):
        self.bytes += tensor.numel() * tensor.element_size()
        return self._broadcast(tensor, src, group)

    def all_reduce(self, tensor, group, async_op=False):
        self.bytes += tensor.numel() * tensor.element_size()
        return self._all_reduce(tensor, group, async_op)

    def take(self) -> int:
        n, self.bytes = self.bytes, 0
        return n


def worker(rank: int, world: int, init_method: str, granularity: str, coverage: float) -> dict:
    pm = plugin_manager()
    cfg = load_config("resnet18_digits", [
        "train.steps=2", "optim.warmup_steps=2", "launch.nproc=1", "launch.threads_per_rank=1", "train.progress=false", "eval.every=0",
        "checkpoint.enabled=false", f"masker.granularity={granularity}", f"masker.coverage={coverage}",
        f"comm.init_method={init_method}", f"run.dir={init_method.removeprefix('file://')}-runs",
        f"run.name={granularity}"], pm.registries)
    ctx, st = setup(cfg, LaunchEnv(rank, world, rank, world, "bench"), pm)
    try:
        train_loop(ctx, st)  # its own last evaluation is streamed; the two below are measured
        comm = Counted(ctx.comm)
        args = (ctx.adapter, ctx.spec, int(cfg.seed), st.partition, st.plan, st.model, st.pmap, ctx.comm)
        scales = union_branch_scales(cfg, st.partition, st.plan)
        state = live_state_bytes(training_state_tensors(st.model, st.optimizer, st.synchronizer.state_tensors()))
        part = st.partition
        out = {"state_bytes": state,
               "full_model_bytes": sum(_numel(part.shapes[n]) * part.dtypes[n].itemsize for n in part.shapes)}
        with TensorMemoryTracker(state) as before:
            union = assemble_union(*args)  # collective
            metrics = None
            if union is not None:
                fold_branch_scales(ctx.adapter.branch_output_layers(union), scales)
                metrics = evaluate(union, ctx.adapter, ctx.data, cfg)
            del union
        out["assembled"] = {"peak": before.peak, "bytes": comm.take(), "metrics": metrics}
        with TensorMemoryTracker(state) as after:
            metrics = evaluate_union(*args, ctx.data, cfg, scales)  # collective
        out["streamed"] = {"peak": after.peak, "bytes": comm.take(), "metrics": metrics}
        with StreamedUnion(ctx.adapter, ctx.spec, st.partition, st.plan, st.model, st.pmap, ctx.comm,
                           scales) as probe:
            out["block_bytes"], out["staging_bytes"] = probe.block_bytes, probe.staging_bytes
            out["resident_bytes"] = probe.resident_bytes
        return out
    finally:
        ctx.comm.shutdown()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--coverage", type=float, default=0.5)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for granularity in ("block", "neuron"):
            res = run_ranks(worker, args.world_size, Path(tmp), granularity, args.coverage, timeout=1200)
            rows[granularity] = res[0]
    lines = [f"ResNet-18 digits, W={args.world_size}, C={args.coverage}: rank 0 during one union evaluation "
             "(20 recalibration + 2 held-out batches)",
             f"{'level':<7} {'own state':>10} {'assembled peak':>15} {'streamed peak':>14} {'ratio':>6} "
             f"{'assembled bytes':>16} {'streamed bytes':>15}  {'metrics equal':>13}"]
    for level, r in rows.items():
        a, s = r["assembled"], r["streamed"]
        lines.append(f"{level:<7} {r['state_bytes'] / MIB:>6.1f} MiB {a['peak'] / MIB:>11.1f} MiB {s['peak'] / MIB:>10.1f} MiB "
                     f"{s['peak'] / a['peak']:>6.2f} {a['bytes'] / MIB:>12.1f} MiB {s['bytes'] / MIB:>11.1f} MiB  "
                     f"{str(a['metrics'] == s['metrics']):>13}")
    table = "\n".join(lines)
    print(table)
    out = results_dir() / "union_eval.json"
    out.write_text(json.dumps({"world_size": args.world_size, "coverage": args.coverage, "rows": rows,
                               "table": table}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
