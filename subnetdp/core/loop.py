"""The training loop: set up a rank's subnetwork, train it, evaluate the union model, summarise."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from subnetdp.core import config as config_mod
from subnetdp.core.contracts import (Communicator, DataModule, DataSpec, LaunchEnv, Masker, ModelAdapter,
                                     ParamMap, Partition)
from subnetdp.core.errors import ConfigError, RankMismatchError
from subnetdp.core.metrics import (RunLogger, bytes_by_group, group_label, live_state_bytes,
                                   plan_figure, tensor_digest, training_state_tensors, write_json)
from subnetdp.core.optim import build_optimizer, build_schedule
from subnetdp.core.plan import MaskPlan, make_plan
from subnetdp.core.plugins import PluginManager
from subnetdp.core.resume import Checkpointer
from subnetdp.core.sync import OwnerGroupAverager, clip_to
from subnetdp.core.branches import fold_branch_scales
from subnetdp.core.union import assemble_union, branch_keep_rates, evaluate
from subnetdp.core.variants import is_backward, local_model, partition_model


@dataclass
class Run:
    """Everything a running (or finished) training run holds; handed to lifecycle hooks."""

    cfg: DictConfig
    env: LaunchEnv
    comm: Communicator
    adapter: ModelAdapter
    data: DataModule
    spec: DataSpec
    partition: Partition
    plan: MaskPlan
    model: torch.nn.Module
    pmap: ParamMap
    run_dir: Path
    optimizer: torch.optim.Optimizer | None = None
    averager: OwnerGroupAverager | None = None
    parallel: Any = None  # subnetdp.parallel.apply.Parallelism
    step: int = 0
    eval_metrics: dict[str, float] = field(default_factory=dict)
    eval_union: dict[str, Any] = field(default_factory=dict)  # how the union was evaluated (summary.json)
    alignment: list[dict[str, float]] = field(default_factory=list)  # train.grad_alignment_every
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.env.rank


def set_threads(cfg: DictConfig, env: LaunchEnv) -> int:
    """Torch's intra-op thread count: ``launch.threads_per_rank``, or the cores shared evenly."""
    n = int(cfg.launch.threads_per_rank) or max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    torch.set_num_threads(n)
    return n


def _build_plan(cfg: DictConfig, world_size: int, pm: PluginManager) -> tuple[DataModule, DataSpec, ModelAdapter, torch.nn.Module, Partition, MaskPlan]:
    """Data spec, full model, partition and validated plan: all without a process group."""
    regs = pm.registries
    data: DataModule = regs["data"].create(cfg.data.name, cfg.data, seed=int(cfg.seed))
    data.check()
    spec = data.spec()
    adapter: ModelAdapter = regs["model"].create(cfg.model.name, cfg.model)
    masker: Masker = regs["masker"].create(cfg.masker.name, cfg.masker)
    replicas = config_mod.check_world(cfg, world_size)  # fsdp.shard_size must divide the world
    # Every rank builds the same full model on CPU from the seed, then keeps only its subnetwork.
    torch.manual_seed(int(cfg.seed))
    full = adapter.build(spec)
    partition = partition_model(adapter, full, cfg.masker, spec)
    # With FSDP the plan is made over the replicas; the S ranks of a replica own the same units.
    plan = make_plan(masker, partition, replicas, int(cfg.seed), int(cfg.masker.min_owners))
    return data, spec, adapter, full, partition, plan.replicated(int(cfg.fsdp.shard_size))


def preflight(cfg: DictConfig, world_size: int, pm: PluginManager) -> MaskPlan:
    """Validate the communicator, data and plan for ``world_size`` ranks before any worker is started."""
    pm.registries["comm"].get(cfg.comm.name).check_world_size(world_size)
    return _build_plan(cfg, world_size, pm)[-1]


def setup(cfg: DictConfig, env: LaunchEnv, pm: PluginManager) -> Run:
    """Build everything a rank needs. Bad input fails before the process group exists."""
    comm: Communicator = pm.registries["comm"].create(cfg.comm.name, cfg.comm, env)
    comm.check_environment()
    if cfg.train.device == "cuda" and comm.device.type != "cuda":
        raise ConfigError("train.device", "cuda", f"comm.name={cfg.comm.name} computes on {comm.device.type}",
                          "use comm.name=nccl for GPUs")
    data, spec, adapter, full, partition, plan = _build_plan(cfg, env.world_size, pm)
    if cfg.train.compile:
        from subnetdp.parallel.compile import require_compilable

        require_compilable(comm.device, str(cfg.train.compile_backend))

    comm.init()  # collective: the first point where every rank meets.
    check_ranks_agree(comm, plan, cfg, pm)
    run_dir = resolve_run_dir(cfg, comm)
    model, pmap = local_model(adapter, full, plan.owned[env.rank], partition, cfg.masker)
    del full  # forward masking: frees the tensors of units this rank does not own
    model.to(comm.device)
    run = Run(cfg, env, comm, adapter, data, spec, partition, plan, model, pmap, run_dir)
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


def _to_device(batch: Any, device: torch.device) -> Any:
    return tuple(t.to(device, non_blocking=True) for t in batch) if device.type != "cpu" else batch


def _peak_memory(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def train(cfg: DictConfig, env: LaunchEnv | None = None, pm: PluginManager | None = None) -> Run:
    """Run one training job on this rank; returns the finished :class:`Run`."""
    from subnetdp.launchers import detect

    env = env or detect()
    pm = pm or PluginManager()
    set_threads(cfg, env)
    run = setup(cfg, env, pm)
    try:
        _train(run, pm)
    finally:
        run.comm.shutdown()
    return run


def _train(run: Run, pm: PluginManager) -> None:
    cfg, comm, model, adapter = run.cfg, run.comm, run.model, run.adapter
    rank, device, steps = run.rank, comm.device, int(cfg.train.steps)
    run.optimizer = optimizer = build_optimizer(cfg.optim, model.parameters())
    scheduler = build_schedule(cfg.optim, optimizer, steps)
    run.averager = averager = run.parallel.averager()  # collective: owner groups are created here
    refresher = _refresher(run)
    resampler = _resampler(run)
    log = RunLogger(run.run_dir, rank, bool(cfg.run.tensorboard))
    _write_start(run, log)
    loader = run.data.train_loader(rank, comm.world_size, int(cfg.train.batch_size))
    ckpt = Checkpointer(run, optimizer, scheduler, loader)
    first = ckpt.start() + 1  # collective: resumes from a checkpoint when cfg.resume asks for one
    run.step = first - 1
    batches = iter(loader)
    accum = int(cfg.train.grad_accum)
    samples_per_step = comm.world_size * int(cfg.train.batch_size) * accum
    pm.hook.subnetdp_on_run_start(run=run)
    bar = _progress(cfg, rank, steps)
    loss_sum, loss_n, step_times, sync_bytes, wire = 0.0, 0, [], 0, 0.0
    group_bytes: dict[tuple[int, ...], int] = {}  # payload per owner group, summed over steps
    peak_cpu = 0
    model.train()
    for step in range(first, steps + 1):
        probe = step == min(max(int(cfg.train.memory_step), first), steps)  # the step that is measured
        measure = device.type == "cpu" and probe
        t0 = time.perf_counter()
        averager.prepare()  # drops the last step's gradients: before the memory baseline is taken
        tracker = (run.parallel.memory_tracker(live_state_bytes(training_state_tensors(model, optimizer,
                                                                                      averager.state_tensors())))
                   if measure else contextlib.nullcontext())
        with tracker, run.parallel.counting(probe):  # FSDP's all-gathers and reduce-scatters, when sharded
            before, before_wire = comm.bytes.total(), comm.bytes.ring_estimate()
            before_groups = dict(comm.bytes.by_group)
            step_loss = torch.zeros((), device=device)
            align = _probe_due(cfg, step, measure)
            step_batches = []
            for micro in range(accum):
                batch = _to_device(next(batches), device)
                if align:
                    step_batches.append(batch)
                with averager.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                    with run.parallel.autocast():
                        loss = adapter.loss(model(adapter.inputs(batch)), batch) / accum
                    step_loss += loss.detach()
                    if micro == accum - 1:  # the inf/NaN check of the loss travels with the gradients
                        ckpt.carry_loss_check(averager, step_loss)
                    loss.backward()
            averager.finish()  # collective: owner groups average this step's gradients
            sync_bytes += comm.bytes.total() - before
            wire += comm.bytes.ring_estimate() - before_wire
            for g, n in comm.bytes.by_group.items():
                group_bytes[g] = group_bytes.get(g, 0) + n - before_groups.get(g, 0)
            if align:  # collective: every rank reaches the probe on the same steps
                t0 += _align(run, log, step, step_batches)  # neither its time nor its bytes are the step's
            log_step = step % int(cfg.train.log_every) == 0 or step == steps
            clip = float(cfg.optim.clip_grad_norm)
            # collective below C = 1: every rank learns whether any rank saw inf/NaN (train.on_nonfinite),
            # in the gradient-norm all-reduce when clipping or logging needs the norm.
            finite, grad_norm = ckpt.finite(step, step_loss, averager, need_norm=clip > 0 or log_step)
            if finite:
                clip_to(averager, grad_norm, clip)
                optimizer.step()
            scheduler.step()
            if refresher is not None and refresher.due(step):
                sent = refresher.refresh()  # collective: owners' new values reach every rank
                sync_bytes, wire = sync_bytes + sent, wire + sent
            if resampler is not None and resampler.due(step) and step < steps:
                # collective: every rank re-draws the same plan and receives the pieces it gains.
                model, optimizer, scheduler, averager, refresher = _redraw(run, resampler, step, steps)
                ckpt.optimizer, ckpt.scheduler = optimizer, scheduler  # later checkpoints save the new state
        elapsed = time.perf_counter() - t0
        if measure or (probe and run.parallel.sharded):
            peak_cpu = tracker.peak if measure else 0  # measuring slows this step down: keep it out of the timings
        else:
            step_times.append(elapsed)
        loss_sum += float(step_loss)
        loss_n += 1
        run.step = step
        metrics = {"loss": float(step_loss), "lr": optimizer.param_groups[0]["lr"], "step_time": elapsed}
        log.scalars(step, {"rank/loss": metrics["loss"], "rank/step_time_s": elapsed}, per_rank=True)
        if log_step:
            # collective: every rank reaches this on log steps to average the loss over the world.
            mean = torch.tensor([loss_sum, float(loss_n)], dtype=torch.float64, device=device)
            comm.all_reduce(mean, comm.world).wait()
            train_loss = float(mean[0] / mean[1])
            loss_sum, loss_n = 0.0, 0
            window = step_times[-int(cfg.train.log_every):] or [elapsed]
            step_time = sum(window) / len(window)
            record = {"step": step, "train/loss": train_loss, "train/lr": metrics["lr"],
                      "train/grad_norm": grad_norm, "train/step_time_s": step_time,
                      "train/samples_per_s": samples_per_step / step_time}
            if run.spec.seq_len:  # language models: tokens per second over all ranks
                record["train/tokens_per_s"] = record["train/samples_per_s"] * run.spec.seq_len
            log.scalars(step, {k: v for k, v in record.items() if k != "step"})
            log.jsonl(record)
            par = run.parallel  # FSDP's own all-gathers and reduce-scatters count too
            log.scalars(step, {"rank/bytes_sent_per_step": sync_bytes / (step - first + 1) + par.fsdp_bytes,
                               "rank/wire_bytes_per_step": wire / (step - first + 1) + par.fsdp_wire,
                               "rank/peak_memory_bytes": peak_cpu or _peak_memory(device)}, per_rank=True)
            log.scalars(step, {f"rank/bytes_by_group/{group_label(g)}": n / (step - first + 1) for g, n in group_bytes.items()},
                        per_rank=True)
            _progress_line(bar, record)
        eval_every = int(cfg.eval.every)
        if step == steps or (eval_every and step % eval_every == 0):
            run.eval_metrics = _evaluate(run, log, step)
            pm.hook.subnetdp_on_eval_end(run=run, step=step, metrics=run.eval_metrics)
        pm.hook.subnetdp_on_step_end(run=run, step=step, metrics=metrics)
        ckpt.after_step(step)  # collective on save steps: checkpoint.every and the last step
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    done = max(1, steps - first + 1)
    par = run.parallel  # FSDP's own traffic, measured on one step, is added to every step's
    run.summary = _summarise(run, step_times, sync_bytes / done + par.fsdp_bytes, wire / done + par.fsdp_wire,
                             peak_cpu or _peak_memory(device), group_bytes)
    log.close()
    pm.hook.subnetdp_on_run_end(run=run)


def _refresher(run: Run) -> Any:
    """Backward masking: the broadcaster of owners' values (None for forward masking)."""
    if not is_backward(run.cfg.masker):
        return None
    from subnetdp.core.backward import Refresher

    return Refresher(run.model, run.pmap, run.plan, run.partition, run.comm,
                     int(run.cfg.masker.refresh_every), float(run.cfg.sync.bucket_cap_mb))


def _resampler(run: Run) -> Any:
    """``masker.resample_every > 0``: the plan re-drawer (None for a fixed plan)."""
    every = int(getattr(run.cfg.masker, "resample_every", 0) or 0)
    if every <= 0:
        return None
    from subnetdp.core.resample import Resampler

    return Resampler(run.adapter, run.spec, int(run.cfg.seed), run.partition, run.plan, run.cfg.masker,
                     run.comm, every)


def _redraw(run: Run, resampler: Any, step: int, steps: int) -> tuple:
    """Switch to the next plan of the family: new model, fresh optimizer state, same schedule."""
    import warnings

    run.averager.remove_hooks()
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
    return run.model, run.optimizer, scheduler, run.averager, _refresher(run)


def _probe_due(cfg: DictConfig, step: int, measured: bool) -> bool:
    """``train.grad_alignment_every``: probe on its multiples, but not on the memory-measured step."""
    every = int(cfg.train.grad_alignment_every)
    return bool(every) and step % every == 0 and not measured


def _align(run: Run, log: RunLogger, step: int, batches: list) -> float:
    """Run the gradient-alignment probe; log it on rank 0. Collective. Returns its duration."""
    from subnetdp.core.alignment import gradient_alignment

    t0 = time.perf_counter()
    saved = dict(run.comm.bytes.by_group)
    result = gradient_alignment(run.adapter, run.spec, int(run.cfg.seed), run.partition, run.plan, run.model,
                                run.pmap, run.comm, batches)
    run.comm.bytes.by_group = saved  # the probe's traffic is not a training step's
    if result is not None:
        run.alignment.append({"step": step, **result})
        log.scalars(step, {f"probe/grad_{k}": v for k, v in result.items()})
        log.jsonl({"step": step, **{f"probe/grad_{k}": v for k, v in result.items()}})
    return time.perf_counter() - t0


def _evaluate(run: Run, log: RunLogger, step: int) -> dict[str, float]:
    """Assemble the union model on rank 0 and evaluate it there. Collective.

    Block-level forward masking with ``eval.block_union=rescaled``: every residual branch is scaled
    by its training keep rate first. With ``eval.breakdown``, the last evaluation also reports the
    union at x1 and rescaled and every rank's own subnetwork, on the same validation batches.
    """
    cfg = run.cfg
    saved = dict(run.comm.bytes.by_group)
    block_forward = run.partition.granularity == "block" and not is_backward(cfg.masker)
    breakdown = bool(cfg.eval.breakdown) and block_forward and step == int(cfg.train.steps) and not run.parallel.sharded
    own = _own_subnetworks(run) if breakdown else None  # collective: every rank evaluates its own
    with run.parallel.gathered():  # collective when sharded: full parameters for the assembly
        union = assemble_union(run.adapter, run.spec, int(cfg.seed), run.partition, run.plan,
                               run.model, run.pmap, run.comm)
    run.comm.bytes.by_group = saved  # evaluation traffic is not a training step's
    if union is None:
        return {}
    rates = branch_keep_rates(run.partition, run.plan) if block_forward else {}
    mode = str(cfg.eval.block_union)
    run.eval_union = {"block_union": mode, "rescaled": bool(rates) and mode == "rescaled",
                      "branch_keep_rates": rates}
    if breakdown:
        x1 = evaluate(union, run.adapter, run.data, cfg)
        fold_branch_scales(run.adapter.branch_output_layers(union), rates)
        rescaled = evaluate(union, run.adapter, run.data, cfg)
        metrics = rescaled if mode == "rescaled" else x1
        run.eval_union.update({"step": step, "union_x1": x1, "union_rescaled": rescaled, "own_subnetworks": own})
        log.jsonl({"step": step, "eval_union": run.eval_union})
    else:
        if run.eval_union["rescaled"]:
            fold_branch_scales(run.adapter.branch_output_layers(union), rates)
        metrics = evaluate(union, run.adapter, run.data, cfg)
    log.scalars(step, {f"eval/{k}": v for k, v in metrics.items()})
    log.jsonl({"step": step, **{f"eval/{k}": v for k, v in metrics.items()}})
    return metrics


def _own_subnetworks(run: Run) -> list[dict[str, Any]]:
    """Every rank's own subnetwork, evaluated on the validation batches. Collective."""
    import copy

    mine = {"rank": run.rank, "owned": run.plan.owned[run.rank],
            "metrics": evaluate(copy.deepcopy(run.model), run.adapter, run.data, run.cfg)}
    run.model.train()
    # collective: every rank reaches this at the last evaluation.
    return run.comm.all_gather_object(mine)


def _write_start(run: Run, log: RunLogger) -> None:
    """Config, plan and plan figure into the run directory and TensorBoard (rank 0)."""
    if run.rank != 0:
        return
    yaml = config_mod.to_yaml(run.cfg)
    (run.run_dir / "config.yaml").write_text(yaml)
    plan_dict = run.plan.to_dict(run.partition, str(run.cfg.masker.get("group_by", "auto")))
    write_json(run.run_dir / "plan.json", plan_dict)
    log.text("config", "```\n" + yaml + "\n```")
    names = [u.name for u in run.partition.units]
    log.figure("plan/ownership", plan_figure(run.plan.as_image(), names, run.plan.owner_counts()))
    log.image("plan/ownership_matrix", run.plan.as_image())
    log.scalars(0, {"plan/spectral_gap": plan_dict["spectral_gap"], "plan/components": plan_dict["components"]})
    for u, k in enumerate(run.plan.owner_counts()):
        log.scalars(u, {"plan/owner_count_by_unit": k})


def _summarise(run: Run, step_times: list[float], bytes_per_step: float, wire_per_step: float,
               peak: int, group_bytes: dict[tuple[int, ...], int] | None = None) -> dict[str, Any]:
    from subnetdp.parallel.apply import local_numel

    params_held = local_numel(run.model)  # with FSDP: this rank's shards
    with run.parallel.gathered():  # collective when sharded
        digest = tensor_digest(run.model)
    warm = step_times[1:] or step_times  # the first step pays one-off set-up costs
    mine = {"rank": run.rank, "params_held": params_held, "peak_memory_bytes": peak,
            "memory_measured_by": "cuda allocator" if run.comm.device.type == "cuda" else "dispatch tracker (tensors only)",
            "bytes_sent_per_step": bytes_per_step, "wire_bytes_per_step_ring": wire_per_step,
            "step_time_s": sum(warm) / len(warm) if warm else None, "owned_units": run.plan.owned[run.rank],
            "bytes_by_group": bytes_by_group(group_bytes or {}, max(run.step, 1)),
            "params_sha256": digest, **run.parallel.describe(),
            "fsdp_bytes_per_step": dict(run.parallel.fsdp_by_kind),
            "sync": "dense" if run.averager is not None and run.averager.dense else "grouped"}
    # collective: every rank reaches this once, after the last step.
    ranks = run.comm.all_gather_object(mine)
    summary = {"steps": run.step, "world_size": run.comm.world_size, "eval": run.eval_metrics,
               "eval_union": run.eval_union, "grad_alignment": run.alignment,
               "full_model_params": run.partition.shared_numel() + sum(run.partition.unit_numel(u) for u in run.partition.units),
               "plan_digest": run.plan.digest(), "spectral_gap": run.plan.spectral_gap(run.partition),
               "ranks": ranks}
    if run.rank == 0:
        write_json(run.run_dir / "summary.json", summary)
        print(format_summary(summary, run.run_dir), flush=True)
    return summary


def format_summary(summary: dict[str, Any], run_dir: Path) -> str:
    lines = [f"\nrun directory: {run_dir}"]
    if summary["eval"]:
        lines.append("union model: " + ", ".join(f"{k} {v:.4f}" for k, v in summary["eval"].items()))
    full = summary["full_model_params"]
    lines.append(f"{'rank':>4}  {'params held':>12}  {'of full':>7}  {'peak memory':>12}  {'bytes sent/step':>15}  {'step time':>9}")
    for r in summary["ranks"]:
        lines.append(f"{r['rank']:>4}  {r['params_held']:>12,}  {r['params_held'] / full:>7.1%}  "
                     f"{r['peak_memory_bytes'] / 2**20:>9.1f} MiB  {r['bytes_sent_per_step'] / 2**20:>11.2f} MiB  "
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
