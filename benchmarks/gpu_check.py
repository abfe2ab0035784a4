"""GPU-side checks of the ``nccl`` and ``mpi`` communicators, for a machine with one CUDA GPU.

    bash scripts/setup.sh && .venv/bin/python benchmarks/gpu_check.py       # about 1-2 minutes
    .venv/bin/python benchmarks/gpu_check.py --cpu-rehearsal                # exercises the script on CPU

NCCL refuses two ranks on one GPU, so with one GPU everything runs at world size 1:

1. ``nccl`` collectives on CUDA tensors: all_reduce (sync and async), broadcast, all_gather_object,
   barrier, byte counting; a world-size-1 sum must leave the tensor bit-identical.
2. The whole training loop with ``comm.name=nccl`` (ResNet-18 on digits, C=1): the model, the
   synchroniser's gradient buckets and the step all live on ``cuda:0``; every bucket is then also
   all-reduced through NCCL explicitly (at world size 1 the synchroniser skips one-owner buckets).
   Peak memory comes from the CUDA allocator.
3. gloo-vs-nccl: the same recipe and seed with ``comm.name=gloo`` on CPU; with TF32 off, losses and
   eval metrics must agree to fp32 tolerance (GPU and CPU kernels round differently: not bitwise).
4. ``mpi`` with CUDA tensors (``comm.device=cuda``): staged through pinned host buffers
   (``cuda_aware=false``) and whatever the library reports (``cuda_aware=null``) for this MPI; bf16 via fp32.

Prints one line per check and writes benchmarks/results/gpu_check.json. Exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from subnetdp.train.configure import load_config  # noqa: E402
from subnetdp.core.contracts import LaunchEnv  # noqa: E402
from subnetdp.train.loop import train  # noqa: E402
from subnetdp.core.plugins import PluginManager  # noqa: E402
from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise

RESULTS: dict = {}


def report(name: str, ok: bool, detail: str = "") -> None:
    RESULTS[name] = {"ok": bool(ok), "detail": detail}
    print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def check_collectives(comm_cls, name: str, device: torch.device) -> None:
    comm = comm_cls(OmegaConf.structured(comm_cls.Config(name=name)), LaunchEnv())
    comm.check_environment()
    comm.init()
    try:
        assert comm.device == device, (comm.device, device)
        x = torch.randn(1 << 20, device=device)
        ref = x.clone()
        comm.all_reduce(x, comm.world).wait()
        h = comm.all_reduce(x, comm.world, async_op=True)
        h.wait()
        b = torch.arange(10, device=device, dtype=torch.bfloat16)
        comm.broadcast(b, 0)
        gathered = comm.all_gather_object({"rank": comm.rank})
        comm.barrier()
        ok = torch.equal(x, ref) and gathered == [{"rank": 0}] and comm.bytes.total() == 2 * x.numel() * 4
        report(f"{name} collectives on {device}", ok, f"bytes counted {comm.bytes.total()}")
    finally:
        comm.shutdown()


def run_loop(comm: str, device: str, tmp: Path, extra: list[str]) -> tuple:
    pm = PluginManager()
    cfg = load_config("resnet18_digits", ["train.steps=8", "optim.warmup_steps=8", "train.batch_size=32", "train.log_every=2", "train.progress=false",
                                      "masker.coverage=1", "eval.batches=2", "eval.bn_recalibrate_batches=0",
                                      "launch.nproc=1", "launch.threads_per_rank=1", f"comm.name={comm}",
                                      f"train.device={device}", f"run.dir={tmp}", f"run.name={comm}-{device}", *extra],
                  pm.registries)
    t0 = time.perf_counter()
    run = train(cfg, LaunchEnv(), pm)
    lines = (tmp / f"{comm}-{device}" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(l)["train/loss"] for l in lines if "train/loss" in l]
    return run, losses, time.perf_counter() - t0


def check_loop(comm: str, device: torch.device, tmp: Path, extra: list[str] = ()) -> tuple:
    run, losses, secs = run_loop(comm, device.type, tmp, list(extra))
    buckets = run.state.synchronizer.buckets
    on_device = all(b.buffer.device == device for b in buckets) and all(
        p.device == device for p in run.state.model.parameters())
    # At world size 1 every bucket has one owner and the synchroniser skips it; push each through
    # the communicator anyway (a fresh process group: the run's was shut down).
    comm_obj = type(run.context.comm)(run.context.cfg.comm, LaunchEnv())
    comm_obj.check_environment()
    comm_obj.init()
    try:
        same = True
        for b in buckets:
            before = b.buffer.clone()
            comm_obj.all_reduce(b.buffer, comm_obj.world, async_op=True).wait()
            same &= torch.equal(before, b.buffer)
    finally:
        comm_obj.shutdown()
    summary = run.result.summary["ranks"][0]
    report(f"loop comm={comm} on {device}", on_device and same and len(losses) == 4,
           f"{len(buckets)} buckets on {buckets[0].buffer.device}, losses {['%.5f' % l for l in losses]}, "
           f"eval {run.result.eval_metrics}, peak {summary['peak_memory_bytes'] / 2**20:.1f} MiB "
           f"({summary['memory_measured_by']}), {secs:.1f} s")
    return losses, run.result.eval_metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run the same steps with gloo on CPU (checks the script, not the GPU path)")
    ns = parser.parse_args()
    from subnetdp.plugins.comm.gloo import GlooCommunicator
    from subnetdp.plugins.comm.mpi import MpiCommunicator
    from subnetdp.plugins.comm.nccl import NcclCommunicator

    if ns.cpu_rehearsal:
        gpu_comm, device, comm_cls = "gloo", torch.device("cpu"), GlooCommunicator
    else:
        if not torch.cuda.is_available():
            print("no CUDA GPU here: run on the GPU machine, or pass --cpu-rehearsal", file=sys.stderr)
            return 2
        gpu_comm, device, comm_cls = "nccl", torch.device("cuda", 0), NcclCommunicator
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on the GPU, comparable with the CPU run
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True  # so two GPU runs can be compared bit for bit
        torch.backends.cudnn.benchmark = False
        RESULTS["gpu"] = torch.cuda.get_device_name(0)
        print(f"GPU: {RESULTS['gpu']}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    check_collectives(comm_cls, gpu_comm, device)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        gpu_losses, gpu_eval = check_loop(gpu_comm, device, tmp / "a")
        cpu_losses, cpu_eval = check_loop("gloo", torch.device("cpu"), tmp / "b")
        compare(f"{gpu_comm} on {device} vs gloo on cpu", gpu_losses, cpu_losses, gpu_eval, cpu_eval)
        # mpi with CUDA tensors staged through pinned host memory: the same arithmetic as nccl's run.
        mpi_losses, mpi_eval = check_loop("mpi", device, tmp / "c", [f"comm.device={device.type}", "comm.cuda_aware=false"])
        compare(f"mpi (staged) vs {gpu_comm}, both on {device}", mpi_losses, gpu_losses, mpi_eval, gpu_eval)
        mpi = MpiCommunicator(OmegaConf.structured(MpiCommunicator.Config(name="mpi", device=device.type)), LaunchEnv())
        mpi.check_environment()
        mpi.init()
        x = torch.full((4096,), 1.25, device=device, dtype=torch.bfloat16)
        mpi.all_reduce(x, mpi.world, async_op=True).wait()
        report(f"mpi all_reduce bf16 on {device}", torch.equal(x, torch.full_like(x, 1.25)),
               f"MPI CUDA-aware (asked the library): {mpi.cuda_aware}; {mpi.MPI.Get_library_version().splitlines()[0].strip()}")
        mpi.shutdown()
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_check_cpu_rehearsal.json" if ns.cpu_rehearsal else "gpu_check.json"
    (out / name).write_text(json.dumps(RESULTS, indent=2, default=str))
    failed = [k for k, v in RESULTS.items() if isinstance(v, dict) and not v["ok"]]
    passed = sum(1 for v in RESULTS.values() if isinstance(v, dict) and v["ok"])
    print(f"\n{passed} checks passed, {len(failed)} failed; wrote {out / name}")
    return 1 if failed else 0


def compare(name: str, a: list[float], b: list[float], eval_a: dict, eval_b: dict) -> None:
    """Losses and eval loss of two runs within fp32 tolerance; the detail says if they are bitwise equal."""
    diff = max(abs(x - y) for x, y in zip(a, b)) if a and b else float("nan")
    detail = f"max loss difference {diff:.2e}, bitwise equal: {a == b and eval_a == eval_b}"
    try:
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(eval_a["loss"], eval_b["loss"], rtol=1e-3, atol=1e-4)
        report(name, len(a) == len(b) > 0, detail)
    except AssertionError as e:
        report(name, False, str(e).splitlines()[0] + f" ({detail})")


if __name__ == "__main__":
    raise SystemExit(main())
