"""Set-up: everything a rank needs before its first step, and the checks that guard it.

:func:`setup` is the composition root of a worker: the plugins chosen by name, the plan validated
before any process group exists, the process group, the run directory and its lock, and then the
two objects a run is made of: the frozen :class:`~subnetdp.core.contracts.RunContext` and the
:class:`~subnetdp.train.state.TrainState`. :func:`preflight` runs the same checks in the launching
process, before any worker starts.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from subnetdp.core import config as config_mod
from subnetdp.core.contracts import (Communicator, DataModule, DataSpec, LaunchEnv, Masker, ModelAdapter, Partition,
                                     RunContext)
from subnetdp.core.errors import ConfigError, RankMismatchError, SubnetdpError
from subnetdp.core.plan import MaskPlan, make_plan
from subnetdp.launchers.nodes import plan_nodes
from subnetdp.core.plugins import PluginManager
from subnetdp.launchers import init_method
from subnetdp.sdp.construct import empty_local, meta_model
from subnetdp.sdp.flops import FlopRatios
from subnetdp.sdp.variants import partition_model
from subnetdp.train import faults
from subnetdp.train.checkpoints.checkpointer import check_resume_source
from subnetdp.train.checkpoints.files import latest_checkpoint
from subnetdp.train.evaluation import load_tasks
from subnetdp.train.runlock import RunLock, RunLockedError
from subnetdp.train.state import TrainState


def set_threads(cfg: DictConfig, env: LaunchEnv) -> int:
    """Torch's intra-op thread count: ``launch.threads_per_rank``, or the cores shared evenly.

    ``cfg`` here and below is a composed config: typed by its schemas, so its values are read as they are."""
    n = cfg.launch.threads_per_rank or max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    torch.set_num_threads(n)
    return n


def check_recalibration_fits(cfg: DictConfig, data: DataModule) -> None:
    """``eval.bn_recalibrate_batches`` at most one pass over the training data (the loader is endless)."""
    n = cfg.eval.bn_recalibrate_batches
    if n <= 0:
        return
    try:
        per_epoch = data.train_loader(0, 1, cfg.train.batch_size).batches_per_epoch
    except (SubnetdpError, ValueError):  # a batch larger than the data is the batch size's error, reported where it is checked
        return
    if per_epoch is not None and n > per_epoch:
        raise ConfigError("eval.bn_recalibrate_batches", n, f"is more than the {per_epoch} batches of "
                          f"train.batch_size={cfg.train.batch_size} the training data holds",
                          f"use at most {per_epoch} (20 is usual), or 0 to keep the averaged statistics")


def build_plan(cfg: DictConfig, world_size: int, pm: PluginManager) -> tuple[DataModule, DataSpec, ModelAdapter, torch.nn.Module, Partition, MaskPlan]:
    """Data spec, full model, partition and validated plan: all without a process group."""
    regs = pm.registries
    data: DataModule = regs["data"].create(cfg.data.name, cfg.data, seed=cfg.seed)
    data.check()
    check_recalibration_fits(cfg, data)
    spec = data.spec()
    adapter: ModelAdapter = regs["model"].create(cfg.model.name, cfg.model)
    masker: Masker = regs["masker"].create(cfg.masker.name, cfg.masker)
    replicas = config_mod.check_world(cfg, world_size)  # fsdp.shard_size must divide the world
    # The full model exists only on the meta device (shapes, no storage): the partition, the units'
    # FLOPs and the plan come from it; a rank materialises its own units in setup().
    torch.manual_seed(cfg.seed)
    full = meta_model(adapter, spec)
    partition = partition_model(adapter, full, cfg.masker, spec)
    # With FSDP the plan is made over the replicas; the S ranks of a replica own the same units.
    plan = make_plan(masker, partition, replicas, cfg.seed, cfg.masker.min_owners, plan_nodes(cfg, world_size))
    return data, spec, adapter, full, partition, plan.replicated(cfg.fsdp.shard_size)


def preflight(cfg: DictConfig, world_size: int, pm: PluginManager, machine: bool = True) -> MaskPlan:
    """Validate the communicator, run directory, data and plan for ``world_size`` ranks before any
    worker is started (``machine=False``: the workers run elsewhere, skip this machine's checks)."""
    from subnetdp.train import upfront

    if machine:
        upfront.check_backend(cfg, pm.registries, world_size)
    else:
        pm.registries["comm"].get(cfg.comm.name).check_world_size(world_size)
    upfront.check_run_dir(cfg)
    init_method.check_file_store(cfg)
    data, *_, plan = build_plan(cfg, world_size, pm)
    upfront.check_batch_fits(cfg, data, world_size)
    check_resume_source(cfg)
    return plan


def setup(cfg: DictConfig, env: LaunchEnv, pm: PluginManager,
          on_context: Callable[[RunContext], None] | None = None) -> tuple[RunContext, TrainState]:
    """Build everything a rank needs: the frozen run context and the training state.

    Bad input fails before the process group exists. ``cfg`` is read, never written: the context
    holds a read-only copy of it, its typed :class:`~subnetdp.core.config.Settings` (made with the
    context), and what the run derives from it (the FLOP-matched step count, the run name rank 0 made when
    ``run.name`` is empty). ``on_context`` is called with the context as soon as it exists (the run
    directory is then this job's), before the state is built.
    """
    comm: Communicator = pm.registries["comm"].create(cfg.comm.name, cfg.comm, env)
    comm.check_environment()
    if cfg.train.device == "cuda" and comm.device.type != "cuda":
        raise ConfigError("train.device", "cuda", f"comm.name={cfg.comm.name} computes on {comm.device.type}",
                          "use comm.name=nccl for GPUs")
    data, spec, adapter, full, partition, plan = build_plan(cfg, env.world_size, pm)
    ratios = count_flops(cfg, adapter, spec, full, partition, plan, data)
    flop_match = match_flops(cfg, ratios)  # train.flop_matched
    # Every rank runs train.grad_accum micro-batches a step, each costing its share of the full model's.
    step_flops = ratios.full_train_step * sum(ratios.per_rank_train_step) * cfg.train.grad_accum
    if cfg.train.compile:
        from subnetdp.parallel.compile import require_compilable

        require_compilable(comm.device, cfg.train.compile_backend)

    tasks = load_tasks(cfg, data)  # a task that is unknown or needs a download fails here, on every rank
    check_resume_source(cfg)  # a damaged manifest fails here, on every rank
    if getattr(comm, "replacement", False):  # a replacement of a dead worker: ready before it announces itself
        from subnetdp.train.rejoin import warm_up

        warm_up(cfg, env.rank, env.world_size, data, adapter, spec, partition, plan, comm.device)
    comm.init()  # collective: the first point where every rank meets.
    # A replacement joins members in mid-run (train/rejoin.py): it shares none of set-up's collectives.
    joined = getattr(comm, "joined", None) is not None
    if not joined:
        check_ranks_agree(comm, plan, cfg, pm)
    run_dir = resolve_run_dir(cfg, comm)  # the supervisor names the run: no collective for a replacement
    lock = None if joined else lock_run_dir(run_dir, comm)
    frozen = copy.deepcopy(cfg)  # the caller keeps its own config; the run's cannot change under it
    OmegaConf.set_readonly(frozen, True)
    ctx = RunContext(cfg=frozen, env=env, comm=comm, plugins=pm, adapter=adapter, data=data, spec=spec,
                     run_dir=run_dir, lock=lock, tasks=tasks, flop_match=flop_match, step_flops=step_flops)
    if on_context is not None:
        on_context(ctx)
    # Owner-local: only this rank's units and the shared tensors get storage. Collective: FSDP's device
    # mesh (when sharded) and the synchroniser's owner groups are created on every rank.
    if joined:  # on meta-made storage: every value comes from the members over the network
        plan = MaskPlan(plan.world_size, comm.joined["full"], plan.num_units)  # the plan the members return to
        model, pmap = empty_local(adapter, spec, plan.owned[env.rank], partition, cfg.masker, comm.device)
        return ctx, TrainState(ctx, partition, plan, model, pmap, last_good=lambda: latest_checkpoint(ctx.run_dir))
    return ctx, TrainState.build(ctx, partition, plan, full, last_good=lambda: latest_checkpoint(ctx.run_dir))


def count_flops(cfg: DictConfig, adapter: ModelAdapter, spec: DataSpec, full: torch.nn.Module, partition: Partition,
                plan: MaskPlan, data: DataModule) -> FlopRatios:
    """The plan's training-FLOP ratios, counted on ``meta`` (:mod:`subnetdp.sdp.flops`; the same on every
    rank and in ``subnetdp plan``)."""
    from subnetdp.sdp.flops import plan_flops

    return plan_flops(adapter, full, partition, plan, cfg.masker, data.example_batch(spec, cfg.train.batch_size))


def match_flops(cfg: DictConfig, ratios: FlopRatios) -> dict[str, Any] | None:
    """``train.flop_matched``: the step count whose training FLOPs equal ``train.steps`` steps of the
    full model, ``round(steps / r)`` with ``r`` the plan's training-FLOP ratio. It goes on the run
    context (:attr:`~subnetdp.core.contracts.RunContext.steps`), not into the config: everything that
    follows the step count (the schedule, checkpoints, the end) spans it, and the stored config still
    says what was asked for. Returns what the summary records, or None."""
    if not cfg.train.flop_matched:
        return None
    requested: int = cfg.train.steps
    return {"steps_requested": requested, "steps": ratios.matched_steps(requested), "train_flop_ratio": ratios.train_step}


def check_ranks_agree(comm: Communicator, plan: MaskPlan, cfg: DictConfig, pm: PluginManager) -> None:
    """Stop on every rank if any rank holds a different plan, config or plugin set."""
    values = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(values, dict)
    mine = {"plan": plan.digest(), "config": config_mod.digest(cfg), "plugins": pm.versions(),
            "owned": plan.owned, "values": {k: v for k, v in values.items() if k not in ("launch", "run")}}
    # collective: every rank reaches this once, right after the process group exists.
    problem = describe_disagreement(comm.all_gather_object(mine))
    if problem:
        raise RankMismatchError(problem + ": start every rank with the same recipe, overrides and installed plugins")


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def describe_disagreement(everyone: list[dict[str, Any]]) -> str | None:
    """Which rank differs from rank 0, in what (plan, config or plugins) and how; None if all agree."""
    ref = everyone[0]
    for r, theirs in enumerate(everyone):
        for key in ("plan", "config", "plugins"):
            if theirs[key] == ref[key]:
                continue
            msg = f"rank {r} has a different {key} than rank 0 ({theirs[key]} vs {ref[key]})"
            if key == "plan":
                diff = [f"rank {q} owns {o} vs {ref['owned'][q]}" for q, o in enumerate(theirs["owned"])
                        if q < len(ref["owned"]) and o != ref["owned"][q]]
            elif key == "config":
                a, b = _flat(theirs["values"]), _flat(ref["values"])
                diff = [f"{k}={a.get(k, '<unset>')!r} vs {b.get(k, '<unset>')!r}" for k in sorted(set(a) | set(b))
                        if a.get(k, "<unset>") != b.get(k, "<unset>")]
            else:
                a, b = theirs[key], ref[key]
                diff = [f"{k}: {a.get(k, 'missing')} vs {b.get(k, 'missing')}" for k in sorted(set(a) | set(b))
                        if a.get(k) != b.get(k)]
            return msg + (": " + "; ".join(diff[:6]) if diff else "")
    return None


def resolve_run_dir(cfg: DictConfig, comm: Communicator) -> Path:
    """``run.dir/run.name``; a missing name is made once on rank 0 (with a timestamp) and shared. The
    name made lives in the returned path (the context's ``run_dir``), not in ``cfg``."""
    name: str = cfg.run.name
    if not name:
        name = config_mod.default_run_name(cfg, comm.world_size) + time.strftime("-%Y%m%d-%H%M%S")
        # collective: rank 0's name wins, so lazily made names never differ by rank.
        name = comm.all_gather_object(name)[0]
    run_dir = Path(cfg.run.dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def lock_run_dir(run_dir: Path, comm: Communicator) -> RunLock | None:
    """Rank 0 takes the run directory's exclusive lock for the job; every rank stops if it is taken."""
    lock, error = None, None
    if comm.rank == 0:
        try:
            # A group restarted by torchrun may start while its previous rank 0 is still exiting.
            restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
            lock = RunLock(run_dir, wait_s=60.0 if restarted else 0.0)
        except SubnetdpError as e:
            error = str(e)
    # collective: every rank learns whether rank 0 holds the run directory.
    error = comm.all_gather_object(error)[0]
    if error:
        raise RunLockedError(error)
    return lock


_loop_froze = False  # freeze_lasting ran in the loop now running (a later segment collects first)


@contextlib.contextmanager
def frozen_while_training() -> Iterator[None]:
    """The loop's span: what :func:`freeze_lasting` froze is the collector's again when it ends (a process
    may train more than one run)."""
    global _loop_froze
    _loop_froze = False
    try:
        yield
    finally:
        _loop_froze = False
        gc.unfreeze()


def freeze_lasting() -> None:
    """Put everything alive now (the imports, the model, the optimizer: it lives for the run) out of the
    cycle collector's sight until the loop ends. A full collection scanned it all (~370k objects: 0.1-0.8 s
    on a loaded machine, measured), a pause every rank waited for at the next collective, and the
    allocations of a set-up or a re-plan made one due within the next steps.

    A later segment of the loop (after a death's or a join's re-plan, which made a new model, optimizer
    and synchroniser, and the re-formation its short-lived objects) first collects what is not frozen:
    about a millisecond, as the frozen are not scanned; it frees what of the new is cyclic garbage before
    the rest is frozen. What the re-plan replaced was frozen, and reference counting frees it once
    nothing holds it; nothing does (``continuation.WentOn`` keeps the last checkpointer's ``Handover``,
    not the checkpointer, which holds the replaced model). The loop's first freeze collects nothing:
    nothing is frozen yet, and a collection would scan everything (a newcomer's first segment too).
    """
    global _loop_froze
    if _loop_froze:
        gc.collect()  # what was made since the last freeze, alone
    gc.freeze()
    _loop_froze = True
    faults.models_alive()  # test-only
