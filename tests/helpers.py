"""Shared test helpers: composing small configs and running real multi-process gloo groups."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from subnetdp.train.configure import load_config
from subnetdp.core.contracts import ParamMap
from subnetdp.sdp.pieces import LocalIndex, global_items
from subnetdp.core.plan import MaskPlan
from subnetdp.core.plugins import PluginManager

_PM: PluginManager | None = None


def plugin_manager() -> PluginManager:
    global _PM
    if _PM is None:
        _PM = PluginManager()
    return _PM


def small_config(*overrides: str, recipe: str | None = "resnet18_digits", run_dir: str | os.PathLike = "runs") -> Any:
    """The default recipe shrunk for tests: no progress bar, cheap evaluation, one thread."""
    base = ["train.progress=false", "launch.nproc=1", "launch.threads_per_rank=1", f"run.dir={run_dir}",
            "eval.bn_recalibrate_batches=0", "train.log_every=1000", "optim.warmup_steps=0",
            "checkpoint.enabled=false"]  # tests that need checkpoints turn them back on
    return load_config(recipe, base + list(overrides), plugin_manager().registries)


# What every rank imports anyway. A forkserver imports it once per test process and forks each rank from
# it, instead of each spawned rank importing torch and the plugins afresh (about 5 s of CPU a rank here).
# The plugins' modules only: the MPI communicator imports mpi4py when it is used.
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "subnetdp.train.setup", "subnetdp.train.loop",
            "subnetdp.train.checkpoints.files", "tests.helpers"]
START_METHODS = ("forkserver", "spawn")


def _context(start: str) -> Any:
    if start not in START_METHODS:
        raise ValueError(f"run_ranks(start={start!r}): use one of {START_METHODS}")
    ctx = mp.get_context(start)
    if start == "forkserver":
        from importlib.metadata import entry_points

        plugins = [ep.value.split(":")[0] for ep in entry_points(group="subnetdp")]
        ctx.set_forkserver_preload(_PRELOAD + plugins)  # read once, when the server starts
    return ctx


class _StdStream:
    """The test process's stdout or stderr file descriptor as it is now, handed to a rank. A forked rank
    would otherwise write to the descriptors the server inherited when it started (another test's
    capture), and ``capfd`` would not see it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Any:
        from multiprocessing import reduction

        return _inherited, (reduction.DupFd(self.fd), self.fd)  # DupFd only while a process is being started


def _inherited(dup: Any, target: int) -> int:
    fd = dup.detach()
    if fd != target:
        os.dup2(fd, target)
        os.close(fd)
    return target


def _worker(fn: Callable[..., Any], rank: int, world_size: int, init_method: str, out: str, args: Sequence[Any],
            environ: dict[str, str], cwd: str, streams: Sequence[int]) -> None:
    # ``streams`` were put in place while unpickling (_inherited). A forked rank sees the server's
    # environment and folder, not the test's (a spawned one inherits the test's at that moment): hand them over.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update({"OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, init_method, *args)
        torch.save({"ok": True, "result": result}, out)
    except BaseException as e:  # report to the parent, which fails the test with it
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}, out)
        raise SystemExit(1)


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path, *args: Any, timeout: float = 180,
              expect_error: bool = False, start: str = "forkserver") -> list[Any]:
    """Run ``fn(rank, world_size, init_method, *args)`` in ``world_size`` new processes, each with the
    test's environment, folder, stdout and stderr (``capfd`` reads them).

    ``start``: "forkserver" forks each rank from a server that has imported torch and the plugins once
    per test process; "spawn" starts a fresh interpreter per rank (for a test of import-time behaviour).

    The processes meet through a ``FileStore`` in ``tmp_path`` (no ports). Returns each rank's
    result (or, with ``expect_error``, each rank's error message); a hang past ``timeout`` seconds
    kills them all and fails.
    """
    store = tmp_path / f"store-{os.urandom(4).hex()}"
    init_method = f"file://{store}"
    ctx = _context(start)
    outs = [str(tmp_path / f"result-{store.name}-{r}.pt") for r in range(world_size)]
    sys.stdout.flush()
    sys.stderr.flush()
    handed = (dict(os.environ), os.getcwd(), [_StdStream(1), _StdStream(2)])
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, init_method, outs[r], args, *handed))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running after {timeout}s"
    results = []
    for r, path in enumerate(outs):
        assert Path(path).exists(), f"rank {r} died without a result (exit code {procs[r].exitcode})"
        res = torch.load(path, weights_only=False)
        if expect_error:
            assert not res["ok"], f"rank {r} succeeded but an error was expected"
            results.append(res["error"])
        else:
            assert res["ok"], f"rank {r} failed:\n{res['traceback']}"
            results.append(res["result"])
    return results


def ddp_reference_params(cfg: Any, rank: int, world_size: int, init_method: str, steps: int) -> dict[str, torch.Tensor]:
    """Plain torch DDP on the same initial weights, batches, optimizer and schedule as ``cfg``'s run.

    The anchor the C = 1 tests compare against; it makes its own gloo group (``init_method + "-ddp"``).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from subnetdp.sdp.construct import initial_model
    from subnetdp.train.optim import build_optimizer, build_schedule

    pm = plugin_manager()
    data = pm.get("data", cfg.data.name)(cfg.data, seed=int(cfg.seed))
    adapter = pm.get("model", cfg.model.name)(cfg.model)
    model = initial_model(adapter, data.spec(), int(cfg.seed))  # the union every SDP run starts from
    torch.manual_seed(int(cfg.seed))  # the RNG state a run trains from (dropout, stochastic depth)
    dist.init_process_group("gloo", init_method=init_method + "-ddp", rank=rank, world_size=world_size)
    try:
        ddp = DDP(model, gradient_as_bucket_view=True)
        opt = build_optimizer(cfg.optim, ddp.parameters())
        sched = build_schedule(cfg.optim, opt, steps)
        batches = iter(data.train_loader(rank, world_size, int(cfg.train.batch_size)))
        for _ in range(steps):
            opt.zero_grad()
            batch = next(batches)
            adapter.training_loss(ddp, batch).backward()
            opt.step()
            sched.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


def digest(t: torch.Tensor) -> str:
    """A tensor's dtype, shape and bytes as one sha256: equal digests mean bit-identical tensors.

    Workers hand back digests instead of whole models, so a spawn's results stay small on disk.
    """
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sample(t: torch.Tensor, key: Any, n: int = 2048) -> torch.Tensor:
    """Up to ``n`` coordinates of ``t``, the same ones for the same ``key`` and shape on every rank.

    For elementwise properties (an average is the mean of its terms, coordinate by coordinate) a fixed
    sample of every tensor tests every tensor, at a few kilobytes instead of the whole model.
    """
    flat = t.detach().reshape(-1)
    if flat.numel() <= n:
        return flat.clone()
    seed = int.from_bytes(hashlib.sha256(repr((key, tuple(t.shape))).encode()).digest()[:8], "little") >> 1
    idx = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))[:n]
    return flat[idx].clone()


UNIT_ROUNDOFF = 2.0 ** -24  # fp32


def assert_mean_of(actual: torch.Tensor, terms: Sequence[torch.Tensor], what: Any, roundings: int | None = None) -> None:
    """``actual`` is the fp32 mean of ``terms`` as a reduction computed it, in an order of its own.

    Reordering an fp32 sum of n terms moves it by at most ``(n - 1) * u * sum|x|`` (u = 2**-24), and
    the division adds one more rounding, so every coordinate lies within ``n * u * mean|x|`` of the
    exact mean; the bound used is twice that (``roundings`` overrides n for longer chains). This is
    what the arithmetic explains and nothing more: a wrong divisor or a missing term is far outside it,
    on every machine, whatever order its kernels sum in.
    """
    stack = torch.stack([t.double() for t in terms])
    exact = stack.mean(0)
    n = len(terms) if roundings is None else roundings
    bound = 2 * n * UNIT_ROUNDOFF * stack.abs().mean(0)
    excess = (actual.double() - exact).abs() - bound
    worst = int(excess.argmax())
    assert float(excess.flatten()[worst]) <= 0, (
        f"{what}: {float(actual.flatten()[worst])!r} is not the mean of its {len(terms)} terms "
        f"{[float(t.flatten()[worst]) for t in terms]} (exact {float(exact.flatten()[worst])!r}, "
        f"allowed {float(bound.flatten()[worst]):.3g}) at flat index {worst}")


def assert_pieces_at_global_coordinates(sub: Any, pmap: Any, reference: Any, partition: Any, owned: Sequence[int],
                                        rtol: float, atol: float, values: bool = False) -> int:
    """Each owned piece's gradient (and with ``values`` its value, exactly) equals the reference model's
    at its global coordinates, and a dropped piece is not held at all: the ParamMap puts every piece
    where it belongs. Returns the number of pieces checked."""
    plan = MaskPlan(1, [list(owned)], len(partition.units))
    index = LocalIndex(sub, pmap)
    ref_index = LocalIndex(reference, ParamMap.identity([n for n, _ in reference.named_parameters()], {}))
    checked = 0
    for item in global_items(partition, plan):
        if not item.owners:
            assert not index.holds(item), item.name
            continue
        if values:
            torch.testing.assert_close(index.view(item), ref_index.view(item), rtol=0, atol=0)
        torch.testing.assert_close(index.view(item, grad=True), ref_index.view(item, grad=True), rtol=rtol, atol=atol)
        checked += 1
    return checked


LM_STEPS = 4  # train.steps of lm_config


def lm_config(init_method: str, cache: str, *overrides: str):
    return small_config(f"train.steps={LM_STEPS}", "train.batch_size=4", "data.seq_len=32", "data.stdlib_max_mb=0.5",
                        f"data.cache_dir={cache}", "eval.batches=2", "optim.name=adamw", "optim.lr=1e-3",
                        "optim.weight_decay=0.1", "optim.clip_grad_norm=0", f"comm.init_method={init_method}",
                        *overrides, recipe="llama_tiny_stdlib", run_dir=init_method.removeprefix("file://") + "-runs")


def train_gathered(cfg, rank: int, world: int) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Train (setup and the loop, as a worker does), then read the full (gathered) parameters before the process group goes away."""
    from subnetdp.core.contracts import LaunchEnv
    from subnetdp.train.loop import train_loop
    from subnetdp.train.setup import set_threads, setup

    env = LaunchEnv(rank, world, rank, world, "test")
    pm = plugin_manager()
    set_threads(cfg, env)
    ctx, state = setup(cfg, env, pm)
    try:
        result = train_loop(ctx, state)
        sharded = {n: type(p).__name__ for n, p in state.model.named_parameters()}
        with state.parallel.gathered(state.model):  # collective over each shard group
            params = {n: p.detach().clone() for n, p in state.model.named_parameters()}
    finally:
        ctx.comm.shutdown()
    return params, result.summary, sharded


NOBODY = 65534


def unprivileged_folder(prefix: str) -> Path:
    """A fresh folder that uid :data:`NOBODY` may reach and owns (under /tmp, whose pytest folders are 0700)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(folder, 0o755)
    if os.geteuid() == 0:
        os.chown(folder, NOBODY, NOBODY)
    return folder


class as_nobody:
    """Within this block the process's real and effective ids are uid/gid :data:`NOBODY` (root keeps them as
    its saved ids and gets them back on exit), so ``os.access`` answers as an ordinary user would: a test of
    a permission refusal then runs as root too instead of being skipped. A no-op for a non-root user."""

    def __enter__(self) -> "as_nobody":
        self.root = os.geteuid() == 0
        if self.root:
            os.setresgid(NOBODY, NOBODY, 0)
            os.setresuid(NOBODY, NOBODY, 0)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.root:
            os.setresuid(0, 0, 0)
            os.setresgid(0, 0, 0)


# Processes of a job, read from /proc (Linux): what a test of signals and kills checks is gone.
def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p}
        found |= kids
        todo += list(kids)
    return found


def training_workers(pid: int) -> set[int]:
    """The descendants of ``pid`` that run ``subnetdp ... train`` (a launcher's workers, or torchrun and its workers)."""
    found = set()
    for p in descendants(pid):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if b"subnetdp" in cmdline and b"train" in cmdline:
            found.add(p)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie is not)."""
    out = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(p)
    return out


def gone_within(pids: set[int], seconds: float) -> set[int]:
    """Wait up to ``seconds`` for ``pids`` to end; those still alive then."""
    import time

    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)
