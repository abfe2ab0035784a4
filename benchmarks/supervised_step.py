"""What the supervisor's watch costs a job's steps when nobody dies (``launch.on_failure=continue``).

Under subnetdp's supervisor every collective's wait also watches the job's store for a death mark
(``plugins/comm/regroup.py``: ``wait_or_regroup``), so a survivor two hops from a dead rank learns of it
within one look instead of at ``comm.timeout_s``. This runs the same job with no failure under torch's
elastic agent (``launch.on_failure=restart``, the default) and under the supervisor (``continue``),
interleaved, and reports each one's median step time (``train/step_time_s`` of ``metrics.jsonl``, the
first ``--skip`` steps left out) and their ratio: 4 workers, C = 0.5, ``masker.min_owners=2``.

    .venv/bin/python benchmarks/supervised_step.py [--steps 40 --trials 2 --models resnet,llama]
    .venv/bin/python benchmarks/supervised_step.py --tree /path/to/another/checkout   # its code, same figures

``--tree`` runs the workers from another checkout of the project (its directory first on the path), to
set a change against the code before it in one sitting. Writes ``supervised_step.json`` (or ``--out``)
under the results directory (``_results.py``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _results import results_dir  # benchmarks/_results.py
from inprocess import MODELS  # benchmarks/inprocess.py: the same two jobs


def run(model: str, mode: str, steps: int, tmp: Path, name: str, tree: str | None) -> list[float]:
    args = [sys.executable, "-m", "subnetdp", "train", *MODELS[model], f"train.steps={steps}", "train.log_every=1",
            "eval.every=0", "masker.coverage=0.5", "masker.min_owners=2", "launch.threads_per_rank=1",
            "train.progress=false", "checkpoint.final=never", "launch.nproc=4", f"launch.on_failure={mode}",
            f"run.dir={tmp}", f"run.name={name}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if tree:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(args, capture_output=True, text=True, timeout=3600, env=env, cwd=tree or None)
    if done.returncode != 0:
        raise SystemExit(f"{model} under {mode} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["train/step_time_s"] for r in rows if "train/step_time_s" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the median (warm-up)")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--models", default="resnet,llama")
    ap.add_argument("--tree", default=None, help="run the workers from this checkout of the project")
    ap.add_argument("--out", default="supervised_step.json")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_s:
        for model in args.models.split(","):
            for i in range(args.trials):
                for mode in ("restart", "continue"):  # interleaved: both see the same load
                    times = run(model, mode, args.steps, Path(tmp_s), f"{model}-{mode}-{i}", args.tree)[args.skip:]
                    rows.append({"model": model, "mode": mode, "trial": i, "median_step_s": statistics.median(times),
                                 "load": os.getloadavg()[0]})
                    print(json.dumps(rows[-1]), flush=True)
    out = results_dir() / args.out
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print("\n| model | trial | restart (torchrun agent) s | continue (supervisor) s | ratio | load |")
    print("|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for i in range(args.trials):
            a, b = (next(r for r in rows if r["model"] == model and r["trial"] == i and r["mode"] == m)
                    for m in ("restart", "continue"))
            print(f"| {model} | {i} | {a['median_step_s']:.3f} | {b['median_step_s']:.3f} | "
                  f"{b['median_step_s'] / a['median_step_s']:.2f} | {b['load']:.1f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
