"""What a lost worker costs when the survivors go on in-process (``launch.on_failure=continue``).

4 workers under subnetdp's supervisor, C = 0.5 with ``masker.min_owners=2``, N steps, in two shapes:
``1x4`` (one supervisor, ``subnetdp train launch.nproc=4``; rank 1 is SIGKILLed) and ``2x2`` (two
supervisors as two nodes on this machine, ``launch.nodes=2 launch.node_rank=R`` at one endpoint, node
0's serving the job's store; rank 2, on node 1, is SIGKILLed), inside the gradient averaging of a random step;
and ``2x2-node``: node 1 lost whole (its supervisor's process group SIGKILLed, both its workers with it)
once rank 0 logged the step before the random one.
For ResNet-18 on digits and the 8-block LLaMA on the standard library's source, each trial reports

- seconds from the kill (the kill's marker file) to the end of the first step after it (rank 0's
  TensorBoard event times): detection, agreement, re-formed groups, the heal, the re-plan and one step;
- finished steps trained twice: the step the survivors went on from against the last one finished
  before the kill (0 when none is lost);
- bytes moved to heal (the payload of the heal's messages, as the line prints it: the units that gained an owner
  and the buffer copies their means need);
- the union model's loss at the end against an uninterrupted run of the same steps at 4 workers
  (quality of going on at W-1 after the death; the same seed and data).

    .venv/bin/python benchmarks/inprocess.py [--steps 200 --trials 5 --models resnet,llama --shapes 1x4,2x2]

``--no-reference`` skips the uninterrupted runs (and the union loss). Writes ``inprocess.json`` (or
``--out``) under the results directory (``_results.py``) and prints a table. The
restart paths it replaces are measured by ``benchmarks/recovery.py`` (torchrun restarts every worker).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise
from subnetdp.train import faults

MODELS = {
    "resnet": ["resnet18_digits", "train.batch_size=4", "eval.bn_recalibrate_batches=0", "optim.warmup_steps=0"],
    "llama": ["llama_tiny_stdlib", "model.dim=128", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2",
              "train.batch_size=4", "data.seq_len=64", "optim.warmup_steps=0"],
}


SHAPES = {"1x4": (1, 4), "2x2": (2, 2), "2x2-node": (2, 2)}  # nodes (supervisors) x workers each
#: The rank killed inside the averaging: in 2x2 a worker of node 1 (the node not serving the store).
#: 2x2-node kills no worker: node 1's supervisor is SIGKILLed (its workers with it) after the step.
KILLED = {"1x4": 1, "2x2": 2, "2x2-node": None}


def _args(model: str, steps: int, tmp: Path, name: str, shape: str = "1x4") -> list[str]:
    nodes, nproc = SHAPES[shape]
    return ["train", *MODELS[model], f"train.steps={steps}", "train.log_every=1", "eval.every=0",
            "masker.coverage=0.5", "masker.min_owners=2", "launch.threads_per_rank=1", "train.progress=false",
            "checkpoint.final=never", f"launch.nproc={nproc}", f"launch.nodes={nodes}", "launch.on_failure=continue",
            "comm.timeout_s=60", f"run.dir={tmp}", f"run.name={name}"]


def _logged(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [int(r["step"]) for r in rows if "train/loss" in r]


def _run(args: list[str], env: dict[str, str], lose_node_after: int | None = None) -> subprocess.CompletedProcess:
    """The job: one ``subnetdp train``, or one per node (``launch.nodes``) at one endpoint, node 0 first.
    The result's output is every node's, node 0's first; its code the first non-zero one (node 0's
    alone when the last node is made to vanish after step ``lose_node_after``: then ``killed_at`` and
    ``last_before``, the last step logged before the kill, ride on the result)."""
    nodes = int(next(a for a in args if a.startswith("launch.nodes=")).split("=")[1])
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    if nodes == 1:
        return subprocess.run([sys.executable, "-m", "subnetdp", *args], capture_output=True, text=True, timeout=7200,
                              env=full_env)
    from subnetdp.plugins.comm._rendezvous import free_port

    run = Path(next(a for a in args if a.startswith("run.dir=")).split("=", 1)[1]) / \
        next(a for a in args if a.startswith("run.name=")).split("=", 1)[1]
    where = [f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"]
    logs = [open(f"{run}.node{n}.out", "w+") for n in range(nodes)]  # files: a pipe nobody reads would fill
    procs = [subprocess.Popen([sys.executable, "-m", "subnetdp", *args, *where, f"launch.node_rank={n}"],
                              stdout=logs[n], stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True)
             for n in range(nodes)]
    killed_at = last_before = None
    if lose_node_after is not None:
        while max(_logged(run / "metrics.jsonl"), default=0) < lose_node_after and procs[0].poll() is None:
            time.sleep(0.05)
        killed_at, last_before = time.time(), max(_logged(run / "metrics.jsonl"), default=0)
        os.killpg(procs[-1].pid, signal.SIGKILL)  # the node vanishes: its supervisor, its workers with it
    codes = [p.wait(timeout=7200) for p in procs]
    if lose_node_after is not None:
        codes = codes[:1]
    outs = []
    for f in logs:
        f.seek(0)
        outs.append(f.read())
        f.close()
    done = subprocess.CompletedProcess(args, next((c for c in codes if c), 0), "".join(outs), "")
    done.killed_at, done.last_before = killed_at, last_before  # type: ignore[attr-defined]
    return done


def _first_step_after(run: Path, step: int, since: float) -> float | None:
    """Wall time at which rank 0 logged its first step after ``step`` later than ``since``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard" / "rank_0"), size_guidance={"scalars": 0})
    acc.Reload()
    times = [e.wall_time for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag) if e.step > step and e.wall_time > since]
    return min(times) if times else None


def _union_loss(run: Path) -> float:
    return float(json.loads((run / "summary.json").read_text())["eval"]["loss"])


def trial(model: str, kill: int, steps: int, tmp: Path, shape: str = "1x4") -> dict[str, Any]:
    name = f"{model}-{shape}-k{kill}"
    node_loss = KILLED[shape] is None
    env = {} if node_loss else {faults.KILL_IN_SYNC: str(kill), faults.KILL_RANK: str(KILLED[shape])}
    p = _run(_args(model, steps, tmp, name, shape), env, lose_node_after=kill - 1 if node_loss else None)
    run = tmp / name
    out = p.stdout + p.stderr
    if p.returncode != 0:
        kept = results_dir() / f"inprocess-{name}.log"
        kept.write_text(f"exit {p.returncode}\n{out}")
        print(f"{name}: exit {p.returncode}; its output is in {kept}", file=sys.stderr, flush=True)
        return {"model": model, "shape": shape, "kill_step": kill, "exit": p.returncode}
    went = re.search(r"go on in-process from step (\d+): (\d+) piece\(s\) gained an owner over the network "
                     r"\(([\d.]+) MiB .*?\), re-formed in ([\d.]+) s", out)
    if node_loss:
        killed_at, last_before = p.killed_at, p.last_before  # type: ignore[attr-defined]
    else:
        killed_at, last_before = faults.fault_marker(run, faults.KILL_IN_SYNC, kill, KILLED[shape]).stat().st_mtime, kill - 1
    first = _first_step_after(run, int(went.group(1)) if went else last_before, killed_at)
    summary = json.loads((run / "summary.json").read_text())
    return {"model": model, "shape": shape, "kill_step": kill, "exit": 0, "went_on_from": int(went.group(1)) if went else None,
            "steps_trained_twice": max(0, last_before - int(went.group(1))) if went else None,
            "pieces_healed": int(went.group(2)) if went else None, "seconds_reformation": float(went.group(4)) if went else None,
            "seconds_kill_to_next_step": (first - killed_at) if first else None, "heal_mib": float(went.group(3)) if went else None,
            "union_loss": _union_loss(run), "world_size_at_end": summary["world_size"],
            "agreement_waited_out": "neither checked in nor were marked dead" in out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--models", default="resnet,llama")
    ap.add_argument("--shapes", default="1x4", help="comma-separated: 1x4 (one supervisor), 2x2 (two nodes), 2x2-node (node 1 lost whole)")
    ap.add_argument("--no-reference", action="store_true", help="skip the uninterrupted runs (no union loss)")
    ap.add_argument("--out", default="inprocess.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    kills = [rng.randrange(2, args.steps) for _ in range(args.trials)]
    shapes = args.shapes.split(",")
    rows, refs = [], {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for model in args.models.split(","):
            if not args.no_reference:
                ref = _run(_args(model, args.steps, tmp, f"ref-{model}"), {})
                if ref.returncode != 0:
                    sys.exit(f"the uninterrupted reference run ({model}) failed:\n{ref.stderr[-3000:]}")
                refs[model] = _union_loss(tmp / f"ref-{model}")
            for kill in kills:
                for shape in shapes:  # interleaved: both shapes see the same load
                    rows.append(trial(model, kill, args.steps, tmp, shape))
                    print(json.dumps(rows[-1]), flush=True)
    out = results_dir() / args.out
    out.write_text(json.dumps({"args": vars(args), "load": os.getloadavg(), "reference_union_loss": refs,
                               "rows": rows}, indent=1))
    print("\n| model | shape | kill steps | trained twice | s kill -> next step (median, max) | re-formation s (median) "
          "| MiB healed (mean) | union loss: after a death / uninterrupted |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for shape in shapes:
            rs = [r for r in rows if r["model"] == model and r["shape"] == shape and r["exit"] == 0]
            secs = [r["seconds_kill_to_next_step"] for r in rs if r["seconds_kill_to_next_step"] is not None]
            reform = [r["seconds_reformation"] for r in rs if r["seconds_reformation"] is not None]
            losses = [r["union_loss"] for r in rs]
            ref = f"{refs[model]:.4f}" if model in refs else "-"
            print(f"| {model} | {shape} | {[r['kill_step'] for r in rs]} | {[r['steps_trained_twice'] for r in rs]} | "
                  f"{statistics.median(secs):.2f}, {max(secs):.2f} | {statistics.median(reform):.2f} | "
                  f"{statistics.mean(r['heal_mib'] for r in rs):.1f} | {statistics.mean(losses):.4f} / {ref} |"
                  if rs and secs and reform else f"| {model} | {shape} | no trial finished |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
