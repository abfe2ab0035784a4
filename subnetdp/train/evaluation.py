"""Evaluating a running job: the union model streamed from its owners, every rank's own subnetwork,
lm-eval tasks (``eval.tasks``) and the gradient-alignment probe (``train.grad_alignment_every``).

Nothing here writes a log: what an evaluation finds is returned (:class:`Evaluation`) and handed to
the lifecycle hooks, where the built-in reporter (:mod:`subnetdp.train.report`) writes it.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from omegaconf import DictConfig

from subnetdp.core.contracts import DataModule, RunContext
from subnetdp.core.errors import ConfigError
from subnetdp.sdp.branches import fold_branch_scales
from subnetdp.sdp.union import assemble_union, branch_keep_rates, evaluate, evaluate_union, scalable_branches
from subnetdp.sdp.variants import regime_of

if TYPE_CHECKING:
    from subnetdp.train.meter import Meter
    from subnetdp.train.state import TrainState


@dataclass(frozen=True)
class Evaluation:
    """What one evaluation of the union model found.

    Attributes:
        metrics: the union model's metrics (the same on every rank) and, on rank 0 with ``eval.tasks``,
            the lm-eval scores as ``<task>/<metric>``.
        tasks: those lm-eval scores alone (empty on other ranks and without ``eval.tasks``).
        union: how the union was evaluated (``summary.json``'s ``eval_union``); with ``eval.breakdown``,
            at the last step, also the union at x1 and rescaled and every rank's own subnetwork.
    """

    metrics: dict[str, float]
    tasks: dict[str, float] = field(default_factory=dict)
    union: dict[str, Any] = field(default_factory=dict)


def evaluate_run(ctx: RunContext, state: "TrainState", step: int) -> Evaluation:
    """Evaluate the union model on every rank, streamed from the owners (never assembled). Collective.

    Every rank evaluates the same batches and gets the same metrics. Block-level forward masking with
    ``eval.block_union=rescaled``: every residual branch is scaled by its training keep rate. With
    ``eval.breakdown``, the last evaluation also reports the union at x1 and rescaled and every rank's
    own subnetwork, on the same validation batches. lm-eval tasks (``eval.tasks``) run in one process,
    on a union assembled on rank 0.
    """
    cfg, s, partition, plan = ctx.cfg, ctx.settings, state.partition, state.plan
    block_forward = partition.granularity == "block" and regime_of(cfg.masker).drops_branches
    breakdown = s.eval.breakdown and block_forward and step == ctx.steps and not state.parallel.sharded
    rates = branch_keep_rates(partition, plan) if block_forward else {}
    mode = s.eval.block_union
    # Only the branches the adapter can scale are scaled; the others are named in the summary.
    applied, unscaled = scalable_branches(ctx.adapter, ctx.spec, rates) if mode == "rescaled" else ({}, [])
    how: dict[str, Any] = {"block_union": mode, "rescaled": bool(applied), "branch_keep_rates": rates,
                           **({"not_rescaled": unscaled} if unscaled else {})}

    def union_metrics(scales: dict[str, float]) -> dict[str, float]:
        # collective: every rank streams the union's units from their owners, batch by batch.
        return evaluate_union(ctx.adapter, ctx.spec, s.seed, partition, plan, state.model, state.pmap,
                              ctx.comm, ctx.data, cfg, scales)

    # collective when sharded: full parameters while the union streams; evaluation traffic is not a step's.
    with state.parallel.gathered(state.model), ctx.comm.bytes.phase("eval"):
        own = _own_subnetworks(ctx, state) if breakdown else None  # collective: every rank evaluates its own
        if breakdown:
            x1, rescaled = union_metrics({}), union_metrics(applied)
            metrics = dict(rescaled if mode == "rescaled" else x1)
            how.update({"step": step, "union_x1": x1, "union_rescaled": rescaled, "own_subnetworks": own})
        else:
            metrics = union_metrics(applied)
        union = None
        if ctx.tasks is not None:  # collective: lm-eval needs the whole union in one process
            union = assemble_union(ctx.adapter, ctx.spec, s.seed, partition, plan, state.model, state.pmap, ctx.comm)
    tasks: dict[str, float] = {}
    if union is not None:
        if how["rescaled"]:
            fold_branch_scales(ctx.adapter.branch_output_layers(union), rates)
        tasks = _evaluate_tasks(ctx, union, step)
    return Evaluation({**metrics, **tasks}, tasks, how)


def _own_subnetworks(ctx: RunContext, state: "TrainState") -> list[dict[str, Any]]:
    """Every rank's own subnetwork, evaluated on the validation batches. Collective."""
    mine = {"rank": ctx.rank, "owned": state.plan.owned[ctx.rank],
            "metrics": evaluate(copy.deepcopy(state.model), ctx.adapter, ctx.data, ctx.cfg, device=ctx.comm.device)}
    state.model.train()
    # collective: every rank reaches this at the last evaluation.
    return ctx.comm.all_gather_object(mine)


def load_tasks(cfg: DictConfig, data: DataModule) -> Any:
    """``eval.tasks``: the lm-eval tasks loaded with their data (None without), before any process group."""
    tasks = list(cfg.eval.tasks)  # a composed config: typed by its schema (list[str])
    if not tasks:
        return None
    from subnetdp.train import downstream

    if data.tokenizer() is None:
        raise ConfigError("eval.tasks", tasks, f"data.root={cfg.data.root} does not say which tokenizer made its "
                          "tokens (no meta.json)", "prepare the data with `subnetdp prepare-text`, or eval.tasks=[]")

    downstream.set_offline(cfg.eval.offline)
    manager = downstream.task_manager(tasks, [cfg.eval.include_path] if cfg.eval.include_path else [])
    return downstream.load_tasks(manager, tasks)


def _evaluate_tasks(ctx: RunContext, union: torch.nn.Module, step: int) -> dict[str, float]:
    """lm-eval on the union model, on this rank's device (rank 0 only); scores as ``<task>/<metric>``.

    The full results go to ``RUN_DIR/lm_eval/step_XXXXXXXX.json``; the scores are returned.
    """
    from subnetdp.train import downstream

    s, device = ctx.settings, ctx.comm.device
    model = union.to(device).eval()
    lm = downstream.make_lm(model, ctx.data.tokenizer(), device, int(ctx.spec.seq_len) or 2048, s.eval.task_batch_size)
    limit = s.eval.task_limit or None
    if limit is not None and limit >= 1:
        limit = int(limit)
    # The tasks were loaded once at set-up; lm-eval rebuilds their requests at every evaluation.
    results = downstream.run_tasks(lm, ctx.tasks, limit, s.eval.num_fewshot, s.seed)
    downstream.save_results(ctx.run_dir, step, results)
    union.cpu()
    return downstream.scalars(results)


class AlignmentProbe:
    """``train.grad_alignment_every``: the gradient-alignment probe of the steps it falls on.

    The probe compares each step's averaged gradients with the DDP gradient of the same batches
    (:func:`subnetdp.sdp.alignment.gradient_alignment`). Its time and traffic are not the step's, and
    it skips the memory-measured step. What it finds is kept in :attr:`records` and given to the
    step's metrics as ``probe/grad_*`` (:meth:`figures`).
    """

    def __init__(self, ctx: RunContext, state: "TrainState", meter: "Meter") -> None:
        self.ctx, self.state, self.meter = ctx, state, meter
        self.every = ctx.settings.train.grad_alignment_every
        self.records: list[dict[str, float]] = []

    def at(self, step: int) -> Callable[[list[Any]], None] | None:
        """The probe to call with step ``step``'s micro-batches, or None on a step without one."""
        if not self.every or step % self.every or step == self.meter.measured_step:
            return None
        ctx, state = self.ctx, self.state

        def probe(batches: list[Any]) -> None:
            from subnetdp.sdp.alignment import gradient_alignment

            t0 = time.perf_counter()
            with ctx.comm.bytes.phase("probe"):
                result = gradient_alignment(ctx.adapter, ctx.spec, ctx.settings.seed, state.partition, state.plan,
                                            state.model, state.pmap, ctx.comm, batches)  # collective
            self.meter.untimed(time.perf_counter() - t0)
            if result is not None:
                self.records.append({"step": step, **result})
        return probe

    def figures(self, step: int) -> dict[str, float]:
        """Step ``step``'s result as ``probe/grad_<name>`` values (empty when it ran no probe here)."""
        if not self.records or self.records[-1]["step"] != step:
            return {}
        return {f"probe/grad_{k}": v for k, v in self.records[-1].items() if k != "step"}
