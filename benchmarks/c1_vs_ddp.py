"""subnetdp at C = 1 against torch DDP, interleaved step by step on the same ranks and the same link.

The 3% question (``docs/network.md``): separate runs on this shared 2-core machine differ by up to 20%
in their forward/backward compute, so adjacent (DDP, C = 1) runs cannot tell 3% apart. Here every
rank runs subnetdp's own loop at C = 1 (``subnetdp.train.loop.train``) and, at the end of each of its
steps, one step of torch's ``DistributedDataParallel`` on a second copy of the model (same task, data
order, optimizer, schedule, clipping and bucket cap; a plugin's step-end hook runs it). Step k of
each meets the same load, link and cache state; the figure is the median over steps of the paired
ratio (C = 1 interval / DDP interval, each the mean over ranks), with its interquartile range and a
bootstrap 95% interval of the median.

- C = 1 interval: from the end of one DDP step to the start of the next, i.e. everything subnetdp's
  loop does for a step (``prepare``, forward, backward with the owner-group averaging, the guard,
  the update, the schedule, the meter, its hooks and checks).
- DDP interval: the bare DDP step (``zero_grad``, forward, backward with its bucket all-reduces,
  clipping, the update, the schedule); BatchNorm buffers stay per rank, as in subnetdp.
- Timed: steps 3 to N - 1 (not DDP's bucket rebuild in step 1-2, not the final evaluation).

Each link is a private network namespace with a shaped loopback (``benchmarks/shaped_link.py``;
root needed, the namespace is removed afterwards)::

    .venv/bin/python benchmarks/c1_vs_ddp.py                                   # resnet18 + llama8, 3 links
    .venv/bin/python benchmarks/c1_vs_ddp.py --tasks llama8 --links 1gbit --steps 24
    .venv/bin/python benchmarks/c1_vs_ddp.py --report                          # the table from stored runs

Writes ``RESULTS/c1_vs_ddp/<task>-<link>.json`` (kept: delete one to measure it again) and prints the
table that ``docs/network.md`` shows.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import shaped_link  # noqa: E402
from benchmarks._netrun import _config, set_rate  # noqa: E402
from benchmarks._results import results_dir  # noqa: E402
from benchmarks.evidence_tasks import TASKS  # noqa: E402
from benchmarks.network import CACHE_DIR, LINKS, SHORT_EVAL  # noqa: E402
from subnetdp.core.hookspecs import hookimpl  # noqa: E402

STEPS = {"resnet18": {"10gbit": 24, "1gbit": 20, "100mbit": 10}, "llama8": {"10gbit": 24, "1gbit": 24, "100mbit": 16}}


class Interleaved:
    """A subnetdp plugin: one torch DDP step after each of subnetdp's steps, both timed."""

    def __init__(self, cfg: Any, rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.sdp: list[float] = []
        self.ddp: list[float] = []
        self.losses: dict[str, list[float]] = {"sdp": [], "ddp": []}
        self.mark = 0.0

    @hookimpl
    def subnetdp_on_run_start(self, context: Any, state: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from subnetdp.train.optim import build_optimizer, build_schedule

        cfg = self.cfg
        torch.manual_seed(int(cfg.seed))
        self.adapter = context.adapter
        model = context.adapter.build(context.spec)
        names = inspect.signature(DistributedDataParallel.__init__).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}
        # On the world's default group, which subnetdp's gloo communicator made.
        self.model = DistributedDataParallel(model, gradient_as_bucket_view=True,
                                             bucket_cap_mb=float(cfg.sync.bucket_cap_mb), **no_sync)
        self.optimizer = build_optimizer(cfg.optim, self.model.parameters())
        self.scheduler = build_schedule(cfg.optim, self.optimizer, int(cfg.train.steps))
        self.clip = float(cfg.optim.clip_grad_norm)
        self.batches = iter(context.data.train_loader(self.rank, self.world, int(cfg.train.batch_size)))
        self.model.train()
        dist.barrier()
        self.mark = time.perf_counter()

    @hookimpl
    def subnetdp_on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        start = time.perf_counter()
        self.sdp.append(start - self.mark)
        self.losses["sdp"].append(float(metrics["loss"]))
        self.optimizer.zero_grad(set_to_none=False)  # gradients are bucket views: zeroed in place
        loss = self.adapter.training_loss(self.model, next(self.batches))
        loss.backward()  # returns once every bucket is reduced
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.losses["ddp"].append(float(loss.detach()))
        self.mark = time.perf_counter()
        self.ddp.append(self.mark - start)

    @hookimpl
    def subnetdp_on_run_end(self, context: Any, state: Any, result: Any) -> None:
        del self.model, self.optimizer  # before subnetdp destroys the default group


def _rank(rank: int, spec: dict[str, Any], tmp: str, out_dir: str) -> None:
    """This rank's runs, one per link; rank 0 shapes the loopback before the run's group can form."""
    import contextlib
    import io
    import warnings

    from subnetdp.core.contracts import LaunchEnv
    from subnetdp.core.plugins import PluginManager
    from subnetdp.train.loop import train

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    for i, run in enumerate(spec["runs"]):
        done = Path(out_dir, f"{run['name']}.json")
        if done.exists():
            continue
        cfg_spec = {**{k: v for k, v in spec.items() if k != "runs"}, **run}
        if rank == 0:
            set_rate(run["rate"])
        cfg, _ = _config(cfg_spec, os.path.join(tmp, f"store{i}"), os.path.join(tmp, "runs"))
        probe = Interleaved(cfg, rank, spec["world_size"])
        load = os.getloadavg()
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train(cfg, LaunchEnv(rank, spec["world_size"], rank, spec["world_size"], "benchmark"),
                  PluginManager(extra=[probe]))
        part = Path(tmp, f"{run['name']}.rank{rank}.part")
        part.write_text(json.dumps({"sdp": probe.sdp, "ddp": probe.ddp, "losses": probe.losses,
                                    "load": [load, os.getloadavg()]}))
        part.rename(part.with_suffix(".json"))
        if rank == 0:
            ranks = []
            for r in range(spec["world_size"]):
                path = Path(tmp, f"{run['name']}.rank{r}.json")
                for _ in range(600):
                    if path.exists():
                        break
                    time.sleep(0.1)
                ranks.append(json.loads(path.read_text()))
            record = {"run": cfg_spec, "ranks": ranks}
            part = done.with_suffix(".part")  # a kept result is whole: written aside, then renamed
            part.write_text(json.dumps(record))
            part.rename(done)
            print(f"  {run['name']}: {summarise(record)['median']:.3f}", flush=True)


def inner(spec_path: str, out_dir: str) -> int:
    """Inside the namespace: spawn the ranks, which run every link of the spec in turn."""
    spec = json.loads(Path(spec_path).read_text())
    with tempfile.TemporaryDirectory(prefix="c1ddp-") as tmp:
        mp.start_processes(_rank, args=(spec, tmp, out_dir), nprocs=spec["world_size"], join=True,
                           start_method="spawn")
    return 0


def summarise(run: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Paired ratios of one run: per timed step, C = 1's interval over DDP's (each the mean over ranks)."""
    ranks = run["ranks"]
    n = min(len(r["sdp"]) for r in ranks)
    timed = range(2, n - 1)  # steps 3 .. N-1 (0-based 2 .. n-2)
    sdp = [statistics.mean(r["sdp"][i] for r in ranks) for i in timed]
    ddp = [statistics.mean(r["ddp"][i] for r in ranks) for i in timed]
    ratios = sorted(s / d for s, d in zip(sdp, ddp))
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    loads = [x for r in ranks for pair in r["load"] for x in pair[:1]]
    return {"steps": len(ratios), "median": statistics.median(ratios), "iqr": (q[0], q[2]),
            "ci95": (boots[int(0.025 * len(boots))], boots[int(0.975 * len(boots)) - 1]),
            "ratio_of_medians": statistics.median(sdp) / statistics.median(ddp),
            "sdp_s": statistics.median(sdp), "ddp_s": statistics.median(ddp),
            "loss_sdp": ranks[0]["losses"]["sdp"][-1], "loss_ddp": ranks[0]["losses"]["ddp"][-1],
            "load": (min(loads), max(loads)) if loads else None}


def render(out: Path, tasks: list[str], links: list[str]) -> str:
    lines = ["| task | link | timed steps | median C=1 / DDP (paired) | IQR | 95% interval of the median "
             "| median step s (DDP / C=1) | within 3% | load |",
             "|---|---|---|---|---|---|---|---|---|"]
    for task in tasks:
        for link in links:
            path = out / f"{task}-{link}.json"
            if not path.exists():
                continue
            s = summarise(json.loads(path.read_text()))
            lo, hi = s["ci95"]
            verdict = "yes" if hi <= 1.03 else ("no" if lo > 1.03 else "undecided")
            load = f"{s['load'][0]:.1f}-{s['load'][1]:.1f}" if s["load"] else "-"
            lines.append(f"| {task} | {link} | {s['steps']} | {s['median']:.3f} | {s['iqr'][0]:.3f}-{s['iqr'][1]:.3f} "
                         f"| {lo:.3f}-{hi:.3f} | {s['ddp_s']:.3f} / {s['sdp_s']:.3f} | {verdict} | {load} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["resnet18", "llama8"], choices=list(STEPS))
    parser.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    parser.add_argument("--steps", type=int, default=0, help="steps per link (0: " + str(STEPS) + ")")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder of the runs (default: RESULTS/c1_vs_ddp)")
    parser.add_argument("--report", action="store_true", help="only the table from the stored runs")
    args = parser.parse_args(argv)
    if args.steps and args.steps < 5:
        parser.error(f"--steps {args.steps}: at least 5 (steps 3 to N - 1 are timed)")
    out = args.out or results_dir() / "c1_vs_ddp"
    if not args.report:
        why = shaped_link.missing_requirement()
        if why:
            print(f"c1_vs_ddp: {why}", file=sys.stderr)
            return 2
        os.environ["OMP_NUM_THREADS"] = "1"
        out.mkdir(parents=True, exist_ok=True)
        for task in args.tasks:
            runs = [{"name": f"{task}-{link}", "rate": link, "steps": args.steps or STEPS[task][link], "eval_every": 0,
                     "overrides": ["masker.coverage=1", *SHORT_EVAL[task]]}
                    for link in args.links if not (out / f"{task}-{link}.json").exists()]
            if not runs:
                continue
            spec = {"task": task, "world_size": TASKS[task].world_size, "seed": args.seed, "cache_dir": str(CACHE_DIR),
                    "runs": runs}
            spec_path = out / f"spec-{task}.json"
            spec_path.write_text(json.dumps(spec, indent=1))
            print(f"{task}: {', '.join(r['name'] for r in runs)}", flush=True)
            try:
                with shaped_link.shaped_namespace(None) as ns:
                    rc = shaped_link.run_in(ns, [sys.executable, __file__, "--inner", str(spec_path), str(out)],
                                            env={"OMP_NUM_THREADS": "1"})
            except shaped_link.LinkError as e:
                print(f"c1_vs_ddp: {e}", file=sys.stderr)
                return 2
            except KeyboardInterrupt:
                print("c1_vs_ddp: interrupted; finished links are kept, the namespace is removed", file=sys.stderr)
                return 130
            if rc != 0:
                print(f"c1_vs_ddp: the runs of {task} failed (exit {rc}); finished links are kept in {out}",
                      file=sys.stderr)
                return 1
    text = render(out, args.tasks, args.links)
    print(text)
    (out / "tables.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--inner"]:
        sys.exit(inner(*sys.argv[2:4]))
    sys.exit(main())
