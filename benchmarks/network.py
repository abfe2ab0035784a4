"""Where the network is the bottleneck: step time and time to DDP's loss on shaped links, and the cost
of many owner groups. Needs root (``benchmarks/shaped_link.py`` makes the links); docs/network.md.

Part ``steps`` (per task: ResNet-18 digits and ``llama8`` of ``benchmarks/evidence_tasks.py``, 4
workers), every row at 10 Gbit/s, 1 Gbit/s and 100 Mbit/s:

- torch DDP (the real ``DistributedDataParallel``), subnetdp at C = 1, SDP at C = 0.75 and 0.5 (block
  and neuron), SDP C = 0.5 (block) with local steps H = 16, DDP (C = 1) with local steps H = 16;
- at 1 Gbit/s and 100 Mbit/s a short run per row (``--short-steps``; H rows one whole cycle), at
  10 Gbit/s the row's full run of the task's steps with validation every ``eval_every`` steps (the
  loss curve), plus FLOP-matched runs of the C = 0.5 rows; torch DDP and C = 1 run twice at 1 Gbit/s.

Reported per row and link: step time (median interval between step ends over the timed steps and
ranks; H rows: ((H - 1) x median local step + median synchronising step) / H) and its ratio to torch
DDP on the same link, payload and ring wire bytes per rank per step, bytes the namespace's loopback
sent per step (all ranks, headers included), the share of the gradient communication hidden behind
backward, collectives per step, and the wall-clock to reach DDP's validation loss after the task's
steps: (first step where the row's curve reaches it) x (its step time on that link). Loss does not
depend on the link: every row runs at 1 Gbit/s and 100 Mbit/s with the same seed and steps, and the
report checks that their losses are identical.

Part ``groups`` (``llama8``, 8 workers, C = 0.5, 100 Mbit/s): block and neuron level, cyclic and
random maskers, grouped and dense synchronisation (the two choices ``sync.max_groups`` selects
between), bucket caps; owner sets, collectives and ring hops per step, step time, and the latency
those hops would add at 5 and 50 us per hop (alpha-beta model).

A shaped loopback is one shared medium: all ranks' traffic shares the one rate (as if every worker
sat behind a single link), not a link per worker. Compare rows only on the same link.

Usage (root)::

    .venv/bin/python benchmarks/network.py                          # both parts, ~80 min on 2 cores
    .venv/bin/python benchmarks/network.py --parts steps --tasks llama8
    .venv/bin/python benchmarks/network.py --report                 # tables and plots from stored runs

Runs already stored in the output folder are kept (delete it to measure again).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import shaped_link  # noqa: E402
from benchmarks.evidence_tasks import TASKS  # noqa: E402
from benchmarks._results import results_dir  # noqa: E402

LINKS = {"10gbit": 10e9, "1gbit": 1e9, "100mbit": 1e8}
CACHE_DIR = Path(tempfile.gettempdir()) / "subnetdp-network-cache"  # llama8's BPE corpus, built once
CURVE_LINK = "10gbit"
H = 16
ROWS: dict[str, tuple[str, str, list[str]]] = {  # key: (label, kind, overrides)
    "ddp": ("torch DDP", "ddp", ["masker.coverage=1"]),
    "c1": ("subnetdp C=1", "sdp", ["masker.coverage=1"]),
    "b75": ("SDP C=0.75 block", "sdp", ["masker.coverage=0.75", "masker.granularity=block"]),
    "n75": ("SDP C=0.75 neuron", "sdp", ["masker.coverage=0.75", "masker.granularity=neuron"]),
    "b50": ("SDP C=0.5 block", "sdp", ["masker.coverage=0.5", "masker.granularity=block"]),
    "n50": ("SDP C=0.5 neuron", "sdp", ["masker.coverage=0.5", "masker.granularity=neuron"]),
    "h16": (f"SDP C=0.5 block + H={H}", "sdp", ["masker.coverage=0.5", "masker.granularity=block",
                                                "sync.mode=local_steps", f"sync.every={H}"]),
    "ddp_h16": (f"DDP (C=1) + H={H}", "sdp", ["masker.coverage=1", "sync.mode=local_steps", f"sync.every={H}"]),
}
FM_ROWS = {"b50": "b50", "n50": "n50", "h16": "b50"}  # FLOP-matched row -> the row whose FLOPs it has
# The curves each task runs here (``-fm``: FLOP-matched); llama8's C = 0.5 rows come from the evidence
# study's stored runs of the same rows and seed (this tree's C = 1 curve checks that they agree).
CURVE_ROWS = {"resnet18": ["c1", "b50", "n50", "h16", "ddp_h16", "b50-fm", "n50-fm"],
              "llama8": ["h16", "ddp_h16"]}
EVIDENCE_ROWS = {"c1": "DDP", "b50": "B-SDP", "n50": "N-SDP", "b50-fm": "B-SDP_FM", "n50-fm": "N-SDP_FM"}
# ResNet's stages have 2 blocks each: C = 0.75 is drawn over the whole model (masker.group_by=model).
TASK_ROW_EXTRA = {"resnet18": {"b75": ["masker.group_by=model"]}}
# Validation for the curves (the task's own, ResNet's made cheaper: 4 ranks evaluate the same batches),
# and a minimal one at the end of the short runs (the loop always evaluates after the last step).
CURVE = {"resnet18": (10, ["eval.batches=1", "eval.bn_recalibrate_batches=5"]), "llama8": (10, [])}
SHORT_EVAL = {"resnet18": ["eval.batches=1", "eval.batch_size=16", "eval.bn_recalibrate_batches=0"],
              "llama8": ["eval.batches=1", "eval.batch_size=2"]}
MARK_BEGIN, MARK_END = "<!-- network:begin -->", "<!-- network:end -->"
ALPHAS_US = (5.0, 50.0)
# Links of one rank each for the alpha-beta model of the groups part: (hop latency s, bytes/s).
MODEL_LINKS = {"5 us, 100 Gbit/s": (5e-6, 100e9 / 8), "50 us, 10 Gbit/s": (50e-6, 10e9 / 8),
               "50 us, 100 Mbit/s": (50e-6, 100e6 / 8)}


def alpha_beta_s(hops: float, ring_wire_bytes: float, alpha_s: float, bytes_per_s: float) -> float:
    """Seconds a rank spends in its collectives of one step by the alpha-beta model of ring all-reduce
    (Thakur, Rabenseifner and Gropp 2005): each all-reduce of n bytes among k ranks costs
    2(k-1) alpha + 2(k-1)/k n / B; summed over the rank's collectives (issued one after the other)."""
    return hops * alpha_s + ring_wire_bytes / bytes_per_s


# ----------------------------------------------------------------------------------------- planning
def flop_ratio(task: str, overrides: list[str], cache: str) -> float:
    """Forward FLOPs of the ranks' local models relative to the full model (mean over ranks), counted
    with ``FlopCounterMode`` on ``meta`` as ``benchmarks/evidence.py`` does."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from subnetdp.core.config import compose
    from subnetdp.core.plugins import PluginManager
    from subnetdp.sdp.variants import local_model
    from subnetdp.train.setup import build_plan

    t, pm = TASKS[task], PluginManager()
    out = []
    for ov in (["masker.coverage=1"], overrides):
        extra = [*ov] + ([f"data.cache_dir={cache}"] if t.data_cache else [])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = compose(t.recipe, t.overrides_for(1, extra), pm.registries)
        data, spec, adapter, full, partition, plan = build_plan(cfg, t.world_size, pm)
        flops = []
        for rank in range(t.world_size):
            with torch.device("meta"):
                model, _ = local_model(adapter, copy.deepcopy(full), plan.owned[rank], partition, cfg.masker)
            batch = next(iter(data.train_loader(rank, t.world_size, int(cfg.train.batch_size))))
            batch = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in batch)
            with FlopCounterMode(display=False) as f:
                adapter.training_loss(model, batch)
            flops.append(f.get_total_flops())
        out.append(sum(flops) / len(flops))
    return out[1] / out[0]


def row_overrides(task: str, key: str) -> list[str]:
    return [*ROWS[key][2], *TASK_ROW_EXTRA.get(task, {}).get(key, [])]


def steps_spec(task: str, args: argparse.Namespace, fm: dict[str, int]) -> dict[str, Any]:
    """Every run of part ``steps`` for ``task``: short runs at the slow links, then the curves."""
    t = TASKS[task]
    runs = []

    def add(name: str, key: str, rate: str, steps: int, extra: list[str], eval_every: int = 0) -> None:
        runs.append({"name": name, "row": key, "kind": ROWS[key][1], "rate": rate, "steps": steps,
                     "eval_every": eval_every, "overrides": [*row_overrides(task, key), *extra]})

    rows = [k for k in ROWS if k in args.rows]
    for link in [l for l in LINKS if l in args.links]:
        for key in rows:
            add(f"{link}-{key}", key, link, H + 1 if "h16" in key else args.short_steps, SHORT_EVAL[task])
        if link == "1gbit":  # the 3% question: a second pair, after the other rows
            for key in [k for k in ("ddp", "c1") if k in rows]:
                add(f"{link}-{key}-rep", key, link, args.short_steps, SHORT_EVAL[task])
    for i in range(args.pairs):  # more adjacent (torch DDP, C = 1) pairs: their ratio, paired in time
        for link in [l for l in LINKS if l in args.links]:
            for key in ("ddp", "c1"):
                add(f"{link}-{key}-p{i}", key, link, args.pair_steps, SHORT_EVAL[task])
    every, curve_eval = CURVE[task]
    steps = args.curve_steps or t.steps
    for key in [k for k in ROWS if k in args.curve_rows.get(task, [])]:
        add(f"curve-{key}", key, CURVE_LINK, steps, curve_eval, H if "h16" in key else every)
    for key in [k for k in FM_ROWS if k + "-fm" in args.curve_rows.get(task, [])]:
        add(f"curve-{key}-fm", key, CURVE_LINK, round(fm[key] * steps / t.steps), curve_eval,
            H if "h16" in key else every)
    return {"task": task, "world_size": t.world_size, "seed": args.seed, "cache_dir": args.cache, "runs": runs}


GROUP_ROWS: dict[str, list[str]] = {
    **{f"{gran} {masker} {mode}": [f"masker.granularity={gran}", f"masker.name={masker}",
                                   f"sync.max_groups={1 if mode == 'dense' else 1000}"]
       for gran, masker in (("block", "cyclic"), ("neuron", "random")) for mode in ("grouped", "dense")},
    "neuron random grouped, cap 1 MiB": ["masker.granularity=neuron", "masker.name=random", "sync.max_groups=1000",
                                         "sync.bucket_cap_mb=1"],
    "neuron random dense, cap 1 MiB": ["masker.granularity=neuron", "masker.name=random", "sync.max_groups=1",
                                       "sync.bucket_cap_mb=1"],
    "C=1, cap 25 MiB": ["masker.coverage=1"],
    "C=1, cap 1 MiB": ["masker.coverage=1", "sync.bucket_cap_mb=1"],
}


def groups_spec(args: argparse.Namespace) -> dict[str, Any]:
    runs = [{"name": f"100mbit-w{args.group_workers}-{i}", "row": name, "kind": "sdp", "rate": "100mbit",
             "steps": args.short_steps, "eval_every": 0,
             "overrides": ["masker.coverage=0.5", *ov, *SHORT_EVAL["llama8"]]} for i, (name, ov) in enumerate(GROUP_ROWS.items())]
    return {"task": "llama8", "world_size": args.group_workers, "seed": args.seed, "cache_dir": args.cache,
            "runs": runs}


def execute(spec: dict[str, Any], out: Path) -> None:
    """All runs of ``spec`` in one namespace (rank 0 of the workers sets each run's rate)."""
    out.mkdir(parents=True, exist_ok=True)
    todo = [r["name"] for r in spec["runs"] if not (out / f"{r['name']}.json").exists()]
    if not todo:
        return
    print(f"{spec['task']}, {spec['world_size']} workers: {len(todo)} runs ({', '.join(todo)})", flush=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    with shaped_link.shaped_namespace(None) as ns:
        rc = shaped_link.run_in(ns, [sys.executable, str(Path(__file__).with_name("_netrun.py")), str(spec_path),
                                     str(out)], env={"OMP_NUM_THREADS": "1"})
    if rc != 0:
        raise SystemExit(f"network: the runs of {spec['task']} failed (exit {rc}); finished runs are kept in {out}")


# ----------------------------------------------------------------------------------------- analysis
def _timed(run: dict[str, Any], rank: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps whose intervals are a step's cost: not the first two (set-up, DDP's bucket rebuild),
    not the last (the final evaluation and log), not the one after an evaluation (ranks leave it at
    different times). An evaluation step's interval is the loop's own time of the step."""
    evals = {s for s, _ in rank.get("evals", [])}
    last = run["run"]["steps"]
    return [s for s in rank["steps"] if 2 < s["step"] < last and s["step"] - 1 not in evals]


def _is_sync(run: dict[str, Any], step: int) -> bool:
    return "h16" in run["run"]["row"] and step % H == 0


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (see the module docstring)."""
    ranks, w = run["ranks"], run["run"]["world_size"]
    local_steps = "h16" in run["run"]["row"]
    timed = [(r, s) for r in ranks for s in _timed(run, r)]
    if local_steps:
        local = [s["interval_s"] for _, s in timed if not _is_sync(run, s["step"])]
        sync = [s["interval_s"] for _, s in timed if _is_sync(run, s["step"])]
        step_time = ((H - 1) * statistics.median(local) + statistics.median(sync)) / H if local and sync else None
        window = [s for _, s in timed]  # bytes: the whole timed window, cycles weighted by their steps
    else:
        step_time = statistics.median(s["interval_s"] for _, s in timed) if timed else None
        window = [s for _, s in timed]
    out: dict[str, Any] = {"step_time_s": step_time, "timed_steps": len({s["step"] for _, s in timed}),
                           "load": [run["ranks"][0]["load_before"][0], run["ranks"][0]["load_after"][0]],
                           "wall_s": ranks[0]["wall_s"]}
    phases: dict[str, list[float]] = {}
    for s in window:
        for phase, (n, b, hops) in s["collectives"].items():
            acc = phases.setdefault(phase, [0.0, 0.0, 0.0])
            acc[0] += n
            acc[1] += b
            acc[2] += hops
    n = max(1, len(window))
    if local_steps:  # per step over whole cycles: the synchronising step's traffic / H
        per = {p: [v / max(1, len([s for s in window if _is_sync(run, s["step"])])) / H for v in acc]
               for p, acc in phases.items()}
    else:
        per = {p: [v / n for v in acc] for p, acc in phases.items()}
    out["collectives_per_step"] = {p: v[0] for p, v in per.items()}
    out["hops_per_step"] = {p: v[2] for p, v in per.items()}
    out["payload_per_step"] = per.get("step", [0, 0, 0])[1]
    out["ring_wire_per_step"] = _ring_wire(ranks, run)
    r0 = [s for s in _timed(run, ranks[0]) if s["tx_bytes"] is not None]
    steps0 = {s["step"]: s for s in ranks[0]["steps"]}
    tx = [s["tx_bytes"] - steps0[s["step"] - 1]["tx_bytes"] for s in r0 if s["step"] - 1 in steps0]
    if local_steps and tx:  # rank 0's loopback counter over whole cycles
        syncs = [t for s, t in zip(r0, tx) if _is_sync(run, s["step"])]
        locs = [t for s, t in zip(r0, tx) if not _is_sync(run, s["step"])]
        tx_step = ((H - 1) * statistics.median(locs) + statistics.median(syncs)) / H if syncs and locs else None
    else:
        tx_step = statistics.median(tx) if tx else None
    out["loopback_bytes_per_step_per_rank"] = tx_step / w if tx_step is not None else None
    hidden = []
    for _, s in timed:
        if "first_launch" in s and s["comm_end"] > s["first_launch"]:
            span = s["comm_end"] - s["first_launch"]
            hidden.append(min(1.0, max(0.0, (s["backward_end"] - s["first_launch"]) / span)))
    out["overlap"] = statistics.mean(hidden) if hidden else None
    if local_steps and timed:  # no gradient collective between synchronisations: the sync step's extra time
        loc = [s["interval_s"] for _, s in timed if not _is_sync(run, s["step"])]
        syn = [s["interval_s"] for _, s in timed if _is_sync(run, s["step"])]
        out["sync_extra_s"] = statistics.median(syn) - statistics.median(loc) if loc and syn else None
    out["link_busy_s"] = (statistics.median(s["comm_end"] - s["first_launch"] for _, s in timed if "comm_end" in s)
                          if any("comm_end" in s for _, s in timed) else None)
    out["exposed_comm_s"] = (statistics.median(s["comm_end"] - s["backward_end"] for _, s in timed
                                               if "comm_end" in s) if any("comm_end" in s for _, s in timed) else None)
    parts = [(s["first_launch"], s["comm_end"] - s["first_launch"], s["interval_s"] - s["comm_end"])
             for _, s in timed if "first_launch" in s]
    # From the end of backward to the end of the step: what the synchroniser, the update and the loop
    # cost, without the forward/backward compute whose time the machine's load moves most.
    after = [s["interval_s"] - s["backward_end"] for _, s in timed if "backward_end" in s]
    out["after_backward_s"] = statistics.median(after) if after else None
    # Where a step's time goes: before the first gradient collective launches (forward, backward up to
    # the first full bucket), from then until the last one completes, and after (update, loop's own).
    out["phases_s"] = ([statistics.median(p[i] for p in parts) for i in range(3)] if parts else None)
    out["curve"] = ranks[0].get("evals", [])
    out["losses"] = [[s["loss"] for s in r["steps"]] for r in ranks]
    meta = ranks[0]
    out["owner_sets"], out["dense"], out["buckets"] = meta.get("owner_sets"), meta.get("dense"), meta.get("buckets")
    return out


def _ring_wire(ranks: list[dict[str, Any]], run: dict[str, Any]) -> float | None:
    """The ring estimate per rank per step, from the loop's own summary (mean over ranks)."""
    vals = [r["summary_rank"].get("wire_bytes_per_step_ring") for r in ranks if r.get("summary_rank")]
    vals = [v for v in vals if v is not None]
    if run["run"]["kind"] == "ddp":
        w = run["run"]["world_size"]
        pay = statistics.mean(s["collectives"].get("step", [0, 0])[1] for r in ranks for s in r["steps"][2:])
        return 2 * (w - 1) / w * pay
    return statistics.mean(vals) if vals else None


def crossing(curve: list[tuple[int, dict[str, float]]], target: float) -> float | None:
    """The first step where the validation loss reaches ``target`` (linear between evaluations)."""
    prev = None
    for step, metrics in curve:
        loss = metrics.get("loss")
        if loss is None:
            continue
        if loss <= target:
            if prev is None:
                return float(step)
            (s0, l0) = prev
            return s0 + (step - s0) * (l0 - target) / (l0 - loss) if l0 != loss else float(step)
        prev = (step, loss)
    return None


def load_runs(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name not in ("spec.json", "flops.json")}


def task_report(task: str, out: Path) -> dict[str, Any]:
    """Rows x links for one task: step times, ratios, bytes, overlap, time to DDP's loss."""
    runs = load_runs(out)
    s = {name: summarise(run) for name, run in runs.items()}
    rows: dict[str, Any] = {}
    for key, (label, _, _) in ROWS.items():
        row: dict[str, Any] = {"label": label, "links": {}}
        for link in LINKS:
            # The sweep's own runs (the extra pairs ran later, under another load: their table is below).
            names = [n for n in (f"{link}-{key}", f"{link}-{key}-rep") if n in s]
            times = [s[n]["step_time_s"] for n in names if s[n]["step_time_s"] is not None]
            if not names:
                continue
            first = s[names[0]]
            row["links"][link] = {"step_time_s": statistics.median(times) if times else None, "runs": names,
                                  "repeats": times, "payload_per_step": first["payload_per_step"],
                                  "ring_wire_per_step": first["ring_wire_per_step"],
                                  "loopback_bytes_per_step_per_rank": first["loopback_bytes_per_step_per_rank"],
                                  "overlap": first["overlap"], "exposed_comm_s": first["exposed_comm_s"],
                                  "link_busy_s": first["link_busy_s"], "sync_extra_s": first.get("sync_extra_s"),
                                  "collectives_per_step": first["collectives_per_step"],
                                  "hops_per_step": first["hops_per_step"], "load": first["load"]}
        rows[key] = row
    for key, row in rows.items():
        for link, cell in row["links"].items():
            base = rows["ddp"]["links"].get(link, {}).get("step_time_s")
            cell["ratio_to_ddp"] = cell["step_time_s"] / base if base and cell["step_time_s"] else None
    ttl = time_to_loss(task, runs, s, rows)
    pairs: dict[str, dict[str, Any]] = {}
    for link in LINKS:  # C = 1 over torch DDP in runs adjacent in time (the same load on the machine)
        for x in ("", "-rep", *(f"-p{i}" for i in range(20))):
            c1, ddp = f"{link}-c1{x}", f"{link}-ddp{x}"
            if c1 in s and ddp in s:
                rule = runs[c1]["ranks"][0].get("bucket_rule", "cap")  # runs before the field: capped buckets
                cell = pairs.setdefault(f"{link}, buckets: {rule}", {"ratios": [], "runs": [], "after": []})
                cell["ratios"].append(s[c1]["step_time_s"] / s[ddp]["step_time_s"])
                cell["runs"] += [ddp, c1]
                if s[c1]["after_backward_s"] is not None and s[ddp]["after_backward_s"] is not None:
                    cell["after"].append((s[ddp]["after_backward_s"], s[c1]["after_backward_s"]))
    for cell in pairs.values():
        cell["median"] = statistics.median(cell["ratios"])
    rows["c1"]["paired_ratio_to_ddp"] = pairs
    return {"rows": rows, "time_to_loss": ttl, "link_check": link_check(runs), "runs": s}


def evidence_curve(task: str, key: str, seed: int) -> tuple[list[Any], int] | None:
    """The curve of the evidence study's run of the same row and seed (``benchmarks/results/evidence``),
    when this benchmark did not run it: same task, same overrides, evaluated every 20 steps."""
    name = EVIDENCE_ROWS.get(key)
    path = ROOT / "benchmarks" / "results" / "evidence" / "runs" / task / f"{name}-s{seed}.json"
    if name is None or not path.is_file():
        return None
    rec = json.loads(path.read_text())
    if TASKS[task].metric != "loss":
        return None  # its curve holds the accuracy only
    return [(st, {"loss": v}) for st, v in rec["curve"]], int(rec["steps"])


def time_to_loss(task: str, runs: dict[str, Any], s: dict[str, Any], rows: dict[str, Any]) -> dict[str, Any]:
    """Time to DDP's validation loss after the task's steps: (first step where the row's curve reaches
    it) x (the row's step time on each link). DDP's loss: subnetdp C = 1's curve (C = 1 is DDP)."""
    seed = next(iter(runs.values()))["run"]["seed"] if runs else 0
    curves: dict[str, tuple[list[Any], int, str]] = {}
    for key in [*ROWS, *(k + "-fm" for k in FM_ROWS)]:
        if f"curve-{key}" in s:
            curves[key] = (s[f"curve-{key}"]["curve"], runs[f"curve-{key}"]["run"]["steps"], "this benchmark")
        elif (ev := evidence_curve(task, key, seed)) is not None:
            curves[key] = (ev[0], ev[1], "evidence study")
    if "c1" not in curves:
        return {"target_loss": None, "rows": {}}
    n_steps = curves["c1"][1]
    target = dict((st, m.get("loss")) for st, m in curves["c1"][0]).get(n_steps)
    check = evidence_curve(task, "c1", seed)  # does the stored study agree with this tree's C = 1?
    out: dict[str, Any] = {"target_loss": target, "target_step": n_steps, "rows": {},
                           "evidence_c1": check[0] if check else None}
    for key, (curve, steps, source) in [("ddp", ([], n_steps, "by definition")), *curves.items()]:
        base = key.removesuffix("-fm")
        cross = float(n_steps) if key == "ddp" else crossing(curve, target)
        entry = {"label": ROWS[base][0] + (" FLOP-matched" if key.endswith("-fm") else ""), "steps": steps,
                 "source": source, "crossing_step": cross, "curve": curve,
                 "final_loss": curve[-1][1].get("loss") if curve else target, "links": {}}
        for link in LINKS:
            st = rows[base]["links"].get(link, {}).get("step_time_s")
            ddp = rows["ddp"]["links"].get(link, {}).get("step_time_s")
            if st and cross is not None:
                entry["links"][link] = {"time_s": cross * st, "speedup_vs_ddp": n_steps * ddp / (cross * st)}
        out["rows"][key] = entry
    return out


def link_check(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Same row, seed and steps on different links: are the per-step losses of every rank identical?"""
    pairs, worst = 0, 0.0
    for name, run in runs.items():
        if not name.startswith("1gbit-") or name.endswith("-rep"):
            continue
        for link in ("10gbit", "100mbit"):
            other = runs.get(f"{link}-{name[len('1gbit-'):]}")
            if other is None or other["run"]["steps"] != run["run"]["steps"]:
                continue
            pairs += 1
            for a, b in zip(run["ranks"], other["ranks"]):
                for x, y in zip(a["steps"], b["steps"]):
                    worst = max(worst, abs(x["loss"] - y["loss"]))
    return {"pairs": pairs, "max_abs_loss_difference": worst}


def groups_report(out: Path) -> dict[str, Any]:
    runs = load_runs(out)
    rows = {}
    for name, run in runs.items():
        r = summarise(run)
        hops = sum(r["hops_per_step"].values())
        rows[run["run"]["row"]] = {**{k: r[k] for k in ("step_time_s", "owner_sets", "dense", "buckets",
                                                        "collectives_per_step", "hops_per_step", "payload_per_step",
                                                        "ring_wire_per_step", "loopback_bytes_per_step_per_rank",
                                                        "overlap", "load")},
                                   "hops_total": hops,
                                   **{f"latency_at_{a:g}us_s": hops * a * 1e-6 for a in ALPHAS_US},
                                   "model_s": {name: alpha_beta_s(hops, r["ring_wire_per_step"] or 0.0, a, b)
                                               for name, (a, b) in MODEL_LINKS.items()}}
    return rows


# ----------------------------------------------------------------------------------------- output
def _mib(x: float | None) -> str:
    return f"{x / 2**20:.2f}" if x is not None else "-"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return format(x, fmt) if x is not None else "-"


def render_task(task: str, rep: dict[str, Any]) -> str:
    lines = [f"### {task}: {TASKS[task].description}", "",
             "Step time: median interval between step ends (s); `x DDP`: ratio to torch DDP on the same link. "
             "A shaped loopback is one shared medium for all 4 ranks.", "",
             "| row | " + " | ".join(f"{l} s/step | x DDP" for l in LINKS) + " | MiB/step/rank (payload) | "
             "ring MiB | loopback MiB/rank | hidden | exposed s (1 Gbit/s) | collectives/step |",
             "|---|" + "---|---|" * len(LINKS) + "---|---|---|---|---|---|"]
    for key, row in rep["rows"].items():
        cells = []
        for link in LINKS:
            c = row["links"].get(link, {})
            reps = c.get("repeats", [])
            t = _f(c.get("step_time_s"), ".3f") + (f" ({', '.join(f'{x:.2f}' for x in reps)})" if len(reps) > 1 else "")
            cells += [t, _f(c.get("ratio_to_ddp"), ".3f")]
        c = row["links"].get("1gbit", {})
        coll = c.get("collectives_per_step") or {}
        lines.append(f"| {row['label']} | " + " | ".join(cells) + f" | {_mib(c.get('payload_per_step'))} | "
                     f"{_mib(c.get('ring_wire_per_step'))} | {_mib(c.get('loopback_bytes_per_step_per_rank'))} | "
                     f"{_f(c.get('overlap'))} | {_f(c.get('exposed_comm_s'))} | "
                     + ", ".join(f"{p} {n:.2g}" for p, n in sorted(coll.items())) + " |")
    lines += ["", "What the network costs a step (median s over timed steps and ranks): exposed = from the end of "
              "backward until the last gradient collective completes | busy = from the first gradient collective's "
              "launch until the last completes; local-steps rows: (synchronising step - local step) / H.", "",
              "| row | " + " | ".join(f"{l} exposed / busy" for l in LINKS) + " |", "|---|" + "---|" * len(LINKS)]
    for key, row in rep["rows"].items():
        cells = []
        for link in LINKS:
            c = row["links"].get(link, {})
            if c.get("sync_extra_s") is not None:
                cells.append(f"{c['sync_extra_s'] / H:.3f}")
            else:
                cells.append(f"{_f(c.get('exposed_comm_s'))} / {_f(c.get('link_busy_s'))}")
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    lines += ["", "torch DDP against subnetdp C=1: C=1 / DDP of runs adjacent in time (each pair shares the "
              "machine's load), and where a step's time goes (median s: until the first gradient collective "
              "launches | until the last completes | after it); after backward: from the end of backward to the "
              "end of the step (median s, DDP / C=1 per pair), the part the forward/backward compute and its "
              "load noise leave out.", "",
              "| link, subnetdp's buckets | paired ratios C=1 / DDP | median | DDP phases | C=1 phases | "
              "after backward DDP / C=1 |", "|---|---|---|---|---|---|"]
    for link, pr in rep["rows"]["c1"].get("paired_ratio_to_ddp", {}).items():
        ph = {k: [rep["runs"][n]["phases_s"] for n in pr["runs"] if f"-{k}" in n and rep["runs"][n].get("phases_s")]
              for k in ("ddp", "c1")}
        show = {k: " / ".join(f"{statistics.median(p[i] for p in v):.2f}" for i in range(3)) if v else "-"
                for k, v in ph.items()}
        after = ", ".join(f"{d:.2f} / {c:.2f}" for d, c in pr.get("after", [])) or "-"
        lines.append(f"| {link} | {', '.join(f'{r:.3f}' for r in pr['ratios'])} | {pr['median']:.3f} | "
                     f"{show['ddp']} | {show['c1']} | {after} |")
    ttl = rep["time_to_loss"]
    lines += ["", f"Time to DDP's validation loss after {ttl.get('target_step')} steps "
              f"({_f(ttl['target_loss'], '.4f')}): crossing step (linear between evaluations) x the row's step time "
              "on each link; each curve measured once (loss does not depend on the link).", "",
              "| row | curve from | steps run | final loss | reaches it at step | " + " | ".join(
                  f"{l}: time s (speed-up)" for l in LINKS) + " |",
              "|---|---|---|---|---|" + "---|" * len(LINKS)]
    for key, e in ttl["rows"].items():
        if e["crossing_step"] is None:
            lines.append(f"| {e['label']} | {e['source']} | {e['steps']} | {_f(e['final_loss'], '.4f')} | not reached | "
                         + " | ".join("-" for _ in LINKS) + " |")
            continue
        cells = [f"{e['links'][l]['time_s']:.0f} ({_f(e['links'][l]['speedup_vs_ddp'])}x)" if l in e["links"] else "-"
                 for l in LINKS]
        lines.append(f"| {e['label']} | {e['source']} | {e['steps']} | {_f(e['final_loss'], '.4f')} | {e['crossing_step']:.1f} | "
                     + " | ".join(cells) + " |")
    lc = rep["link_check"]
    lines += ["", f"Link check: {lc['pairs']} rows ran at 1 Gbit/s and 100 Mbit/s with the same seed and steps; "
              f"largest difference of any rank's loss at any step: {lc['max_abs_loss_difference']:.3g}."]
    return "\n".join(lines)


def default_sync(owner_sets: int) -> str:
    """What subnetdp picks for a plan of ``owner_sets`` owner sets when ``sync.max_groups`` is left alone."""
    import dataclasses

    from subnetdp.core.config import SyncConfig
    from subnetdp.sdp.sync import uses_dense_sync

    default = next(f.default for f in dataclasses.fields(SyncConfig) if f.name == "max_groups")
    return "dense" if uses_dense_sync(owner_sets, int(default)) else "grouped"


def render_groups(rows: dict[str, Any], workers: int) -> str:
    lines = [f"### Many groups: llama8, {workers} workers, C = 0.5, 100 Mbit/s (one shared medium)", "",
             "`sync`: the mode the row forced (`sync.max_groups` 1: dense, 1000: grouped); `default`: the mode "
             "subnetdp picks for that plan with `sync.max_groups` left at its default.", "",
             "| configuration | owner sets | sync | default | s/step | payload MiB/rank | loopback MiB/rank | collectives/step "
             "(grad + other) | ring hops/step | + latency @5 us | + latency @50 us | hidden | "
             + " | ".join(f"model: {n}" for n in MODEL_LINKS) + " |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(MODEL_LINKS)]
    for name, r in rows.items():
        coll = r["collectives_per_step"]
        grad = coll.get("step", 0)
        other = sum(v for p, v in coll.items() if p != "step")
        lines.append(f"| {name} | {r['owner_sets']} | {'dense' if r['dense'] else 'grouped'} | "
                     f"{default_sync(r['owner_sets'])} | "
                     f"{_f(r['step_time_s'], '.2f')} | {_mib(r['payload_per_step'])} | "
                     f"{_mib(r['loopback_bytes_per_step_per_rank'])} | {grad:.0f} + {other:.0f} | {r['hops_total']:.0f} | "
                     f"{r['latency_at_5us_s'] * 1e3:.2f} ms | {r['latency_at_50us_s'] * 1e3:.1f} ms | "
                     f"{_f(r['overlap'])} | " + " | ".join(f"{r['model_s'][n] * 1e3:.1f} ms" for n in MODEL_LINKS) + " |")
    return "\n".join(lines)


def plot_task(task: str, rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    bw = [LINKS[l] / 1e9 for l in LINKS]
    for key, row in rep["rows"].items():
        xs = [b for b, l in zip(bw, LINKS) if row["links"].get(l, {}).get("step_time_s")]
        ys = [row["links"][l]["step_time_s"] for l in LINKS if row["links"].get(l, {}).get("step_time_s")]
        rs = [row["links"][l]["ratio_to_ddp"] for l in LINKS if row["links"].get(l, {}).get("step_time_s")]
        style = "--" if key in ("ddp", "c1") else "-"
        axes[0].plot(xs, ys, style, marker="o", label=row["label"])
        axes[1].plot(xs, rs, style, marker="o", label=row["label"])
    for ax, title in ((axes[0], "step time (s)"), (axes[1], "step time / torch DDP (same link)")):
        ax.set_xscale("log")
        ax.set_xlabel("link (Gbit/s, one shared medium for 4 ranks)")
        ax.set_title(f"{task}: {title}")
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["steps", "groups"], choices=["steps", "groups"])
    parser.add_argument("--tasks", nargs="+", default=["resnet18", "llama8"], choices=list(TASKS))
    parser.add_argument("--short-steps", type=int, default=5, help="steps of a short run (steps 3 and 4 timed; "
                        f"local-steps rows: H + 1)")
    parser.add_argument("--group-workers", type=int, default=8)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="rows of part steps")
    parser.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS), help="links of part steps")
    parser.add_argument("--pairs", type=int, default=0, help="extra adjacent (torch DDP, C=1) pairs per link")
    parser.add_argument("--pair-steps", type=int, default=8, help="steps of each run of --pairs (3 to N-1 timed)")
    parser.add_argument("--curve-steps", type=int, default=0, help="steps of the curve runs (default: the task's)")
    parser.add_argument("--curve-rows", nargs="*", default=None, help="rows whose validation curve runs here (a key "
                        "of --rows, '-fm' for FLOP-matched); default per task: " + str(CURVE_ROWS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder of the runs (default: RESULTS/network)")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="where the plots go")
    parser.add_argument("--report", action="store_true", help="only tables and plots from the stored runs")
    args = parser.parse_args(argv)
    out = args.out or results_dir() / "network"
    args.curve_rows = CURVE_ROWS if args.curve_rows is None else {t: args.curve_rows for t in TASKS}
    args.cache = str(CACHE_DIR)
    t0 = time.perf_counter()
    if not args.report:
        why = shaped_link.missing_requirement()
        if why:
            print(f"network: {why}", file=sys.stderr)
            return 2
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            if "steps" in args.parts:
                for task in args.tasks:
                    fm_path = out / task / "flops.json"
                    if not fm_path.exists():
                        ratios = {k: flop_ratio(task, row_overrides(task, k), args.cache) for k in set(FM_ROWS.values())}
                        fm_path.parent.mkdir(parents=True, exist_ok=True)
                        fm_path.write_text(json.dumps(ratios))
                    ratios = json.loads(fm_path.read_text())
                    fm = {k: round(TASKS[task].steps / ratios[base]) for k, base in FM_ROWS.items()}
                    execute(steps_spec(task, args, fm), out / task)
            if "groups" in args.parts:
                execute(groups_spec(args), out / f"groups_w{args.group_workers}")
        except shaped_link.LinkError as e:
            print(f"network: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("network: interrupted; finished runs are kept, the namespace is removed", file=sys.stderr)
            return 130
    report: dict[str, Any] = {"meta": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                       "wall_s": time.perf_counter() - t0, "load_average_end": os.getloadavg(),
                                       "links": LINKS, "medium": "one shaped loopback shared by all ranks"}}
    texts = []
    args.docs.mkdir(parents=True, exist_ok=True)  # the plots' folder (a new one for a trial run)
    for task in args.tasks:
        if (out / task).is_dir():
            report[task] = task_report(task, out / task)
            texts.append(render_task(task, report[task]))
            plot_task(task, report[task], args.docs / f"network_{task}.png")
            texts[-1] += f"\n\n![{task}: step time against the link](network_{task}.png)"
    gdir = out / f"groups_w{args.group_workers}"
    if gdir.is_dir():
        report["groups"] = groups_report(gdir)
        texts.append(render_groups(report["groups"], args.group_workers))
    text = "\n\n".join(texts)
    print(text)
    (out / "tables.md").write_text(text + "\n")
    doc = args.docs / "network.md"
    if doc.is_file() and MARK_BEGIN in doc.read_text():  # the figures of docs/network.md, between its markers
        head, rest = doc.read_text().split(MARK_BEGIN, 1)
        tail = rest.split(MARK_END, 1)[1]
        doc.write_text(f"{head}{MARK_BEGIN}\n{text}\n{MARK_END}{tail}")
    slim = {k: ({**v, "runs": {n: {kk: vv for kk, vv in r.items() if kk != "losses"} for n, r in v["runs"].items()}}
                if isinstance(v, dict) and "runs" in v else v) for k, v in report.items()}
    (out / "network.json").write_text(json.dumps(slim, indent=1))
    print(f"\nwrote {out / 'network.json'}, {out / 'tables.md'} and the plots in {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
