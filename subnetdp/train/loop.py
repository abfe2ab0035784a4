"""The training loop: set up a rank's subnetwork, train it, evaluate the union model, summarise."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from subnetdp.core import config as config_mod
from subnetdp.core.contracts import (Communicator, DataModule, DataSpec, LaunchEnv, Masker, ModelAdapter,
                                     Partition, Run)
from subnetdp.core.errors import ConfigError, RankMismatchError, SubnetdpError
from subnetdp.parallel.memory import training_state_tensors
from subnetdp.train.meter import Meter, RunLogger, bytes_by_group, plan_figure, tensor_digest, write_json
from subnetdp.train.optim import build_optimizer, build_schedule
from subnetdp.sdp.local_steps import LocalStepsSynchronizer
from subnetdp.core.plan import MaskPlan, make_plan
from subnetdp.core.plugins import PluginManager
from subnetdp.train.runlock import RunLock, RunLockedError
from subnetdp.train.checkpoints.resume import Checkpointer, check_resume_source, seed_host_rngs
from subnetdp.train.stopping import Interrupted, StopRequest, hold_for_test, stop_message
from subnetdp.sdp.sync import NonFiniteGuard, OwnerGroupAverager
from subnetdp.train.checkpoints.files import latest_checkpoint
from subnetdp.train.step import train_step
from subnetdp.sdp.branches import fold_branch_scales
from subnetdp.sdp.union import assemble_union, branch_keep_rates, evaluate, evaluate_union
from subnetdp.sdp.construct import build_local, meta_model
from subnetdp.sdp.variants import is_backward, partition_model


def set_threads(cfg: DictConfig, env: LaunchEnv) -> int:
    """Torch's intra-op thread count: ``launch.threads_per_rank``, or the cores shared evenly."""
    n = int(cfg.launch.threads_per_rank) or max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    torch.set_num_threads(n)
    return n


def check_recalibration_fits(cfg: DictConfig, data: DataModule) -> None:
    """``eval.bn_recalibrate_batches`` at most one pass over the training data (the loader is endless)."""
    n = int(cfg.eval.bn_recalibrate_batches)
    if n <= 0:
        return
    try:
        per_epoch = data.train_loader(0, 1, int(cfg.train.batch_size)).batches_per_epoch
    except (SubnetdpError, ValueError):  # a batch larger than the data is the batch size's error, reported where it is checked
        return
    if per_epoch is not None and n > per_epoch:
        raise ConfigError("eval.bn_recalibrate_batches", n, f"is more than the {per_epoch} batches of "
                          f"train.batch_size={cfg.train.batch_size} the training data holds",
                          f"use at most {per_epoch} (20 is usual), or 0 to keep the averaged statistics")


def build_plan(cfg: DictConfig, world_size: int, pm: PluginManager) -> tuple[DataModule, DataSpec, ModelAdapter, torch.nn.Module, Partition, MaskPlan]:
    """Data spec, full model, partition and validated plan: all without a process group."""
    regs = pm.registries
    data: DataModule = regs["data"].create(cfg.data.name, cfg.data, seed=int(cfg.seed))
    data.check()
    check_recalibration_fits(cfg, data)
    spec = data.spec()
    adapter: ModelAdapter = regs["model"].create(cfg.model.name, cfg.model)
    masker: Masker = regs["masker"].create(cfg.masker.name, cfg.masker)
    replicas = config_mod.check_world(cfg, world_size)  # fsdp.shard_size must divide the world
    # The full model exists only on the meta device (shapes, no storage): the partition, the units'
    # FLOPs and the plan come from it; a rank materialises its own units in setup().
    torch.manual_seed(int(cfg.seed))
    full = meta_model(adapter, spec)
    partition = partition_model(adapter, full, cfg.masker, spec)
    # With FSDP the plan is made over the replicas; the S ranks of a replica own the same units.
    plan = make_plan(masker, partition, replicas, int(cfg.seed), int(cfg.masker.min_owners))
    return data, spec, adapter, full, partition, plan.replicated(int(cfg.fsdp.shard_size))


def preflight(cfg: DictConfig, world_size: int, pm: PluginManager, machine: bool = True) -> MaskPlan:
    """Validate the communicator, run directory, data and plan for ``world_size`` ranks before any
    worker is started (``machine=False``: the workers run elsewhere, skip this machine's checks)."""
    from subnetdp.train import upfront

    if machine:
        upfront.check_backend(cfg, pm.registries, world_size)
    else:
        pm.registries["comm"].get(cfg.comm.name).check_world_size(world_size)
    upfront.check_run_dir(cfg)
    data, *_, plan = build_plan(cfg, world_size, pm)
    upfront.check_batch_fits(cfg, data, world_size)
    check_resume_source(cfg)
    return plan


def setup(cfg: DictConfig, env: LaunchEnv, pm: PluginManager) -> Run:
    """Build everything a rank needs. Bad input fails before the process group exists."""
    comm: Communicator = pm.registries["comm"].create(cfg.comm.name, cfg.comm, env)
    comm.check_environment()
    if cfg.train.device == "cuda" and comm.device.type != "cuda":
        raise ConfigError("train.device", "cuda", f"comm.name={cfg.comm.name} computes on {comm.device.type}",
                          "use comm.name=nccl for GPUs")
    data, spec, adapter, full, partition, plan = build_plan(cfg, env.world_size, pm)
    if cfg.train.compile:
        from subnetdp.parallel.compile import require_compilable

        require_compilable(comm.device, str(cfg.train.compile_backend))

    tasks = _downstream_tasks(cfg, data)  # a task that is unknown or needs a download fails here, on every rank
    check_resume_source(cfg)  # a damaged manifest fails here, on every rank
    comm.init()  # collective: the first point where every rank meets.
    check_ranks_agree(comm, plan, cfg, pm)
    run_dir = resolve_run_dir(cfg, comm)
    lock = lock_run_dir(run_dir, comm)
    # Owner-local: only this rank's units and the shared tensors get storage, each initialised from
    # the seed and its global name (backward masking holds the whole model by definition).
    model, pmap = build_local(adapter, full, plan.owned[env.rank], partition, cfg.masker, int(cfg.seed), comm.device)
    run = Run(cfg, env, comm, adapter, data, spec, partition, plan, model, pmap, run_dir, lock=lock)
    run.downstream = tasks
    from subnetdp.parallel.apply import parallelize

    # collective when sharded: FSDP's device mesh is created on every rank.
    run.parallel = parallelize(run)  # activation checkpointing, compile, FSDP: from outside the model
    return run


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
    """``run.dir/run.name``; a missing name is made once on rank 0 (with a timestamp) and shared."""
    name = str(cfg.run.name)
    if not name:
        name = config_mod.default_run_name(cfg, comm.world_size) + time.strftime("-%Y%m%d-%H%M%S")
        # collective: rank 0's name wins, so lazily made names never differ by rank.
        name = comm.all_gather_object(name)[0]
        OmegaConf.update(cfg, "run.name", name)
    run_dir = Path(str(cfg.run.dir)) / name
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


def _to_device(batch: Any, device: torch.device) -> Any:
    return tuple(t.to(device, non_blocking=True) for t in batch) if device.type != "cpu" else batch


def train(cfg: DictConfig, env: LaunchEnv | None = None, pm: PluginManager | None = None) -> Run:
    """Run one training job on this rank; returns the finished :class:`Run`."""
    from subnetdp.launchers import detect

    env = env or detect()
    pm = pm or PluginManager()
    set_threads(cfg, env)
    with StopRequest(env.rank) as stopper:  # SIGINT/SIGTERM: stop at a step boundary, with a checkpoint
        run = setup(cfg, env, pm)
        try:
            train_loop(run, pm, stopper)
        finally:
            run.comm.shutdown()
            if run.lock is not None:
                run.lock.release()
    return run


def train_loop(run: Run, pm: PluginManager, stopper: StopRequest | None = None) -> None:
    """Train ``run`` (built by :func:`setup`) to ``train.steps``: the loop, top to bottom."""
    cfg, comm, steps = run.cfg, run.comm, int(run.cfg.train.steps)
    run.optimizer = build_optimizer(cfg.optim, run.model.parameters())
    scheduler = build_schedule(cfg.optim, run.optimizer, steps)
    run.averager = run.parallel.averager()  # collective: owner groups are created here
    outer = run.averager if isinstance(run.averager, LocalStepsSynchronizer) else None  # sync.mode=local_steps
    refresher, resampler = _refresher(run), _resampler(run)
    log = RunLogger(run.run_dir, run.rank, bool(cfg.run.tensorboard))
    _write_start(run, log)
    loader = run.data.train_loader(run.rank, comm.world_size, int(cfg.train.batch_size))
    ckpt = Checkpointer(run, run.optimizer, scheduler, loader)
    # After set-up, whose lazy imports may draw from them (rich, via scikit-learn, does); a resume restores them.
    seed_host_rngs(int(cfg.seed))
    first = ckpt.start() + 1  # collective: resumes from a checkpoint when cfg.resume asks for one
    run.step = first - 1
    batches = (_to_device(b, comm.device) for b in loader)
    guard = NonFiniteGuard(comm, str(cfg.train.on_nonfinite), lambda: latest_checkpoint(run.run_dir))
    if outer is not None:
        outer.last_good = guard.last_good
    meter = Meter(comm, run.parallel, first, steps, int(cfg.train.memory_step))
    losses: list[float] = []  # this rank's losses since the last log step
    pm.hook.subnetdp_on_run_start(run=run)
    if stopper is not None:
        stopper.armed = True  # from here a signal stops the run at the next step boundary
    bar = _progress(cfg, run.rank, steps)
    run.model.train()
    for step in range(first, steps + 1):
        log_step = step % int(cfg.train.log_every) == 0 or step == steps
        run.averager.prepare()  # drops the last step's gradients: before the memory baseline is taken
        with meter.step(step, lambda: training_state_tensors(run.model, run.optimizer, run.averager.state_tensors())):
            out = train_step(run.model, run.adapter, batches, run.averager, run.optimizer, guard, step=step,
                             accum=int(cfg.train.grad_accum), clip=float(cfg.optim.clip_grad_norm),
                             need_norm=log_step, autocast=run.parallel.autocast, scheduler=scheduler,
                             refresher=refresher, outer=outer, last_step=steps,
                             probe=_probe(run, log, meter, step), device=comm.device)
            if resampler is not None and resampler.due(step) and step < steps:
                # collective: every rank re-draws the same plan and receives the pieces it gains.
                scheduler, refresher = _redraw(run, resampler, step, steps)
                ckpt.optimizer, ckpt.scheduler = run.optimizer, scheduler  # later checkpoints save the new state
        run.step = step
        losses.append(float(out.loss))
        metrics = {"loss": losses[-1], "lr": run.optimizer.param_groups[0]["lr"], "step_time": meter.last_step_time}
        log.scalars(step, {"rank/loss": metrics["loss"], "rank/step_time_s": meter.last_step_time}, per_rank=True)
        if log_step:
            _log_step(run, log, meter, bar, step, losses, out.grad_norm)  # collective: the world's mean loss
            losses = []
        if step == steps or (int(cfg.eval.every) and step % int(cfg.eval.every) == 0):
            run.eval_metrics = evaluate_run(run, log, step)  # collective: the union model streams through every rank
            pm.hook.subnetdp_on_eval_end(run=run, step=step, metrics=run.eval_metrics)
        pm.hook.subnetdp_on_step_end(run=run, step=step, metrics=metrics)
        ckpt.after_step(step)  # collective on save steps: checkpoint.every and the last step
        if bar is not None:
            bar.update(1)
        if stopper is not None and step < steps:
            who = stopper.agreed(comm)  # collective: every rank reaches this at the end of every step
            if who:
                _stop(run, ckpt, step, who, bar, log)
    if bar is not None:
        bar.close()
    if first > steps:  # resumed from the final checkpoint (a crash after it): evaluate what it holds
        run.eval_metrics = evaluate_run(run, log, steps)  # collective
        pm.hook.subnetdp_on_eval_end(run=run, step=steps, metrics=run.eval_metrics)
    run.summary = _summarise(run, meter, max(1, steps - first + 1))
    log.close()
    pm.hook.subnetdp_on_run_end(run=run)


def _log_step(run: Run, log: RunLogger, meter: Meter, bar: Any, step: int, losses: list[float],
              grad_norm: float | None) -> None:
    """The world's mean loss since the last log step, throughput and this rank's figures. Collective."""
    comm, cfg = run.comm, run.cfg
    mean = torch.tensor([sum(losses), float(len(losses))], dtype=torch.float64, device=comm.device)
    with comm.bytes.phase("log"):
        comm.all_reduce(mean, comm.world).wait()  # collective: every rank reaches this on log steps
    step_time = meter.mean_step_time(int(cfg.train.log_every))
    samples_per_step = comm.world_size * int(cfg.train.batch_size) * int(cfg.train.grad_accum)
    record = {"step": step, "train/loss": float(mean[0] / mean[1]),
              "train/lr": run.optimizer.param_groups[0]["lr"], "train/grad_norm": grad_norm,
              "train/step_time_s": step_time, "train/samples_per_s": samples_per_step / step_time}
    if run.spec.seq_len:  # language models: tokens per second over all ranks
        record["train/tokens_per_s"] = record["train/samples_per_s"] * run.spec.seq_len
    log.scalars(step, {k: v for k, v in record.items() if k != "step"})
    log.jsonl(record)
    log.scalars(step, meter.rank_scalars(step), per_rank=True)
    if isinstance(run.averager, LocalStepsSynchronizer) and run.averager.syncs:
        # local steps: the last synchronisation's payload over its H-step cycle
        log.scalars(step, {"rank/bytes_sent_per_step_cycle": run.averager.bytes_per_step_cycle()}, per_rank=True)
    _progress_line(bar, record)


def _stop(run: Run, ckpt: Checkpointer, step: int, who: dict[int, int], bar: Any, log: RunLogger) -> None:
    """Every rank: checkpoint this step (unless it was just saved), then raise :class:`Interrupted`."""
    from subnetdp.train.checkpoints import files as ck

    path = ckpt.last_saved if ckpt.last_saved == ck.step_dir(run.run_dir, step) else None
    hold_for_test()
    if path is None and run.cfg.checkpoint.enabled:
        path = ckpt.save(step)  # collective: every rank agreed to stop after this step
    if bar is not None:
        bar.close()
    log.close()
    signum = who.get(run.rank) or who[min(who)]
    cfg = run.cfg
    hint = f"subnetdp train ... resume=auto run.dir={cfg.run.dir} run.name={cfg.run.name}"
    raise Interrupted(stop_message(who, step, path, hint) if run.rank == 0 else "", 128 + signum)


def _refresher(run: Run) -> Any:
    """Backward masking: the broadcaster of owners' values (None for forward masking)."""
    if not is_backward(run.cfg.masker):
        return None
    from subnetdp.sdp.backward import Refresher

    # With local steps owners disagree between synchronisations: refresh only right after one.
    cycle = int(run.cfg.sync.every) if run.cfg.sync.mode == "local_steps" else 1
    return Refresher(run.model, run.pmap, run.plan, run.partition, run.comm,
                     int(run.cfg.masker.refresh_every) * cycle, float(run.cfg.sync.bucket_cap_mb))


def _resampler(run: Run) -> Any:
    """``masker.resample_every > 0``: the plan re-drawer (None for a fixed plan)."""
    every = int(run.cfg.masker.resample_every)
    if every <= 0:
        return None
    from subnetdp.sdp.resample import Resampler

    return Resampler(run.adapter, run.spec, int(run.cfg.seed), run.partition, run.plan, run.cfg.masker,
                     run.comm, every)


def _redraw(run: Run, resampler: Any, step: int, steps: int) -> tuple[Any, Any]:
    """Switch to the next plan of the family: new model, fresh optimizer state, same schedule.

    Returns the new scheduler and refresher; the model, plan, optimizer and averager are the run's.
    """
    import warnings

    run.averager.remove_hooks()
    with run.comm.bytes.phase("redraw"):  # collective: the pieces a rank gains reach it
        run.model, run.pmap, run.plan = resampler.redraw(step, run.model, run.pmap, run.plan)
    run.model.train()
    run.optimizer = build_optimizer(run.cfg.optim, run.model.parameters())
    scheduler = build_schedule(run.cfg.optim, run.optimizer, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fast-forwarding the schedule before the first optimizer step
        for _ in range(step):
            scheduler.step()
    cfg = run.cfg
    run.averager = OwnerGroupAverager(run.model, run.pmap, run.plan, run.partition, run.comm,
                                      float(cfg.sync.bucket_cap_mb), int(cfg.sync.max_groups))
    return scheduler, _refresher(run)


def _probe(run: Run, log: RunLogger, meter: Meter, step: int) -> Any:
    """``train.grad_alignment_every``: the gradient-alignment probe for this step, or None.

    Not on the memory-measured step; its time and traffic are not the step's.
    """
    every = int(run.cfg.train.grad_alignment_every)
    if not every or step % every or step == meter.measured_step:
        return None

    def probe(batches: list[Any]) -> None:
        from subnetdp.sdp.alignment import gradient_alignment

        t0 = time.perf_counter()
        with run.comm.bytes.phase("probe"):
            result = gradient_alignment(run.adapter, run.spec, int(run.cfg.seed), run.partition, run.plan,
                                        run.model, run.pmap, run.comm, batches)  # collective
        meter.untimed(time.perf_counter() - t0)
        if result is not None:
            run.alignment.append({"step": step, **result})
            log.scalars(step, {f"probe/grad_{k}": v for k, v in result.items()})
            log.jsonl({"step": step, **{f"probe/grad_{k}": v for k, v in result.items()}})
    return probe


def evaluate_run(run: Run, log: RunLogger, step: int) -> dict[str, float]:
    """Evaluate the union model on every rank, streamed from the owners (never assembled). Collective.

    Every rank evaluates the same batches and gets the same metrics (rank 0 logs them). Block-level
    forward masking with ``eval.block_union=rescaled``: every residual branch is scaled by its training
    keep rate. With ``eval.breakdown``, the last evaluation also reports the union at x1 and rescaled
    and every rank's own subnetwork, on the same validation batches. lm-eval tasks (``eval.tasks``)
    run in one process, on a union assembled on rank 0.
    """
    cfg = run.cfg
    block_forward = run.partition.granularity == "block" and not is_backward(cfg.masker)
    breakdown = bool(cfg.eval.breakdown) and block_forward and step == int(cfg.train.steps) and not run.parallel.sharded
    rates = branch_keep_rates(run.partition, run.plan) if block_forward else {}
    mode = str(cfg.eval.block_union)
    run.eval_union = {"block_union": mode, "rescaled": bool(rates) and mode == "rescaled",
                      "branch_keep_rates": rates}

    def union_metrics(scales: dict[str, float]) -> dict[str, float]:
        # collective: every rank streams the union's units from their owners, batch by batch.
        return evaluate_union(run.adapter, run.spec, int(cfg.seed), run.partition, run.plan, run.model,
                              run.pmap, run.comm, run.data, cfg, scales)

    # collective when sharded: full parameters while the union streams; evaluation traffic is not a step's.
    with run.parallel.gathered(), run.comm.bytes.phase("eval"):
        own = _own_subnetworks(run) if breakdown else None  # collective: every rank evaluates its own
        if breakdown:
            x1, rescaled = union_metrics({}), union_metrics(rates)
            metrics = dict(rescaled if mode == "rescaled" else x1)
            run.eval_union.update({"step": step, "union_x1": x1, "union_rescaled": rescaled, "own_subnetworks": own})
            log.jsonl({"step": step, "eval_union": run.eval_union})
        else:
            metrics = union_metrics(rates if run.eval_union["rescaled"] else {})
        union = None
        if run.downstream is not None:  # collective: lm-eval needs the whole union in one process
            union = assemble_union(run.adapter, run.spec, int(cfg.seed), run.partition, run.plan,
                                   run.model, run.pmap, run.comm)
    if step < int(run.cfg.train.steps) and run.rank == 0:  # the final evaluation is in the summary
        from tqdm import tqdm

        tqdm.write(f"eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    log.scalars(step, {f"eval/{k}": v for k, v in metrics.items()})
    log.jsonl({"step": step, **{f"eval/{k}": v for k, v in metrics.items()}})
    if union is not None:
        if run.eval_union["rescaled"]:
            fold_branch_scales(run.adapter.branch_output_layers(union), rates)
        metrics.update(_evaluate_tasks(run, union, log, step))
    return metrics


def _own_subnetworks(run: Run) -> list[dict[str, Any]]:
    """Every rank's own subnetwork, evaluated on the validation batches. Collective."""
    import copy

    mine = {"rank": run.rank, "owned": run.plan.owned[run.rank],
            "metrics": evaluate(copy.deepcopy(run.model), run.adapter, run.data, run.cfg, device=run.comm.device)}
    run.model.train()
    # collective: every rank reaches this at the last evaluation.
    return run.comm.all_gather_object(mine)


def _downstream_tasks(cfg: DictConfig, data: DataModule) -> Any:
    """``eval.tasks``: the lm-eval tasks loaded with their data (None without), before any process group."""
    tasks = [str(t) for t in cfg.eval.tasks]
    if not tasks:
        return None
    from subnetdp.train import downstream

    if data.tokenizer() is None:
        raise ConfigError("eval.tasks", tasks, f"data.root={cfg.data.root} does not say which tokenizer made its "
                          "tokens (no meta.json)", "prepare the data with `subnetdp prepare-text`, or eval.tasks=[]")

    downstream.set_offline(bool(cfg.eval.offline))
    manager = downstream.task_manager(tasks, [str(cfg.eval.include_path)] if cfg.eval.include_path else [])
    return downstream.load_tasks(manager, tasks)


def _evaluate_tasks(run: Run, union: torch.nn.Module, log: RunLogger, step: int) -> dict[str, float]:
    """lm-eval on the union model, on this rank's device (rank 0 only); scores as ``<task>/<metric>``."""
    from subnetdp.train import downstream

    cfg = run.cfg
    tok = run.data.tokenizer()
    model = union.to(run.comm.device).eval()
    lm = downstream.make_lm(model, tok, run.comm.device, int(run.spec.seq_len) or 2048, int(cfg.eval.task_batch_size))
    limit = float(cfg.eval.task_limit) or None
    if limit is not None and limit >= 1:
        limit = int(limit)
    # The tasks were loaded once at set-up; lm-eval rebuilds their requests at every evaluation.
    results = downstream.run_tasks(lm, run.downstream, limit, cfg.eval.num_fewshot, int(cfg.seed))
    downstream.write_results(run.run_dir, step, results, log)
    union.cpu()
    return downstream.scalars(results)


def _write_start(run: Run, log: RunLogger) -> None:
    """Config, plan and plan figure into the run directory and TensorBoard (rank 0)."""
    if run.rank != 0:
        return
    yaml = config_mod.to_yaml(run.cfg)
    (run.run_dir / "config.yaml").write_text(yaml)
    plan_dict = run.plan.to_dict(run.partition, str(run.cfg.masker.group_by))
    write_json(run.run_dir / "plan.json", plan_dict)
    log.text("config", "```\n" + yaml + "\n```")
    names = [u.name for u in run.partition.units]
    log.figure("plan/ownership", plan_figure(run.plan.as_image(), names, run.plan.owner_counts()))
    log.image("plan/ownership_matrix", run.plan.as_image())
    log.scalars(0, {"plan/spectral_gap": plan_dict["spectral_gap"], "plan/components": plan_dict["components"]})
    for u, k in enumerate(run.plan.owner_counts()):
        log.scalars(u, {"plan/owner_count_by_unit": k})


def _summarise(run: Run, meter: Meter, done: int) -> dict[str, Any]:
    from subnetdp.parallel.apply import local_numel

    bytes_per_step, wire_per_step = meter.bytes_per_step(done)
    step_times, peak = meter.step_times, meter.peak_memory()

    params_held = local_numel(run.model)  # with FSDP: this rank's shards
    with run.parallel.gathered():  # collective when sharded
        digest = tensor_digest(run.model)
    warm = step_times[1:] or step_times  # the first step pays one-off set-up costs
    mine = {"rank": run.rank, "params_held": params_held, "peak_memory_bytes": peak,
            "memory_measured_by": "cuda allocator" if run.comm.device.type == "cuda" else "dispatch tracker (tensors only)",
            "bytes_sent_per_step": bytes_per_step, "wire_bytes_per_step_ring": wire_per_step,
            "step_time_s": sum(warm) / len(warm) if warm else None, "owned_units": run.plan.owned[run.rank],
            "bytes_by_group": bytes_by_group(meter.group_bytes(), max(run.step, 1)),
            "bytes_by_phase": meter.phase_bytes(),
            "params_sha256": digest, **run.parallel.describe(),
            "fsdp_bytes_per_step": dict(run.parallel.fsdp_by_kind),
            "sync": "dense" if run.averager is not None and run.averager.dense else "grouped"}
    # collective: every rank reaches this once, after the last step.
    ranks = run.comm.all_gather_object(mine)
    if not step_times and not peak:  # resumed after the last step: nothing was measured by this job
        for r in ranks:
            r.update(peak_memory_bytes=None, bytes_sent_per_step=None, wire_bytes_per_step_ring=None)
    summary = {"steps": run.step, "world_size": run.comm.world_size, "eval": run.eval_metrics,
               "eval_union": run.eval_union, "grad_alignment": run.alignment,
               "full_model_params": run.partition.shared_numel() + sum(run.partition.unit_numel(u) for u in run.partition.units),
               "num_units": run.plan.num_units, "plan_digest": run.plan.digest(), "spectral_gap": run.plan.spectral_gap(run.partition),
               "ranks": ranks}
    if not step_times and not peak:
        summary["note"] = ("resumed from the checkpoint of the last step: the union model was evaluated again; "
                           "memory, bytes and step time were measured by the job that trained it (metrics.jsonl, "
                           "TensorBoard), not by this one")
    summary["checkpoint"] = _final_checkpoint(run)
    if run.rank == 0:
        write_json(run.run_dir / "summary.json", summary)
        print(format_summary(summary, run.run_dir), flush=True)
    return summary


def _final_checkpoint(run: Run) -> dict[str, Any]:
    """Where the last step's checkpoint went and its size, or why there is none."""
    from subnetdp.train.checkpoints import files as ck
    from subnetdp.train.checkpoints.resume import AUTO_FINAL_MIN_STEPS

    path = ck.step_dir(run.run_dir, run.step)
    if (path / ck.MANIFEST).is_file():
        return {"path": str(path), "bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file())}
    cfg = run.cfg
    if not cfg.checkpoint.enabled:
        why = "checkpoint.enabled=false"
    elif str(cfg.checkpoint.final) == "never":
        why = "checkpoint.final=never"
    else:
        why = (f"a short run (checkpoint.final=auto writes one from {AUTO_FINAL_MIN_STEPS} steps, with "
               "checkpoint.every or resume); set checkpoint.final=always to keep it")
    return {"path": None, "bytes": 0, "why": why}


def format_summary(summary: dict[str, Any], run_dir: Path) -> str:
    lines = [f"\nrun directory: {run_dir}"]
    ckpt = summary.get("checkpoint") or {}
    if ckpt.get("path"):
        lines.append(f"final checkpoint: {ckpt['path']} ({ckpt['bytes'] / 2**20:.1f} MiB)")
    elif ckpt:
        lines.append(f"final checkpoint: none: {ckpt['why']}")
    if summary.get("note"):
        lines.append(f"note: {summary['note']}")
    if summary["eval"]:
        lines.append("union model: " + ", ".join(f"{k} {v:.4f}" for k, v in summary["eval"].items()))
    full = summary["full_model_params"]
    units = summary.get("num_units") or 1
    lines.append(f"{'rank':>4}  {'units':>5}  {'params held':>12}  {'of full':>7}  {'peak memory':>12}  {'bytes sent/step':>15}  {'step time':>9}")
    for r in summary["ranks"]:
        lines.append(f"{r['rank']:>4}  {len(r['owned_units']) / units:>5.0%}  {r['params_held']:>12,}  {r['params_held'] / full:>7.1%}  "
                     + (f"{r['peak_memory_bytes'] / 2**20:>9.1f} MiB  " if r["peak_memory_bytes"] is not None else f"{'n/a':>13}  ")
                     + (f"{r['bytes_sent_per_step'] / 2**20:>11.2f} MiB  " if r["bytes_sent_per_step"] is not None else f"{'n/a':>15}  ")
                     + (f"{r['step_time_s'] * 1000:>6.0f} ms" if r["step_time_s"] is not None else "     n/a"))
    return "\n".join(lines)


def _progress(cfg: DictConfig, rank: int, steps: int) -> Any:
    if rank != 0 or not cfg.train.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=steps, desc="train", unit="step", dynamic_ncols=True)


def _progress_line(bar: Any, record: dict[str, Any]) -> None:
    if bar is None:
        return
    bar.set_postfix(loss=f"{record['train/loss']:.4f}")
    bar.write(f"step {record['step']:>6}  loss {record['train/loss']:.4f}  lr {record['train/lr']:.4g}  "
              f"{record['train/samples_per_s']:.0f} samples/s  {record['train/step_time_s'] * 1000:.0f} ms/step")
