"""What a lost worker costs: recovery from the surviving owners against a plain restart from disk.

ResNet-18 on digits, 4 workers (1 torchrun agent x 4, or 2 agents x 2 as two nodes on this machine),
C = 0.5 with ``masker.min_owners=2``, ``checkpoint.every=E``, N steps; rank 1 is SIGKILLed inside the
gradient averaging of a random step (the same steps for both kinds), under ``--max-restarts 1``. For
each trial, the run with recovery (``checkpoint.survivors=true``, the default) and the plain restart
(``checkpoint.survivors=false``: from the newest checkpoint on disk) report

- finished steps trained twice: the last step finished before the kill minus the step resumed from;
- seconds from the kill to the end of the first step after it (the kill's marker file against rank 0's
  TensorBoard event times);
- bytes the survivors wrote (the files of the assembled checkpoint);
- whether the final parameters and optimizer state equal an uninterrupted run's of the same layout, bit for bit.

    .venv/bin/python benchmarks/recovery.py [--steps 200 --every 50 --trials 5 --layouts 1x4,2x2]

Writes ``recovery.json`` under the results directory (``_results.py``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise
from subnetdp.train.checkpoints import files as ck

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _common(steps: int, every: int) -> list[str]:
    return ["train", "resnet18_digits", f"train.steps={steps}", "train.batch_size=4", "train.log_every=10",
            "eval.bn_recalibrate_batches=0", "eval.every=0", "optim.warmup_steps=0", "masker.coverage=0.5",
            "masker.min_owners=2", "launch.threads_per_rank=1", "train.progress=false", f"checkpoint.every={every}",
            "checkpoint.keep=0", "checkpoint.final=always", "resume=auto"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(layout: str, args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run one job; returns (exit status, stdout of every agent, the end of their stderr)."""
    nodes, per = (int(x) for x in layout.split("x"))
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    if nodes == 1:
        p = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", str(per), "--max-restarts", "1",
                            "-m", "subnetdp", *args], capture_output=True, text=True, env=full_env, timeout=7200)
        return p.returncode, p.stdout, p.stderr[-3000:]
    port, rid = _free_port(), f"bench{random.randrange(10**9)}"
    procs = [subprocess.Popen([TORCHRUN, "--nnodes", str(nodes), "--nproc-per-node", str(per), "--node-rank", str(n),
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rid,
                               "--max-restarts", "1", "-m", "subnetdp", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**full_env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
             for n in range(nodes)]
    outs = [p.communicate(timeout=7200) for p in procs]
    return max(p.returncode for p in procs), "".join(o for o, _ in outs), "".join(e[-1500:] for _, e in outs)


def _first_step_after(run: Path, step: int, since: float) -> float | None:
    """Wall time at which rank 0 logged its first step after ``step`` later than ``since``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    times = []
    for d in [run / "tensorboard" / "rank_0"]:
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            times += [e.wall_time for e in acc.Scalars(tag) if e.step > step and e.wall_time > since]
    return min(times) if times else None


def _pieces(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("pieces_*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _same(a: Path, b: Path) -> bool:
    pa, pb = _pieces(a), _pieces(b)
    return set(pb) <= set(pa) and all(torch.equal(pa[k], pb[k]) for k in pb)


def trial(layout: str, kill: int, survivors: bool, steps: int, every: int, tmp: Path, ref: Path) -> dict[str, Any]:
    name = f"{layout}-k{kill}-{'rec' if survivors else 'plain'}"
    args = _common(steps, every) + [f"run.dir={tmp}", f"run.name={name}", f"checkpoint.survivors={str(survivors).lower()}"]
    code, out, err = _launch(layout, args, {ck.KILL_IN_SYNC: str(kill)})
    if code != 0:  # keep what it said: the temporary run directory goes at the end
        kept = results_dir() / f"recovery-{name}.log"
        kept.write_text(f"exit {code}\n--- stdout\n{out}\n--- stderr (end)\n{err}")
        print(f"{name}: exit {code}; its output is in {kept}", file=sys.stderr, flush=True)
    run = tmp / name
    marker = ck.fault_marker(run, ck.KILL_IN_SYNC, kill, 1)
    resumed = [int(m) for m in re.findall(r"resumed from \S+ \(step (\d+)\)", out)]
    start = resumed[0] if resumed else 0
    killed_at = marker.stat().st_mtime if marker.exists() else None
    first = _first_step_after(run, start, killed_at) if killed_at else None
    assembled = ck.step_dir(run, kill - 1)
    written = None
    if survivors and (assembled / ck.MANIFEST).is_file() and "absent_ranks" in ck.read_manifest(assembled):
        written = sum(e["bytes"] for e in ck.read_manifest(assembled)["files"].values())
    return {"layout": layout, "kill_step": kill, "survivors": survivors, "exit": code, "resumed_from": start,
            "steps_trained_twice": (kill - 1) - start, "seconds_kill_to_next_step": (first - killed_at) if first else None,
            "survivor_bytes": written, "final_equals_uninterrupted": _same(ck.step_dir(run, steps), ck.step_dir(ref, steps))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--layouts", default="1x4,2x2")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    kills = [rng.randrange(2, args.steps) for _ in range(args.trials)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for layout in args.layouts.split(","):
            # One uninterrupted reference per layout: over several nodes the plan places a unit's owners on
            # different nodes (masker.nodes), so a 2 x 2 job trains another plan than a 1 x 4 one.
            code, _, err = _launch(layout, _common(args.steps, args.every) + [f"run.dir={tmp}", f"run.name=ref-{layout}"], {})
            if code != 0:
                sys.exit(f"the uninterrupted reference run ({layout}) failed:\n{err}")
            for kill in kills:
                for survivors in (True, False):
                    rows.append(trial(layout, kill, survivors, args.steps, args.every, tmp, tmp / f"ref-{layout}"))
                    print(json.dumps(rows[-1]), flush=True)
    out = results_dir() / "recovery.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "load": os.getloadavg(), "rows": rows}, indent=1))
    print(f"\n| layout | kind | kill steps | trained twice (each) | mean | s kill -> next step (median) | survivor MiB | final = uninterrupted |")
    print("|---|---|---|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        for survivors in (True, False):
            rs = [r for r in rows if r["layout"] == layout and r["survivors"] == survivors]
            secs = [r["seconds_kill_to_next_step"] for r in rs if r["seconds_kill_to_next_step"] is not None]
            mib = [r["survivor_bytes"] / 2**20 for r in rs if r["survivor_bytes"]]
            twice = [r["steps_trained_twice"] for r in rs]
            median = f"{statistics.median(secs):.1f}" if secs else "-"
            written = f"{statistics.mean(mib):.1f}" if mib else "-"
            same = sum(r["final_equals_uninterrupted"] for r in rs)
            print(f"| {layout} | {'recovery' if survivors else 'plain restart'} | {[r['kill_step'] for r in rs]} | "
                  f"{twice} | {statistics.mean(twice):.1f} | {median} | {written} | {same}/{len(rs)} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
