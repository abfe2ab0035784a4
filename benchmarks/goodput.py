"""Goodput at cluster scale: checkpoint-restart, today's restart from the survivors, and in-process going on.

    .venv/bin/python benchmarks/goodput.py [--gpus 1024,4096,16384] [--inprocess-s S] [--restart-s 30,90,300]

A model, not a run: it combines the costs measured on these machines (and, where a cluster differs,
published ones) with a published failure rate, and says where each number comes from.

- **Failures**: Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in a 54-day
  snapshot of pre-training on 16,384 H100 GPUs. Failures are taken as a Poisson process whose rate
  grows with the job's GPU count: ``lam(N) = N * 419 / (16384 * 54 days)``.
- **Checkpoint-restart** (every GPU restarts from the newest checkpoint): a checkpoint every ``tau``
  seconds costs ``delta`` seconds of writing; a failure costs the restart ``R`` plus the work since
  the last checkpoint (``tau / 2`` on average). ``tau`` is Young's optimum ``sqrt(2 delta / lam)``.
  Wasted share: ``delta / tau + lam (R + tau / 2)``.
- **Survivors' restart** (today: every unit kept an owner, so no finished step is lost, but every GPU
  restarts): a failure costs ``R``; a checkpoint every ``--safety-net-s`` (an hour) stays for a failure
  that takes every owner of a unit. Wasted share: ``delta / tau_s + lam R``.
- **In-process** (the survivors go on; a replacement joins later): a failure costs every GPU the
  re-formation ``T_ip`` (detection, agreement, new groups, heal, re-plan) and at most the step in
  flight ``t_step``, and costs one GPU's work until its replacement joins (``R``, the time a fresh
  worker takes to start). Wasted share: ``delta / tau_s + lam (T_ip + t_step + R / N)``.

Goodput is ``1 - wasted share`` (the share of GPU time spent on steps that are kept). ``R`` is given
three ways: the restart measured here (``benchmarks/results/recovery.json``, the survivors' runs:
seconds from the kill to the next finished step), and 90 s and 300 s, the range of a full restart on a
Kubernetes GPU cluster that torchft reports. ``delta`` is ``benchmarks/results/checkpoint_cost.json``'s
save time per rank unless given. ``T_ip`` comes from ``--inprocess-s`` (a measured kill-to-next-step
of the in-process path) or, without it, from the re-formation measured in ``docs/inprocess.md``
(communicator only: the re-plan and heal are not in it), said so in the output.

Writes ``goodput.json`` under the results directory (``_results.py``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from _results import results_dir

HERE = Path(__file__).resolve().parent
LLAMA3_INTERRUPTIONS, LLAMA3_GPUS, LLAMA3_DAYS = 419, 16384, 54
#: the communicator's re-formation measured in docs/inprocess.md (kill to the first all-reduce on the
#: re-formed world, three survivors of four, gloo on this 2-core machine): 0.067-0.146 s.
REFORM_MEASURED_S = 0.146


def failure_rate(gpus: int) -> float:
    """Failures per second of a job on ``gpus`` GPUs, at Llama 3's per-GPU rate."""
    return gpus * LLAMA3_INTERRUPTIONS / (LLAMA3_GPUS * LLAMA3_DAYS * 86400.0)


def waste_checkpoint_restart(lam: float, delta: float, restart: float) -> tuple[float, float]:
    """(wasted share, checkpoint interval) at Young's optimal interval."""
    tau = math.sqrt(2.0 * delta / lam)
    return delta / tau + lam * (restart + tau / 2.0), tau


def waste_survivors(lam: float, delta: float, restart: float, safety_net: float) -> float:
    return delta / safety_net + lam * restart


def waste_inprocess(lam: float, delta: float, restart: float, safety_net: float, reform: float, step: float,
                    gpus: int) -> float:
    return delta / safety_net + lam * (reform + step + restart / gpus)


def measured_restart_s() -> float | None:
    """Median seconds from the kill to the next finished step of the survivors' restarts measured here."""
    path = HERE / "results" / "recovery.json"
    if not path.is_file():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"] if r.get("survivors") and r.get("seconds_kill_to_next_step")]
    return statistics.median(r["seconds_kill_to_next_step"] for r in rows) if rows else None


def measured_checkpoint() -> tuple[float, float] | None:
    """(save seconds per rank, step seconds) of ``checkpoint_cost.json``."""
    path = HERE / "results" / "checkpoint_cost.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())["result"]
    return float(result["save_s"]), float(result["step_s"])


def table(gpus: list[int], restarts: list[tuple[str, float]], delta: float, step: float, reform: float,
          safety_net: float) -> list[dict]:
    rows = []
    for n in gpus:
        lam = failure_rate(n)
        for label, r in restarts:
            cr, tau = waste_checkpoint_restart(lam, delta, r)
            rows.append({"gpus": n, "mtbf_h": 1.0 / lam / 3600.0, "restart": label, "restart_s": r,
                         "checkpoint_interval_s": tau,
                         "goodput": {"checkpoint_restart": 1.0 - cr,
                                     "survivors_restart": 1.0 - waste_survivors(lam, delta, r, safety_net),
                                     "in_process": 1.0 - waste_inprocess(lam, delta, r, safety_net, reform, step, n)}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1024,4096,16384")
    ap.add_argument("--restart-s", default="", help="restart seconds to try (default: measured here, 90, 300)")
    ap.add_argument("--checkpoint-s", type=float, default=None, help="seconds to write a checkpoint (default: measured)")
    ap.add_argument("--step-s", type=float, default=None, help="step seconds (default: measured with the checkpoint)")
    ap.add_argument("--inprocess-s", type=float, default=None,
                    help="measured seconds from a kill to the next step of the in-process path")
    ap.add_argument("--safety-net-s", type=float, default=3600.0,
                    help="checkpoint interval kept when the survivors recover (default: an hour)")
    args = ap.parse_args()
    sources = {"failures": f"Llama 3: {LLAMA3_INTERRUPTIONS} interruptions in {LLAMA3_DAYS} days on {LLAMA3_GPUS} GPUs"}
    ckpt = measured_checkpoint()
    delta = args.checkpoint_s if args.checkpoint_s is not None else (ckpt[0] if ckpt else 60.0)
    step = args.step_s if args.step_s is not None else (ckpt[1] if ckpt else 1.0)
    sources["checkpoint_s"] = "given" if args.checkpoint_s is not None else (
        "benchmarks/results/checkpoint_cost.json (ResNet-18, one CPU rank)" if ckpt else "assumed: 60 s")
    sources["step_s"] = "given" if args.step_s is not None else (
        "benchmarks/results/checkpoint_cost.json" if ckpt else "assumed: 1 s")
    if args.restart_s:
        restarts = [(f"{float(r):g} s (given)", float(r)) for r in args.restart_s.split(",")]
    else:
        here = measured_restart_s()
        restarts = ([(f"{here:.0f} s (measured here)", here)] if here else []) + \
                   [("90 s (torchft, k8s)", 90.0), ("300 s (torchft, k8s)", 300.0)]
    reform = args.inprocess_s if args.inprocess_s is not None else REFORM_MEASURED_S
    sources["in_process_s"] = ("given (measured kill to next step)" if args.inprocess_s is not None else
                               f"{REFORM_MEASURED_S} s: the communicator's re-formation only (docs/inprocess.md); "
                               "the loop's re-plan and heal are not in it")
    rows = table([int(g) for g in args.gpus.split(",")], restarts, delta, step, reform, args.safety_net_s)
    out = {"args": vars(args), "sources": sources, "checkpoint_s": delta, "step_s": step, "in_process_s": reform,
           "rows": rows}
    path = results_dir() / "goodput.json"
    path.write_text(json.dumps(out, indent=1))
    for k, v in sources.items():
        print(f"{k}: {v}")
    print(f"\n{'GPUs':>6} {'MTBF':>7} {'restart':>24} {'ckpt every':>10} {'ckpt-restart':>12} {'survivors':>10} "
          f"{'in-process':>10}")
    for r in rows:
        g = r["goodput"]
        print(f"{r['gpus']:>6} {r['mtbf_h']:>6.2f}h {r['restart']:>24} {r['checkpoint_interval_s']:>9.0f}s "
              f"{g['checkpoint_restart']:>12.4f} {g['survivors_restart']:>10.4f} {g['in_process']:>10.4f}")
    print(f"\nwrote {path}")
    print(f"wrote {plot(rows, results_dir() / 'goodput.png')}")


def plot(rows: list[dict], path: Path) -> Path:
    """Goodput against GPUs, one line per strategy and restart time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {"checkpoint_restart": "tab:red", "survivors_restart": "tab:orange", "in_process": "tab:green"}
    for label in dict.fromkeys(r["restart"] for r in rows):
        mine = [r for r in rows if r["restart"] == label]
        dash = ["-", "--", ":"][list(dict.fromkeys(r["restart"] for r in rows)).index(label) % 3]
        for kind, colour in styles.items():
            ax.plot([r["gpus"] for r in mine], [100 * r["goodput"][kind] for r in mine], dash, color=colour,
                    marker="o", label=f"{kind.replace('_', ' ')}, restart {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("goodput (% of GPU time kept)")
    ax.set_title("Failures at Llama 3's rate: what each recovery keeps")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
