"""The runs of the network benchmark (``benchmarks/network.py``), one after the other, on W spawned
gloo ranks that live through all of them (start-up is paid once).

Run inside a namespace made by ``benchmarks/shaped_link.py``::

    ip netns exec NS python benchmarks/_netrun.py SPEC.json OUT_DIR

``SPEC.json`` names a task of ``benchmarks/evidence_tasks.py``, the world size, the seed and a list
of runs, each with a name, a link rate (rank 0 reshapes the namespace's loopback with ``tc`` before
the run's process group exists; ``null``: unshaped), a step count, overrides and a kind:

- ``ddp``: torch's ``DistributedDataParallel`` (``gradient_as_bucket_view=True``, the same bucket cap
  as subnetdp, no forward buffer sync), the loop of ``subnetdp.train.step`` with DDP in place of SDP
  (same data, optimizer, schedule and clipping);
- ``sdp``: ``subnetdp.train.loop.train`` itself, with a probe registered as a plugin.

Per rank and per step it records: the wall time between the ends of consecutive steps (everything a
step costs, the loop's own collectives after it included), the loss, every collective's phase, group
size and payload, and for the gradient collectives the time the first one launched, the time
backward ended and the time the last one completed (the overlap). Rank 0 also reads the bytes the
namespace's loopback sent (``/sys/class/net/lo/statistics/tx_bytes``: all ranks' traffic, headers
included). ``eval_every`` adds the union model's validation loss (the curves for time to loss).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.evidence_tasks import TASKS  # noqa: E402
from subnetdp.core.hookspecs import hookimpl  # noqa: E402


def _tx_bytes() -> int:
    try:
        with open("/sys/class/net/lo/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return -1


class StepProbe:
    """Per-step records of one rank: times, loss, collectives; shared by the DDP loop and the plugin."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps: list[dict[str, Any]] = []
        self.evals: list[tuple[int, dict[str, float]]] = []
        self.calls: list[tuple[float, str, int, int]] = []  # (time, phase, group size, payload bytes)
        self.backward_end = self.comm_end = None
        self.evaluated = False
        self.t_prev = time.perf_counter()

    def collective(self, phase: str, k: int, nbytes: int) -> None:
        self.calls.append((time.perf_counter(), phase, k, nbytes))

    def step_end(self, step: int, loss: float, loop_step_time: float | None = None) -> None:
        now = time.perf_counter()
        evaluated, self.evaluated = self.evaluated, False
        grads = [c for c in self.calls if c[1] == "step" and c[2] > 1]
        phases: dict[str, list[int]] = {}  # phase -> [collectives, payload bytes, ring hops 2(k-1)]
        for _, phase, k, nbytes in self.calls:
            if k > 1:
                count = phases.setdefault(phase, [0, 0, 0])
                count[0] += 1
                count[1] += nbytes
                count[2] += 2 * (k - 1)
        # An evaluation ran inside this interval (before the step-end hook): the loop's own time of the
        # step stands in for it (it leaves out only the previous step's tiny stop agreement).
        interval = loop_step_time if evaluated and loop_step_time is not None else now - self.t_prev
        rec = {"step": step, "interval_s": interval, "evaluated": evaluated, "loss": loss,
               "loop_step_time_s": loop_step_time,
               "collectives": phases, "tx_bytes": _tx_bytes() if self.rank == 0 else None}
        if grads and self.backward_end is not None and self.comm_end is not None:
            first = grads[0][0]
            rec.update(first_launch=first - self.t_prev, backward_end=self.backward_end - self.t_prev,
                       comm_end=self.comm_end - self.t_prev,
                       launches=[(round(t - self.t_prev, 4), k, n) for t, _, k, n in grads])
        self.steps.append(rec)
        self.calls, self.backward_end, self.comm_end = [], None, None
        self.t_prev = now


class SubnetdpProbe(StepProbe):
    """The probe as a subnetdp plugin: wraps the communicator's byte counter and the synchroniser's
    ``finish`` (the end of backward, then the end of the gradient averaging)."""

    @hookimpl
    def subnetdp_on_run_start(self, context: Any, state: Any) -> None:
        counter, add = context.comm.bytes, context.comm.bytes.add

        def counted(group: tuple[int, ...], nbytes: int) -> None:
            self.collective(counter.current, len(group), nbytes)
            add(group, nbytes)

        counter.add = counted
        sync = state.synchronizer
        finish = sync.finish

        def timed_finish() -> None:
            self.backward_end = time.perf_counter()
            finish()
            self.comm_end = time.perf_counter()

        sync.finish = timed_finish
        self.t_prev = time.perf_counter()

    @hookimpl
    def subnetdp_on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self.step_end(step, float(metrics["loss"]), float(metrics["step_time"]))

    @hookimpl
    def subnetdp_on_eval_end(self, step: int, metrics: dict[str, Any]) -> None:
        self.evals.append((step, {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}))
        self.evaluated = True  # evaluation is not a step's time
        self.calls = [c for c in self.calls if c[1] != "eval"]


def _config(spec: dict[str, Any], store: str, run_dir: str) -> Any:
    from subnetdp.core.config import compose
    from subnetdp.core.plugins import PluginManager

    task = TASKS[spec["task"]]
    extra = [f"launch.nproc={spec['world_size']}", "launch.threads_per_rank=1", f"seed={spec['seed']}",
             "train.progress=false", f"train.log_every={spec['steps']}", "train.memory_step=1",
             f"eval.every={spec.get('eval_every', 0)}", f"comm.init_method=file://{store}", "comm.timeout_s=900",
             f"run.dir={run_dir}", f"run.name={spec['name']}", "run.tensorboard=false", "checkpoint.enabled=false"]
    if task.data_cache:
        extra.append(f"data.cache_dir={spec['cache_dir']}")
    overrides = [*task.overrides, f"train.steps={spec['steps']}", *extra, *spec["overrides"]]  # later ones win
    pm = PluginManager()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 4 single-thread ranks on 2 cores is the point, not a mistake
        return compose(task.recipe, overrides, pm.registries), pm


def _sdp_rank(rank: int, spec: dict[str, Any], store: str, run_dir: str) -> dict[str, Any]:
    from subnetdp.core.contracts import LaunchEnv
    from subnetdp.core.plugins import PluginManager
    from subnetdp.train.loop import train

    cfg, _ = _config(spec, store, run_dir)
    probe = SubnetdpProbe(rank)
    pm = PluginManager(extra=[probe])
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, state, result = train(cfg, LaunchEnv(rank, spec["world_size"], rank, spec["world_size"], "benchmark"), pm)
    summary = result.summary
    mine = summary["ranks"][rank] if rank < len(summary.get("ranks", [])) else {}
    return {"steps": probe.steps, "evals": probe.evals, "owner_groups": len(mine.get("bytes_by_group", {})),
            "summary_rank": {k: mine.get(k) for k in ("bytes_sent_per_step", "wire_bytes_per_step_ring",
                                                      "bytes_by_group", "bytes_by_phase", "params_held",
                                                      "step_time_s", "sync_mode")},
            "eval": summary.get("eval"), "owner_sets": len(state.plan.owner_sets()),
            "dense": bool(getattr(_inner(state.synchronizer), "dense", False)),
            "buckets": _bucket_counts(state.synchronizer), "bucket_rule": _bucket_rule()}


def _bucket_rule() -> str:
    """How this tree closes gradient buckets: ``reach`` (once they hold the cap, as torch DDP) or ``cap``."""
    import inspect

    from subnetdp.sdp import sync

    split = getattr(sync, "_split", None)  # recorded so stored runs say which rule measured them
    return "reach" if split is not None and "reach" in inspect.signature(split).parameters else "cap"


def _inner(averager: Any) -> Any:
    """The owner-group averager (local steps keep theirs in ``.buckets``)."""
    inner = getattr(averager, "buckets", None)
    return inner if hasattr(inner, "dense") else averager


def _bucket_counts(averager: Any) -> dict[str, int]:
    """This rank's gradient buckets by owner-set size (collectives per synchronisation)."""
    inner = _inner(averager)
    out: dict[str, int] = {}
    for b in getattr(inner, "buckets", []):
        if inner.dense or b.k > 1:
            out[str(b.k)] = out.get(str(b.k), 0) + 1
    return out


def _ddp_rank(rank: int, spec: dict[str, Any], store: str, run_dir: str) -> dict[str, Any]:
    """torch DDP: the same task, data, optimizer, schedule and clipping as subnetdp's loop at C = 1."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from subnetdp.train.checkpoints.source import seed_host_rngs
    from subnetdp.train.optim import build_optimizer, build_schedule

    cfg, pm = _config(spec, store, run_dir)
    world, steps = spec["world_size"], spec["steps"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    data = pm.registries["data"].create(cfg.data.name, cfg.data, seed=int(cfg.seed))
    adapter = pm.registries["model"].create(cfg.model.name, cfg.model)
    torch.manual_seed(int(cfg.seed))
    model = adapter.build(data.spec())
    # BatchNorm statistics stay per rank, as in subnetdp (no buffer traffic); newer torch renames the flag.
    import inspect

    names = inspect.signature(DistributedDataParallel.__init__).parameters
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=float(cfg.sync.bucket_cap_mb),
                                  **no_sync)
    probe = StepProbe(rank)

    def hook(state, bucket):  # no annotations: DDP checks them as real types. The default all-reduce, timed
        buf = bucket.buffer()
        probe.collective("step", world, buf.numel() * buf.element_size())
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    first_param = next(p for p in model.parameters() if p.requires_grad)  # its gradient is ready last

    def grads_done(p: torch.Tensor) -> None:
        probe.backward_end = time.perf_counter()

    first_param.register_post_accumulate_grad_hook(grads_done)
    optimizer = build_optimizer(cfg.optim, ddp.parameters())
    scheduler = build_schedule(cfg.optim, optimizer, steps)
    clip = float(cfg.optim.clip_grad_norm)
    seed_host_rngs(int(cfg.seed))
    batches = iter(data.train_loader(rank, world, int(cfg.train.batch_size)))
    ddp.train()
    dist.barrier()
    probe.t_prev = time.perf_counter()
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=False)  # gradients are bucket views: zeroed in place
        batch = next(batches)
        loss = adapter.training_loss(ddp, batch)
        loss.backward()  # returns once every bucket is reduced
        probe.comm_end = time.perf_counter()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)  # replicated gradients: no collective
        optimizer.step()
        scheduler.step()
        probe.step_end(step, float(loss.detach()))
    dist.destroy_process_group()
    return {"steps": probe.steps, "evals": [], "owner_groups": 1, "owner_sets": 1, "dense": False,
            "buckets": None,  # DDP's own buckets: its hook calls per step (in "collectives")
            "summary_rank": {"params_held": sum(p.numel() for p in model.parameters())}}


def set_rate(rate: str | None) -> None:
    """Shape (or unshape, ``None``) the loopback of the namespace this process runs in."""
    from benchmarks.shaped_link import burst_bytes, rate_bits

    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)  # none yet is fine
    if rate:
        bits = rate_bits(rate)
        subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{int(bits)}bit", "burst",
                        str(burst_bytes(bits)), "latency", "100ms"], check=True, capture_output=True)


def _rank(rank: int, spec: dict[str, Any], tmp: str, out_dir: str) -> None:
    """Every run of ``spec`` in order, on this rank; rank 0 sets each run's link rate before the others
    can meet it (each run has a process group of its own, made after the rate is set)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    rate: Any = "unset"
    for i, run in enumerate(spec["runs"]):
        done = Path(out_dir, f"{run['name']}.json")
        if done.exists():
            continue
        cfg = {**{k: v for k, v in spec.items() if k != "runs"}, **run}
        if rank == 0 and run.get("rate") != rate:
            set_rate(run.get("rate"))
        rate = run.get("rate")
        store, run_dir = os.path.join(tmp, f"store{i}"), os.path.join(tmp, "runs")
        t0, load = time.perf_counter(), os.getloadavg()
        result = (_ddp_rank if run["kind"] == "ddp" else _sdp_rank)(rank, cfg, store, run_dir)
        result.update(wall_s=time.perf_counter() - t0, load_before=load, load_after=os.getloadavg())
        part = Path(tmp, f"{run['name']}.rank{rank}.part")
        part.write_text(json.dumps(result))
        part.rename(part.with_suffix(".json"))  # whole or not there: rank 0 polls for it
        if rank == 0:  # every rank has written its file once rank 0 got here (the run ends in a collective)
            _collect(run, cfg, tmp, done)
            print(f"  {run['name']}: {result['wall_s']:.0f} s", flush=True)
        gc.collect()


def _collect(run: dict[str, Any], cfg: dict[str, Any], tmp: str, done: Path) -> None:
    ranks = []
    for r in range(cfg["world_size"]):
        path = Path(tmp, f"{run['name']}.rank{r}.json")
        for _ in range(600):  # the other ranks write theirs right after the run's last collective
            if path.exists():
                break
            time.sleep(0.1)
        ranks.append(json.loads(path.read_text()))
    done.write_text(json.dumps({"run": cfg, "ranks": ranks}))


def main(spec_path: str, out_dir: str) -> int:
    """Run every configuration of ``SPEC.json``; one ``OUT_DIR/<name>.json`` each (existing ones are kept)."""
    spec = json.loads(Path(spec_path).read_text())
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="netrun-") as tmp:
        mp.start_processes(_rank, args=(spec, tmp, out_dir), nprocs=spec["world_size"], join=True,
                           start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
