"""LLaMA ``tiny`` on the Python standard library: DDP vs B-SDP vs N-SDP at C = 0.5, 2 (or more) workers.

Runs the recipe ``llama_tiny_stdlib`` three times through the real command line (``subnetdp train``,
which starts 2 local gloo workers): at coverage 1 (every rank holds the whole model: DDP — the test
suite checks that subnetdp at C = 1 matches torch's DistributedDataParallel parameter for parameter),
at coverage 0.5 with block-level masking (B-SDP: each rank holds 2 of the 4 blocks) and at coverage
0.5 with neuron-level masking (N-SDP, ``masker.granularity=neuron``: each rank holds 4 of the 8
SwiGLU hidden ranges of every layer). Same seed, data, steps and schedule. Reports the union
model's validation loss and perplexity after the same number of steps, the parameters and peak
tensor memory per rank, bytes sent per step and step time, and draws the training and validation
loss curves.

Run: ``.venv/bin/python benchmarks/llama_tiny_stdlib.py [--steps 300] [--workers 2]`` (about 3
minutes on 2 idle cores with 2 workers; 149 s measured). Writes ``benchmarks/results/llama_tiny_stdlib.json`` and
``llama_tiny_stdlib.png`` (``..._w4.json`` / ``.png`` with ``--workers 4``).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise

RESULTS = results_dir()
# label: (coverage, granularity)
RUNS = {"DDP (C=1)": (1.0, "block"), "B-SDP (C=0.5)": (0.5, "block"),
        "N-SDP (C=0.5)": (0.5, "neuron")}


def run(coverage: float, granularity: str, steps: int, eval_every: int, tmp: Path, workers: int) -> dict:
    name = f"c{coverage:g}-{granularity}-w{workers}"
    cmd = [str(Path(sys.executable).parent / "subnetdp"), "train", "llama_tiny_stdlib",
           f"masker.coverage={coverage}", f"masker.granularity={granularity}", f"launch.nproc={workers}", f"train.steps={steps}", f"eval.every={eval_every}",
           f"train.log_every={eval_every}", f"run.dir={tmp}", f"run.name={name}", f"data.cache_dir={tmp / 'data'}",
           "train.progress=false"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp / name / "summary.json").read_text())
    return {"coverage": coverage, "granularity": granularity, "command": " ".join(cmd[1:]), "wall_s": wall,
            "train": [(r["step"], r["train/loss"]) for r in records if "train/loss" in r],
            "eval": [(r["step"], r["eval/loss"]) for r in records if "eval/loss" in r],
            "final_eval": summary["eval"], "ranks": summary["ranks"], "full_model_params": summary["full_model_params"]}


def plot(results: dict[str, dict], path: Path, workers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for label, r in results.items():
        axes[0].plot(*zip(*r["train"]), label=label)
        axes[1].plot(*zip(*r["eval"]), marker="o", label=label)
    axes[0].set_title("training loss (mean over ranks and log interval)")
    axes[1].set_title("validation loss of the union model")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("next-token cross entropy (nats)")
    fig.suptitle(f"LLaMA tiny on the Python standard library (bytes), {workers} workers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--workers", type=int, default=2, help="local workers (the recipe's 2 by default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {label: run(c, g, args.steps, args.eval_every, Path(tmp), args.workers)
                   for label, (c, g) in RUNS.items()}
    ddp = results["DDP (C=1)"]
    head = (f"{'run':>14} {'val loss':>8} {'ppl':>6} {'vs DDP':>7} {'params/rank':>11} {'peak MiB':>8} "
            f"{'MiB sent/step':>13} {'ms/step':>7}")
    lines = [f"after {args.steps} steps, {args.workers} workers", head, "-" * len(head)]
    for label, r in results.items():
        rank = max(r["ranks"], key=lambda x: x["params_held"])
        lines.append(f"{label:>14} {r['final_eval']['loss']:>8.4f} {r['final_eval']['perplexity']:>6.2f} "
                     f"{r['final_eval']['loss'] - ddp['final_eval']['loss']:>+7.4f} {rank['params_held']:>11,} "
                     f"{rank['peak_memory_bytes'] / 2**20:>8.1f} {rank['bytes_sent_per_step'] / 2**20:>13.3f} "
                     f"{rank['step_time_s'] * 1000:>7.0f}")
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "llama_tiny_stdlib" + ("" if args.workers == 2 else f"_w{args.workers}")
    plot(results, RESULTS / f"{stem}.png", args.workers)
    out = {"benchmark": "llama_tiny_stdlib", "steps": args.steps, "workers": args.workers, "platform": platform.platform(),
           "memory_measured_by": "dispatch tracker (tensors only; not gloo's buffers)", "runs": results, "table": table}
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=2))
    print(f"\nwrote {RESULTS / stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
