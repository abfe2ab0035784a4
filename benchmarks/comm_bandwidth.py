"""All-reduce bandwidth of the communicator plugins against their raw libraries, and bytes per step
of DDP vs SDP for ResNet-18.

    python benchmarks/comm_bandwidth.py            # starts itself under the venv's mpirun -n 2

Part 1, for bucket sizes 1 KiB-64 MiB (fp32) on 2 ranks, in one MPI job:
- raw ``torch.distributed.all_reduce`` (gloo) vs the ``gloo`` plugin's ``all_reduce`` (same process
  group, ``async_op=True`` then ``wait()``, as the synchroniser calls it);
- raw mpi4py ``Allreduce`` on a numpy array vs the ``mpi`` plugin's ``all_reduce`` (``Iallreduce``
  on a zero-copy view, then ``Wait``).
Each pair alternates over several rounds and reports the fastest round's time per call; ratio = plugin time /
raw time (the plugin's overhead; 1.00 = none). algbw = bytes / time. ``mpi stage`` is the mpi
plugin's own work per call (choosing the buffer, no communication), which machine load hardly moves.

Part 2: payload bytes per rank per step handed to collectives (what ``bytes_sent_per_step`` reports)
for torch DDP (``gradient_as_bucket_view=True``, counted by a communication hook) and for SDP at C=1
and C=0.5 (the ``gloo`` plugin's byte counter after one step of the real synchroniser), ResNet-18
(CIFAR stem) on digits, 2 ranks; plus the per-rank bytes the plan implies at 4 and 8 ranks (computed,
not measured: this machine has 2 cores). The LLaMA figures belong to the LLaMA adapter's branch.

Writes benchmarks/results/comm_bandwidth.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise

ROOT = Path(__file__).resolve().parents[1]
SIZES = [2**k for k in range(10, 27, 2)]  # 1 KiB, 4 KiB, ..., 64 MiB
ROUNDS = 7


def timed(fn, reps: int, barrier) -> float:
    """Seconds per call of ``fn`` (slowest rank), after one warm-up call."""
    fn()
    barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def bandwidth(gloo, mpi, MPI) -> list[dict]:
    import numpy as np
    import torch
    import torch.distributed as dist

    world = MPI.COMM_WORLD
    rows = []
    for size in SIZES:
        n = size // 4
        reps = max(3, min(200, (64 << 20) // size // 4))
        t = torch.ones(n)
        arr = np.ones(n, dtype=np.float32)
        cases = {
            "gloo_raw": lambda: dist.all_reduce(t),
            "gloo_plugin": lambda: gloo.all_reduce(t, gloo.world, async_op=True).wait(),
            "mpi_raw": lambda: world.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM),
            "mpi_plugin": lambda: mpi.all_reduce(t, mpi.world, async_op=True).wait(),
        }
        samples: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(ROUNDS):  # rounds alternate raw and plugin, so load from other processes hits both
            for name, fn in cases.items():
                local = timed(fn, reps, world.Barrier)
                samples[name].append(world.allreduce(local, op=MPI.MAX))
            t.fill_(1.0)
            arr.fill(1.0)
        # The fastest round is the one least disturbed by other processes on the machine.
        med = {k: min(v) for k, v in samples.items()}
        # The mpi plugin's own work per call, without communication (robust to machine load).
        t0 = time.perf_counter()
        for _ in range(200):
            mpi._stage(t, widen=True)
        stage = (time.perf_counter() - t0) / 200
        rows.append({"bytes": size, "reps": reps, **{f"{k}_s": v for k, v in med.items()}, "mpi_stage_s": stage,
                     "gloo_ratio": med["gloo_plugin"] / med["gloo_raw"], "mpi_ratio": med["mpi_plugin"] / med["mpi_raw"]})
    return rows


def bytes_per_step(gloo, rank: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from subnetdp.train.setup import build_plan
    from subnetdp.core.plugins import PluginManager
    from subnetdp.train.configure import load_config
    from subnetdp.core.plan import make_plan
    from subnetdp.sdp.sync import OwnerGroupAverager

    pm = PluginManager()
    out: dict = {"model": "resnet18 (CIFAR stem), digits 8x8, batch 16 per rank", "measured_world_size": 2}

    def config(coverage: float):
        return load_config("resnet18_digits", [f"masker.coverage={coverage}", "train.batch_size=16", "train.progress=false"],
                           pm.registries)

    # DDP: every gradient bucket its comm hook sees is what it hands to the all-reduce.
    data, spec, adapter, full, partition, plan = build_plan(config(1.0), 2, pm)
    batch = next(iter(data.train_loader(rank, 2, 16)))
    counted = [0]

    def counting_hook(state, bucket):
        counted[0] += bucket.buffer().numel() * bucket.buffer().element_size()
        work = dist.all_reduce(bucket.buffer().div_(2), async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    ddp = DDP(full, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, counting_hook)
    adapter.loss(ddp(batch[0]), batch).backward()
    ddp_bytes = counted[0]
    out["ddp_bytes_per_step"] = ddp_bytes
    out["ddp_wire_ring"] = ddp_bytes  # 2 (k-1)/k = 1 at k = 2
    full_bytes = 4 * (partition.shared_numel() + sum(partition.unit_numel(u) for u in partition.units))
    out["full_model_param_bytes"] = full_bytes

    for coverage in (1.0, 0.5):
        data, spec, adapter, full, partition, plan = build_plan(config(coverage), 2, pm)
        model, pmap = adapter.materialize(full, plan.owned[rank], partition)
        averager = OwnerGroupAverager(model, pmap, plan, partition, gloo)
        before = dict(gloo.bytes.by_group)
        averager.prepare()
        adapter.loss(model(batch[0]), batch).backward()
        averager.finish()
        groups = {"-".join(map(str, g)): n - before.get(g, 0) for g, n in gloo.bytes.by_group.items()
                  if n - before.get(g, 0)}
        total = sum(groups.values())
        wire = sum(2 * (g.count("-")) / (g.count("-") + 1) * n for g, n in groups.items())
        out[f"sdp_c{coverage:g}"] = {"bytes_per_step": total, "wire_ring": wire, "by_group": groups,
                                     "vs_ddp": total / ddp_bytes, "params_held": sum(p.numel() for p in model.parameters())}
        averager.remove_hooks()

    # What the plan implies at larger worlds (computed from the plan, not measured here).
    implied = {}
    for w in (4, 8):
        for coverage in (1.0, 0.5):
            masker = pm.registries["masker"].get("cyclic")(config(coverage).masker)
            p = make_plan(masker, partition, w, 0)
            per_rank = []
            for r in range(w):
                units = [u for u in p.owned[r] if p.k(u) > 1]
                numel = partition.shared_numel() + sum(partition.unit_numel(partition.units[u]) for u in units)
                per_rank.append(4 * numel)
            implied[f"w{w}_c{coverage:g}"] = {"max_bytes_per_rank": max(per_rank), "mean_bytes_per_rank": sum(per_rank) / w}
    out["implied_by_plan"] = implied
    return out


def main() -> None:
    from subnetdp.launchers import detect

    env = detect()
    if env.launcher != "mpirun":
        mpirun = Path(sys.executable).parent / "mpirun"
        cmd = [str(mpirun), "-n", "2", sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
        print("$ " + " ".join(cmd), flush=True)
        raise SystemExit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))

    import torch
    from omegaconf import OmegaConf

    from subnetdp.plugins.comm.gloo import GlooCommunicator
    from subnetdp.plugins.comm.mpi import MpiCommunicator

    torch.set_num_threads(1)
    gloo = GlooCommunicator(OmegaConf.structured(GlooCommunicator.Config(name="gloo")), env)
    gloo.init()  # MASTER_ADDR/PORT from rank 0 over MPI
    mpi = MpiCommunicator(OmegaConf.structured(MpiCommunicator.Config(name="mpi")), env)
    mpi.init()
    load = os.getloadavg()
    t0 = time.perf_counter()
    rows = bandwidth(gloo, mpi, mpi.MPI)
    t_bw = time.perf_counter() - t0
    sizes = bytes_per_step(gloo, env.rank)
    if env.rank == 0:
        print(f"\nall-reduce, 2 ranks, fp32, fastest of {ROUNDS} rounds ({t_bw:.0f} s; load average before "
              f"{load[0]:.1f} on {os.cpu_count()} cores)")
        print(f"{'bytes':>9} {'gloo raw':>10} {'gloo plug':>10} {'ratio':>6} {'algbw GB/s':>10} "
              f"{'mpi raw':>10} {'mpi plug':>10} {'ratio':>6} {'algbw GB/s':>10} {'mpi stage':>10}")
        for r in rows:
            b = r["bytes"]
            label = f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
            print(f"{label:>9} {r['gloo_raw_s'] * 1e6:>8.0f}us {r['gloo_plugin_s'] * 1e6:>8.0f}us {r['gloo_ratio']:>6.2f} "
                  f"{b / r['gloo_plugin_s'] / 1e9:>10.3f} {r['mpi_raw_s'] * 1e6:>8.0f}us {r['mpi_plugin_s'] * 1e6:>8.0f}us "
                  f"{r['mpi_ratio']:>6.2f} {b / r['mpi_plugin_s'] / 1e9:>10.3f} {r['mpi_stage_s'] * 1e6:>8.1f}us")
        print(f"\nbytes per rank per step, {sizes['model']}, 2 ranks (payload; ring wire = payload at k = 2)")
        print(f"  DDP (comm hook):      {sizes['ddp_bytes_per_step'] / 2**20:8.2f} MiB")
        for c in ("1", "0.5"):
            s = sizes[f"sdp_c{c}"]
            print(f"  SDP C={c:<4} (plugin):  {s['bytes_per_step'] / 2**20:8.2f} MiB  ({s['vs_ddp']:.1%} of DDP; "
                  f"groups {', '.join(f'{g}: {n / 2**20:.2f} MiB' for g, n in s['by_group'].items())})")
        print("  implied by the plan (not measured): " + ", ".join(
            f"{k}: {v['max_bytes_per_rank'] / 2**20:.2f} MiB" for k, v in sizes["implied_by_plan"].items()))
        print("  LLaMA: not on this branch (the LLaMA adapter is another issue's work).")
        out = results_dir()
        out.mkdir(parents=True, exist_ok=True)
        result = {"command": "python benchmarks/comm_bandwidth.py", "torch": torch.__version__,
                  "mpi": mpi.MPI.Get_library_version().splitlines()[0].strip(), "cpu_count": os.cpu_count(), "load_average_before": load,
                  "allreduce": rows, "bytes_per_step": sizes}
        (out / "comm_bandwidth.json").write_text(json.dumps(result, indent=2))
        print(f"\nwrote {out / 'comm_bandwidth.json'}")
    mpi.shutdown()
    gloo.shutdown()


if __name__ == "__main__":
    main()
