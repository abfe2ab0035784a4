"""What a run shows: progress, log lines, TensorBoard, ``metrics.jsonl`` and the summary.

Reporting is a built-in plugin on the lifecycle hooks, as pytest's terminal reporter is a plugin of
pytest: :class:`Reporter` is registered on the run's plugin manager for the run's duration
(:func:`reporting`) and implements ``subnetdp_on_run_start``, ``subnetdp_on_step_end``,
``subnetdp_on_eval_end`` and ``subnetdp_on_run_end``. The loop only measures (:class:`~subnetdp.train.meter.Meter`)
and computes the summary (:func:`summarise`, one all-gather); the reporter writes them.

Rank 0 writes the global series (``RUN_DIR/tensorboard``, ``metrics.jsonl``); every rank writes the
values that differ by rank under ``RUN_DIR/tensorboard/rank_{r}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from subnetdp.core import config as config_mod
from subnetdp.core.contracts import RunContext, RunResult
from subnetdp.core.hookspecs import hookimpl
from subnetdp.train.checkpoints.unlogged import last_logged
from subnetdp.train.failures import stamp
from subnetdp.train.meter import Meter, bytes_by_group, tensor_digest
from subnetdp.train.picture import plan_picture
from subnetdp.train.runlog import RunLogger

if TYPE_CHECKING:
    from subnetdp.train.checkpoints.checkpointer import Checkpointer
    from subnetdp.train.evaluation import Evaluation
    from subnetdp.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class Counted:
    """What the reporter and meter of a re-formed world (a death, a join) take over from the world
    before, on every rank (whichever becomes rank 0 writes the log). Empty for a newcomer.

    ``consumed``: (step, samples or tokens seen, FLOPs) at the last finished step; ``groups``: payload
    bytes and steps by owner group in worker ids (:meth:`Meter.worker_group_bytes`); ``world_size``: the
    world before's; ``peaks``: the tensor peaks this rank measured, by what it held (``Meter.measured``).
    (Each rank's losses no row holds yet are its checkpointer's, which the next adopts.)
    """

    consumed: tuple[int, float, float] | None = None
    groups: Any = None
    world_size: int = 0
    peaks: Any = None  # the tensor peaks this rank measured, by what it held (Meter.measured)


class Reporter:
    """The built-in reporting plugin of one run (registered by :func:`reporting`).

    It holds what reporting needs between hooks: the logger, the progress bar (rank 0), this rank's
    losses since the last log step and the lines of an evaluation, which it writes after its step's
    own line. The meter (step time, memory, bytes) is given to it.

    Collective: on log steps (``train.log_every`` and the last step) every rank's reporter adds up the
    world's losses in ``subnetdp_on_step_end``; every rank calls the hook on the same steps.
    """

    def __init__(self, ctx: RunContext, meter: Meter) -> None:
        cfg = ctx.cfg
        self.meter = meter
        self.steps, self.log_every = ctx.steps, ctx.settings.train.log_every
        self.log = RunLogger(ctx.run_dir, ctx.rank, cfg.run.tensorboard)
        self.bar: Any = None
        self.losses: list[float] = []  # this rank's losses since the last log step
        self.held: list[Callable[[], None]] = []  # an evaluation's lines: written after its step's line
        self.recovered: dict[str, Any] | None = None  # the next row's mean holds survivors' carried losses
        self.logged_peak = 0
        # What a step consumes over all ranks: samples (tokens for language models) and training FLOPs.
        samples = ctx.world_size * cfg.train.batch_size * cfg.train.grad_accum
        self.seen_unit = "tokens" if ctx.spec.seq_len else "samples"
        self.seen_per_step = samples * (ctx.spec.seq_len or 1)
        self.flops_per_step = ctx.step_flops
        # What was consumed by the step before the first: zeros for a new run; a resume's checkpoint or the
        # world before a re-formation says (carry_over, take_over), else the log's last row, read when first
        # needed (not in a re-formation's pause). Every rank counts: any may be rank 0 after a death.
        self._base: tuple[int, float, float] | None = None if meter.first > 1 else (0, 0.0, 0.0)
        self._log_before = (ctx.run_dir / "metrics.jsonl", meter.first - 1)

    @hookimpl(tryfirst=True)
    def subnetdp_on_run_start(self, context: RunContext, state: "TrainState") -> None:
        write_start(context, state, self.log)
        plan, r = state.plan, context.rank
        units = max(1, plan.num_units)
        # A scalar per rank (one curve per rank_N run), so coverages show as numbers, not only in the plan's image.
        self.log.scalars(0, {"rank/coverage": len(plan.owned[r]) / units}, per_rank=True)
        match = context.flop_match
        if match is not None and r == 0:
            print(f"train.flop_matched: {match['steps_requested']} -> {match['steps']} steps (the plan trains "
                  f"{match['train_flop_ratio']:.3f} x the full model's FLOPs a step)", flush=True)
        if context.rank == 0 and show_bar(context.cfg.train.progress):
            from tqdm import tqdm

            self.bar = tqdm(total=self.steps, desc="train", unit="step", dynamic_ncols=True)

    @hookimpl(tryfirst=True)
    def subnetdp_on_step_end(self, context: RunContext, state: "TrainState", step: int, metrics: dict[str, Any]) -> None:
        self.losses.append(metrics["loss"])
        probe = {k: v for k, v in metrics.items() if k.startswith("probe/")}
        if probe:
            self.log.scalars(step, probe)
            self.log.jsonl({"step": step, **probe})
        self.log.scalars(step, {"rank/loss": metrics["loss"], "rank/step_time_s": metrics["step_time"]}, per_rank=True)
        peak = self.meter.step_peak
        if peak and peak != self.logged_peak:  # at the step that measured it (CPU), or when the CUDA peak grows
            self.log.scalars(step, {"rank/peak_memory_bytes": peak}, per_rank=True)
            self.logged_peak = peak
        if self._logs(step):
            self._log_step(context, state, step, metrics.get("grad_norm"))  # collective: the world's mean loss
            self.losses = []
        self._write_held()
        if self.bar is not None:
            self.bar.update(1)

    def _log_step(self, ctx: RunContext, state: "TrainState", step: int, grad_norm: float | None) -> None:
        """The world's mean loss since the last log step, throughput and this rank's figures. Collective."""
        comm, cfg = ctx.comm, ctx.cfg
        mean = torch.tensor([sum(self.losses), float(len(self.losses))], dtype=torch.float64, device=comm.device)
        with comm.bytes.phase("log"):
            comm.all_reduce(mean, comm.world).wait()  # collective: every rank's reporter reaches this on log steps
        step_time = self.meter.mean_step_time(self.log_every)
        samples_per_step = comm.world_size * cfg.train.batch_size * cfg.train.grad_accum
        record = {"step": step, "train/loss": float(mean[0] / mean[1]),
                  "train/lr": state.optimizer.param_groups[0]["lr"], "train/grad_norm": grad_norm,
                  "train/step_time_s": step_time, "train/samples_per_s": samples_per_step / step_time}
        if ctx.spec.seq_len:  # language models: tokens per second over all ranks
            record["train/tokens_per_s"] = record["train/samples_per_s"] * ctx.spec.seq_len
        record.update(self.consumed(step))
        self.log.scalars(step, {k: v for k, v in record.items() if k != "step"})
        if self.recovered is not None:  # rank 0 only: the survivors' losses of steps before the resume
            record["recovered"], self.recovered = self.recovered, None
        self.log.jsonl(record)
        self.by_consumed(step, {"train_loss": record["train/loss"]})
        self.log.scalars(step, {k: v for k, v in self.meter.rank_scalars(step).items() if k != "rank/peak_memory_bytes"},
                         per_rank=True)  # the peak has its own steps (subnetdp_on_step_end)
        self.log.scalars(step, state.synchronizer.log_figures(), per_rank=True)
        line = (f"step {step:>6}  loss {record['train/loss']:.4f}  lr {record['train/lr']:.4g}  "
                f"{record['train/samples_per_s']:.0f} samples/s  {step_time * 1000:.0f} ms/step")
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['train/loss']:.4f}")
            self.bar.write(line)
        elif ctx.rank == 0:  # no bar (a pipe, a file, a batch job, or train.progress=false): plain lines,
            print(f"{stamp()} {line}", flush=True)  # timestamped, so a job's log says when each step ended

    @property
    def base(self) -> tuple[int, float, float]:
        """(step, samples or tokens seen, FLOPs) that :meth:`consumed` counts on from."""
        if self._base is None:
            self._base = consumed_before(*self._log_before)
        return self._base

    @base.setter
    def base(self, counts: tuple[int, float, float]) -> None:
        self._base = counts

    def carry_over(self, ctx: RunContext, state: "TrainState", ckpt: "Checkpointer") -> None:
        """What a resumed run's log goes on from. Every checkpoint records what the run had consumed by
        its step (``ckpt.consumed``), and a run resumed from one counts on from there (a resume in another
        run directory, or at another world size, has no row of the steps before to read it from).
        Rank 0 of a run resumed from survivors' files: the losses its log owes
        (:mod:`subnetdp.train.checkpoints.unlogged`). A log step gets its row now, marked
        ``"recovered"`` with the ranks whose losses it averages; otherwise they join the next row's mean
        (marked the same way: the dead ranks' losses of those steps are gone)."""
        ckpt.consumed = self.counts
        if ckpt.resumed is not None:
            from subnetdp.train.checkpoints.files import read_manifest

            counts = read_manifest(ckpt.resumed).get("consumed")
            if counts is not None:  # checkpoints of earlier releases lack it: the log's last row then
                self.base = (int(counts[0]), float(counts[1]), float(counts[2]))
        carried = ckpt.carried
        if carried is None:
            return
        step, ranks = carried.step, carried.ranks
        mark = {"ranks": ranks, "world_size": carried.world_size, "steps": sorted({s for _, s, _ in carried.entries})}
        if not self._logs(step):
            self.losses.extend(carried.losses)  # the next log row's all-reduce adds them to the world's
            self.recovered = mark  # ...which says that these steps' mean lacks the dead ranks' losses
            return
        record = {"step": step, "train/loss": sum(carried.losses) / len(carried.losses),
                  "train/lr": state.optimizer.param_groups[0]["lr"], **self.consumed(step), "recovered": mark}
        self.log.scalars(step, {"train/loss": record["train/loss"], "train/lr": record["train/lr"]})
        self.log.jsonl(record)
        self.by_consumed(step, {"train_loss": record["train/loss"]})
        line = (f"step {step:>6}  loss {record['train/loss']:.4f}  lr {record['train/lr']:.4g}  (recovered: the "
                f"losses of ranks {ranks} of {carried.world_size}, kept by the survivors)")
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(f"{stamp()} {line}", flush=True)

    def counts(self, step: int) -> list[float]:
        """``[step, samples or tokens seen, FLOPs]`` by ``step`` (a checkpoint records them)."""
        since, seen, flops = self.base
        return [step, seen + (step - since) * self.seen_per_step, flops + (step - since) * (self.flops_per_step or 0.0)]

    def counted(self, ctx: RunContext, step: int) -> Counted:
        """What the next world's reporter and meter take over when the world re-forms after ``step``."""
        step_, seen, flops = self.counts(step)
        return Counted((int(step_), seen, flops), self.meter.worker_group_bytes(finished=True), ctx.world_size,
                       self.meter.measured)

    def said(self, was: Counted, ckpt: "Checkpointer", state: "TrainState") -> tuple[Any, list[float]]:
        """What this rank tells every rank of the next world (:meth:`take_over`): what the world before had
        consumed, and, when the step the world re-forms after is a log step, its losses no row holds."""
        return self._said(was, ckpt.unlogged.upto(state.step, state.progress), self._logs(state.step))

    @staticmethod
    def _said(was: Counted, owed: dict[int, float], log_step: bool) -> tuple[Any, list[float]]:
        return was.consumed, list(owed.values()) if log_step else []

    def _logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps

    def take_over(self, ctx: RunContext, state: "TrainState", was: Counted, ckpt: "Checkpointer",
                  said: list[Any] | None = None) -> None:
        """Go on from the world before (``was``: its :meth:`counted`; every member and a newcomer call
        this at the first step boundary of the new world). Its counts of what was consumed (the members',
        which a newcomer adopts: every checkpoint and survivor's file records them, and the survivors'
        files of one step must agree) and its bytes by group go on. This rank's losses no row holds (its
        checkpointer's, kept since the last row, the step the world re-formed after among them even when
        the death came before the reporter heard of it) join the next row; when that step is a log step
        whose row is not in the log (a death between the update and the row), the survivors write it
        now from them, marked ``"recovered"`` (the dead ranks' are gone). Collective: one gather, unless
        ``said`` holds what every rank said (:meth:`said`; a join's heal carried it)."""
        step, comm = state.step, ctx.comm
        self.meter.take_over(was.groups)
        owed = ckpt.unlogged.upto(step, state.progress)
        log_step = self._logs(step)
        theirs = said
        if theirs is None:
            with comm.bytes.phase("log"):
                theirs = comm.all_gather_object(self._said(was, owed, log_step))  # collective: every rank of the new world
        counts = next((c for c, _ in theirs if c is not None), None)
        if counts is not None:
            self.base = (int(counts[0]), float(counts[1]), float(counts[2]))
        if not log_step:
            for s, loss in owed.items():  # the step in progress's too, should another death come before the row
                ckpt.unlogged.note(s, loss)
            self.losses[:0] = list(owed.values())  # they join the next row's mean
            return
        ckpt.mark_logged(step)  # the row holds every survivor's losses of it, written before or now
        losses = [loss for _, mine in theirs for loss in mine]
        # Only rank 0 writes, and its log says whether the row is there (rank 0 of the world before may
        # have died after writing it).
        if ctx.rank == 0 and losses and last_logged(ctx.run_dir / "metrics.jsonl", step) < step:
            mark = {"ranks": list(self.meter.workers), "world_size": was.world_size, "steps": sorted(owed)}
            record = {"step": step, "train/loss": sum(losses) / len(losses),
                      "train/lr": state.optimizer.param_groups[0]["lr"], **self.consumed(step), "recovered": mark}
            self.log.scalars(step, {"train/loss": record["train/loss"], "train/lr": record["train/lr"]})
            self.log.jsonl(record)
            self.by_consumed(step, {"train_loss": record["train/loss"]})

    def consumed(self, step: int) -> dict[str, float]:
        """What the world has consumed after ``step`` steps: ``train/{tokens,samples}_seen``, ``train/flops``
        (from the last counts logged before a resume, or handed over by the world before a re-formation,
        at this world's and plan's rate since)."""
        since, seen, flops = self.base
        out = {f"train/{self.seen_unit}_seen": seen + (step - since) * self.seen_per_step}
        if self.flops_per_step is not None:
            out["train/flops"] = flops + (step - since) * self.flops_per_step
        return out

    def by_consumed(self, step: int, values: dict[str, float]) -> None:
        """``values`` again with tokens (samples) seen and training MFLOPs as the step axis, so runs of
        different coverages, or FLOP-matched against DDP, overlay on one x-axis (TensorBoard's steps
        are integers: FLOPs in millions keep a 1B model's whole run within int64)."""
        used = self.consumed(step)
        self.log.scalars(round(used[f"train/{self.seen_unit}_seen"]), {f"by_{self.seen_unit}/{k}": v for k, v in values.items()})
        if "train/flops" in used:
            self.log.scalars(round(used["train/flops"] / 1e6), {f"by_mflops/{k}": v for k, v in values.items()})

    @hookimpl(tryfirst=True)
    def subnetdp_on_eval_end(self, context: RunContext, step: int, metrics: dict[str, float], union: dict[str, Any],
                             tasks: dict[str, float]) -> None:
        own = {k: v for k, v in metrics.items() if k not in tasks}  # the union model's metrics

        def write() -> None:
            if "step" in union:  # eval.breakdown: the union at x1 and rescaled, every rank's own subnetwork
                self.log.jsonl({"step": step, "eval_union": union})
            if step < self.steps and context.rank == 0:  # the final evaluation is in the summary
                from tqdm import tqdm

                when = "" if self.bar is not None else f"{stamp()} "  # a plain log line carries its time
                tqdm.write(f"{when}eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in own.items()))
            self.log.scalars(step, {f"eval/{k}": v for k, v in own.items()})
            self.by_consumed(step, {f"eval_{k}": v for k, v in own.items()})
            self.log.jsonl({"step": step, **{f"eval/{k}": v for k, v in own.items()}})
            if tasks:
                scores = {f"lm_eval/{k}": v for k, v in tasks.items()}
                self.log.scalars(step, scores)
                self.log.jsonl({"step": step, **scores})
        self.held.append(write)

    @hookimpl(tryfirst=True)
    def subnetdp_on_run_end(self, context: RunContext, result: RunResult) -> None:
        """Writes ``summary.json`` and prints the summary table (rank 0), before other plugins hear of the end."""
        self._write_held()
        if self.bar is not None:
            self.bar.close()
        if context.rank == 0:
            write_json(context.run_dir / "summary.json", result.summary)
            print(format_summary(result.summary, context.run_dir), flush=True)
        self.close()

    def _write_held(self) -> None:
        for write in self.held:
            write()
        self.held = []

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.log.close()


@contextlib.contextmanager
def reporting(ctx: RunContext, meter: Meter) -> Iterator[Reporter]:
    """The run's :class:`Reporter`, registered on its plugin manager inside the block."""
    reporter = Reporter(ctx, meter)
    ctx.plugins.register(reporter, "subnetdp-reporter")
    try:
        yield reporter
    finally:
        reporter.close()
        ctx.plugins.unregister(reporter)


def consumed_before(metrics: Path, step: int) -> tuple[int, float, float]:
    """The last counts of consumption ``metrics.jsonl`` logged at or before ``step``: (step, tokens or
    samples seen, training FLOPs); zeros for a new run. Lines past ``step`` (logged after the
    checkpoint a run resumes from) are not counted."""
    best = (0, 0.0, 0.0)
    if step < 1 or not metrics.is_file():
        return best
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        seen = [v for k, v in record.items() if k in ("train/tokens_seen", "train/samples_seen")]
        at = record.get("step")
        if seen and isinstance(at, int) and at <= step:
            best = (at, float(seen[0]), float(record.get("train/flops") or 0.0))
    return best


def show_bar(progress: bool | None) -> bool:
    """``train.progress``: null (the default) shows the bar only when stderr (where tqdm writes) is a
    terminal, so piped and batch-job logs get whole lines instead of carriage-return updates."""
    return sys.stderr.isatty() if progress is None else bool(progress)


_DRAWN: set[tuple[str, str]] = set()  # (run dir, plan digest) of each figure this process drew (0.2-0.3 s each)


def write_start(ctx: RunContext, state: "TrainState", log: RunLogger) -> None:
    """Config, plan and plan figure into the run directory and TensorBoard (rank 0)."""
    if ctx.rank != 0:
        return
    plan, partition = state.plan, state.partition
    yaml = config_mod.to_yaml(ctx.cfg)
    (ctx.run_dir / "config.yaml").write_text(yaml)
    plan_dict = plan.to_dict(partition, ctx.settings.masker.group_by)
    write_json(ctx.run_dir / "plan.json", plan_dict)
    log.text("config", "```\n" + yaml + "\n```")
    names = [u.name for u in partition.units]
    drawn = (str(ctx.run_dir), plan.digest())
    if drawn not in _DRAWN:  # a join returns to the plan this run drew at its start: not again, in its pause
        _DRAWN.add(drawn)
        log.image("plan/ownership", np.asarray(plan_picture(plan.as_image(), names, plan.owner_counts())), dataformats="HWC")
        log.image("plan/ownership_matrix", plan.as_image())
    # At the step the plan holds from: a re-planned world's figures follow the first's.
    log.scalars(state.step, {"plan/spectral_gap": plan_dict["spectral_gap"], "plan/components": plan_dict["components"],
                    **({"plan/node_failures_survived": plan_dict["node_failures_survived"]} if "nodes" in plan_dict else {})})
    counts = plan.owner_counts()
    log.histogram("plan/owner_counts", counts)  # how many units have k owners; the unit is not a step
    log.text("plan/owners_by_unit", "| unit | owners | ranks |\n|---|---|---|\n" + "\n".join(
        f"| {names[u]} | {k} | {', '.join(map(str, plan.owners(u)))} |" for u, k in enumerate(counts)))


def summarise(ctx: RunContext, state: "TrainState", meter: Meter, done: int, evaluation: "Evaluation | None",
              alignment: list[dict[str, float]]) -> dict[str, Any]:
    """The run's summary (``summary.json``): every rank's figures and the union model's. Collective."""
    from subnetdp.parallel.apply import local_numel

    bytes_per_step, wire_per_step = meter.bytes_per_step(done)
    step_times, peak = meter.step_times, meter.peak_memory()
    model, plan, partition, parallel, sync = state.model, state.plan, state.partition, state.parallel, state.synchronizer
    params_held = local_numel(model)  # with FSDP: this rank's shards
    with parallel.gathered(model):  # collective when sharded
        digest = tensor_digest(model)
    warm = step_times[1:] or step_times  # the first step pays one-off set-up costs
    mine = {"rank": ctx.rank, "params_held": params_held, "peak_memory_bytes": peak,
            "memory_measured_by": "cuda allocator" if ctx.comm.device.type == "cuda" else "dispatch tracker (tensors only)",
            "bytes_sent_per_step": bytes_per_step, "wire_bytes_per_step_ring": wire_per_step,
            "step_time_s": sum(warm) / len(warm) if warm else None, "owned_units": plan.owned[ctx.rank],
            "worker": meter.workers[ctx.rank], "bytes_by_group": bytes_by_group(*meter.worker_group_bytes()),
            "bytes_by_phase": meter.phase_bytes(),
            "params_sha256": digest, **parallel.describe(), **sync.describe(),
            "fsdp_bytes_per_step": dict(parallel.fsdp_by_kind), "sync": "dense" if sync.dense else "grouped"}
    # collective: every rank reaches this once, after the last step.
    ranks = ctx.comm.all_gather_object(mine)
    if not step_times and not peak:  # resumed after the last step: nothing was measured by this job
        for r in ranks:
            r.update(peak_memory_bytes=None, bytes_sent_per_step=None, wire_bytes_per_step_ring=None)
    summary = {"steps": state.step, "world_size": ctx.comm.world_size,
               "eval": evaluation.metrics if evaluation else {}, "eval_union": evaluation.union if evaluation else {},
               "grad_alignment": alignment,
               "full_model_params": partition.shared_numel() + sum(partition.unit_numel(u) for u in partition.units),
               "num_units": plan.num_units, "plan_digest": plan.digest(), "spectral_gap": plan.spectral_gap(partition),
               "ranks": ranks}
    if not step_times and not peak:
        summary["note"] = ("resumed from the checkpoint of the last step: the union model was evaluated again; "
                           "memory, bytes and step time were measured by the job that trained it (metrics.jsonl, "
                           "TensorBoard), not by this one")
    if ctx.flop_match is not None:  # train.flop_matched: the steps asked for and the steps trained
        summary["flop_matched"] = dict(ctx.flop_match)
    summary["checkpoint"] = final_checkpoint(ctx, state.step)
    return summary


def final_checkpoint(ctx: RunContext, step: int) -> dict[str, Any]:
    """Where the last step's checkpoint went and its size, or why there is none."""
    from subnetdp.train.checkpoints import files as ck
    from subnetdp.train.checkpoints.checkpointer import AUTO_FINAL_MIN_STEPS

    path = ck.step_dir(ctx.run_dir, step)
    if (path / ck.MANIFEST).is_file():
        return {"path": str(path), "bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file())}
    cfg = ctx.cfg
    if not cfg.checkpoint.enabled:
        why = "checkpoint.enabled=false"
    elif cfg.checkpoint.final == "never":
        why = "checkpoint.final=never"
    else:
        why = (f"a short run (checkpoint.final=auto writes one from {AUTO_FINAL_MIN_STEPS} steps, with "
               "checkpoint.every or resume); set checkpoint.final=always to keep it")
    return {"path": None, "bytes": 0, "why": why}


def format_summary(summary: dict[str, Any], run_dir: Path) -> str:
    """The summary table printed at the end of a run."""
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


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temporary name, fsync, rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
