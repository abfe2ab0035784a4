"""What a replacement's join costs the survivors (``launch.on_failure=continue launch.replace=1``).

4 workers under subnetdp's supervisor, C = 0.5 with ``masker.min_owners=2``, N steps; rank 1 is
SIGKILLed inside the gradient averaging of step K, the survivors go on at W=3, the supervisor starts a
replacement and the members take it in at the boundary after step J. Each trial reports, from rank
0's console and TensorBoard event times:

- seconds from the kill (its marker file) to the first finished step after it (going on at W-1);
- the join's step J and its re-formation as the members measure it (world of W, owner groups, heal,
  re-plan: the printed line), and the pieces and MiB sent to the newcomer;
- the pause at the join: the wall time from step J to step J+1 (the first step at W) on rank 0, and
  the median step time at W after it (the pause is the difference);
- the members' per-step check for a joiner: one ``TCPStore.check`` (timed here over 2,000 calls).

    .venv/bin/python benchmarks/rejoin.py [--steps 60 --kill 10 --trials 3 --out rejoin.json]

Writes ``rejoin.json`` (or ``--out``) under the results directory (``_results.py``) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import results_dir  # benchmarks/_results.py
from inprocess import _args, _first_step_after, _run  # benchmarks/inprocess.py: the same runs, one more key
from subnetdp.train import faults


def _step_times(run: Path) -> dict[int, float]:
    """Rank 0's wall time of each logged step (its loss scalar's event)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard" / "rank_0"), size_guidance={"scalars": 0})
    acc.Reload()
    tag = next(t for t in acc.Tags()["scalars"] if t.endswith("loss"))
    return {e.step: e.wall_time for e in acc.Scalars(tag)}


def trial(kill: int, steps: int, tmp: Path, i: int) -> dict[str, Any]:
    name = f"rejoin-{i}"
    p = _run([*_args("resnet", steps, tmp, name), "launch.replace=1"], {faults.KILL_IN_SYNC: str(kill)})
    out, run = p.stdout + p.stderr, tmp / name
    if p.returncode != 0:
        kept = results_dir() / f"{name}.log"
        kept.write_text(f"exit {p.returncode}\n{out}")
        return {"kill_step": kill, "exit": p.returncode}
    killed_at = faults.fault_marker(run, faults.KILL_IN_SYNC, kill, 1).stat().st_mtime
    first = _first_step_after(run, kill - 1, killed_at)
    joined = re.search(r"joined as rank \d+ after step (\d+): .*?(\d+) piece\(s\) sent to it over the network "
                       r"\(([\d.]+) MiB.*?in ([\d.]+) s", out)
    row: dict[str, Any] = {"kill_step": kill, "exit": 0, "seconds_kill_to_next_step": (first - killed_at) if first else None,
                           "world_size_at_end": json.loads((run / "summary.json").read_text())["world_size"]}
    if joined:
        j = int(joined.group(1))
        t = _step_times(run)
        after = [t[s + 1] - t[s] for s in range(j + 1, steps) if s in t and s + 1 in t]
        row.update(join_step=j, pieces_sent=int(joined.group(2)), mib_sent=float(joined.group(3)),
                   seconds_join_reformation=float(joined.group(4)), seconds_step_j_to_j1=t[j + 1] - t[j],
                   median_step_at_w=statistics.median(after) if after else None)
        if after:  # the members' pause: the join's boundary less one step, in seconds and in steps
            row["pause_s"] = row["seconds_step_j_to_j1"] - row["median_step_at_w"]
            row["pause_steps"] = row["pause_s"] / row["median_step_at_w"]
    return row


def store_check_cost(calls: int = 2000) -> float:
    """Seconds of one ``check`` of a missing key on a loopback ``TCPStore`` (the members' per-step cost)."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    start = time.perf_counter()
    for _ in range(calls):
        client.check(["subnetdp/join/next"])
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill", type=int, default=10)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default="rejoin.json")
    args = ap.parse_args()
    check = store_check_cost()
    rows = []
    with tempfile.TemporaryDirectory() as tmp_s:
        for i in range(args.trials):
            rows.append(trial(args.kill, args.steps, Path(tmp_s), i))
            print(json.dumps(rows[-1]), flush=True)
    out = results_dir() / args.out
    out.write_text(json.dumps({"args": vars(args), "load": os.getloadavg(), "store_check_s": check, "rows": rows}, indent=1))
    print(f"\nper-step check for a joiner: {check * 1e6:.0f} us (one TCPStore.check, loopback)")
    print("| trial | s kill -> next step | join after step | join re-formation s | step J -> J+1 s | median step at W s "
          "| members' pause s (steps) | pieces, MiB sent | world at end |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        if r["exit"] != 0 or "join_step" not in r:
            print(f"| {i} | exit {r['exit']}, no join |")
            continue
        print(f"| {i} | {r['seconds_kill_to_next_step']:.2f} | {r['join_step']} | {r['seconds_join_reformation']:.2f} | "
              f"{r['seconds_step_j_to_j1']:.2f} | {r['median_step_at_w']:.2f} | {r['pause_s']:.2f} ({r['pause_steps']:.2f}) | "
              f"{r['pieces_sent']}, {r['mib_sent']:.1f} | "
              f"{r['world_size_at_end']} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
