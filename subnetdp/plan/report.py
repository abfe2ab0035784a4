"""``subnetdp plan``: the mask plan of a config for N ranks, without training, data or a process group.

The report holds the ranks x units ownership table, owner counts, the connectivity and spectral gap
of the averaging graph, and per rank: parameters held, compute cost, and the peak memory and bytes
per step of one training step, from a dry run under FakeTensorMode (:mod:`subnetdp.plan.dryrun`).

Only the data's shape is needed (:meth:`~subnetdp.core.contracts.DataModule.planning_spec`: from
the dataset when it is on disk, from the config otherwise; the report says which). The full model
is built on the ``meta`` device and partitioned with fake tensors, so planning a 1B model allocates
nothing, and ranks whose subnetworks have the same shape share one dry run, so 4,096 ranks plan in
seconds.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from subnetdp.core.contracts import DataModule, DataSpec, ModelAdapter, Partition
from subnetdp.plan.dryrun import estimate_rank, fake_module
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.construct import build_model
from subnetdp.sdp.sync import uses_dense_sync

SHOWN_RANKS = 32  # the text report lists every rank up to this many, then one line per distinct shape


def shape_plan(cfg: DictConfig, world_size: int, pm: Any) -> tuple[DataModule, DataSpec, str, ModelAdapter, Partition, MaskPlan]:
    """Data module, spec (and its source), adapter, partition and validated plan from the data's shape.

    The same partition and plan as the loop's (:func:`subnetdp.train.loop.build_plan`), made without
    reading the data (when it is not there) and without allocating the model.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from subnetdp.core import config as config_mod
    from subnetdp.core.plan import make_plan
    from subnetdp.launchers.nodes import plan_nodes
    from subnetdp.sdp.variants import partition_model

    regs = pm.registries
    data: DataModule = regs["data"].create(cfg.data.name, cfg.data, seed=cfg.seed)
    spec, source = data.planning_spec()
    adapter: ModelAdapter = regs["model"].create(cfg.model.name, cfg.model)
    masker = regs["masker"].create(cfg.masker.name, cfg.masker)
    replicas = config_mod.check_world(cfg, world_size)
    with torch.device("meta"):  # initialisers run as no-ops; nothing is allocated
        full = build_model(adapter, spec)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    fake_module(full, fake)  # unit costs are measured by running blocks on fake tensors
    with fake:
        partition = partition_model(adapter, full, cfg.masker, spec)
    plan = make_plan(masker, partition, replicas, cfg.seed, cfg.masker.min_owners, plan_nodes(cfg, world_size))
    return data, spec, source, adapter, partition, plan.replicated(cfg.fsdp.shard_size)


def shape_key(partition: Partition, plan: MaskPlan, rank: int, shard: int = 1) -> tuple:
    """What a rank's dry run depends on: the shapes of its units by group, which of them share an
    owner set (the bucket layout), and with FSDP its shard index. Equal keys, equal estimates."""
    owned = plan.owned[rank]
    units = []
    first: dict[tuple[int, ...], int] = {}
    for i, u in enumerate(owned):
        unit = partition.units[u]
        shapes = tuple((partition.shapes[t.name], t.dim, t.stop - t.start) for t in unit.slices)
        units.append((unit.group, shapes, first.setdefault(plan.owners(u), i)))
    return tuple(units) + ((rank % shard,) if shard > 1 else ())


def estimator_for(cfg: DictConfig) -> Any:
    """The dry run of one rank: unsharded, or FSDP2 over torch's fake process group."""
    if cfg.fsdp.shard_size > 1:
        from subnetdp.plan.dryrun_fsdp import estimate_sharded_rank  # FSDP2 over torch's fake process group

        return estimate_sharded_rank
    return estimate_rank


def plan_report(cfg: DictConfig, world_size: int, pm: Any, estimate: bool = True,
                only_rank: int | None = None, flops: bool = True) -> dict[str, Any]:
    """Everything ``subnetdp plan`` shows, as a JSON-ready dict (``only_rank``: dry-run that rank only;
    ``flops=False``: no FLOP count, which costs more than a dry run on the 1B model)."""
    data, spec, source, adapter, partition, plan = shape_plan(cfg, world_size, pm)
    report = plan.to_dict(partition)
    owner_sets, max_groups = len(plan.owner_sets()), cfg.sync.max_groups
    report.update({"granularity": partition.granularity, "regime": cfg.masker.regime,
                   "masker": cfg.masker.name, "coverage": cfg.masker.coverage,
                   "capacity": [float(c) for c in cfg.masker.capacity],
                   "owner_sets": owner_sets, "max_groups": max_groups,
                   "sync": "dense" if uses_dense_sync(owner_sets, max_groups) else "grouped",
                   "data_spec": dict(spec.__dict__), "data_source": source,
                   "full_model_params": partition.shared_numel() + sum(partition.unit_numel(u) for u in partition.units)})
    shard = cfg.fsdp.shard_size
    if shard > 1:
        report["fsdp_shard_size"] = shard
    report["failures"] = failure_tolerance(cfg, pm, partition, plan.replicas(shard))
    if estimate and flops:
        report["flops"] = flop_report(cfg, adapter, spec, partition, plan.replicas(shard), data)
    report["assumes"] = assumptions(cfg, spec)
    estimator = estimator_for(cfg)
    cache: dict[tuple, dict[str, Any]] = {}
    batch = data.example_batch(spec, cfg.train.batch_size) if estimate else None
    ranks = []
    total_units = max(1, len(partition.units))
    for r in range(world_size):
        row: dict[str, Any] = {"rank": r, "owned_units": len(plan.owned[r]),
                               "coverage": len(plan.owned[r]) / total_units,
                               "params_per_rank": report["params_per_rank"][r], "cost": report["cost_per_rank"][r]}
        if estimate and (only_rank is None or r == only_rank):
            key = shape_key(partition, plan, r, shard)
            if key not in cache:
                cache[key] = estimator(cfg, adapter, spec, partition, plan, r, batch)
            row.update(cache[key])
            if shard > 1:
                row["params_per_rank"] = row["params_held"]  # this rank's shards
        ranks.append(row)
    report["ranks"] = ranks
    report["dry_runs"] = len(cache)
    costs = [row["cost"] for row in ranks]
    # Every step waits for the slowest rank: the mean over the max is the share of compute not idle.
    report["cost_balance"] = (sum(costs) / len(costs)) / max(costs) if max(costs) > 0 else 1.0
    return report


def failure_tolerance(cfg: DictConfig, pm: Any, partition: Partition, replicas: MaskPlan) -> dict[str, Any]:
    """How many ranks (replicas, with FSDP) may die at once with every unit still held by a survivor,
    the units that would be lost first, and the smallest ``masker.coverage`` that survives one failure
    at this world size (recovery from the surviving owners needs every unit on two ranks)."""
    from subnetdp.core.plan import smallest_coverage

    survived = replicas.failures_survived()
    fewest = min(replicas.owner_counts(), default=replicas.world_size)
    out: dict[str, Any] = {"survived": survived, "weakest_units": [
        partition.units[u].name for u in range(replicas.num_units) if replicas.k(u) == fewest][:8]}
    if replicas.nodes > 1:  # a node is the usual unit of failure: its ranks die together
        out["nodes"] = replicas.nodes
        out["nodes_survived"] = replicas.node_failures_survived(replicas.nodes)
    if not list(cfg.masker.capacity) and replicas.world_size > 1:  # per-rank capacities have no one coverage to name
        masker = pm.registries["masker"].create(cfg.masker.name, cfg.masker)
        out["coverage_for_one"] = smallest_coverage(masker, partition, replicas.world_size, cfg.seed, 2)
    return out


def flop_report(cfg: DictConfig, adapter: ModelAdapter, spec: DataSpec, partition: Partition, plan: MaskPlan,
                data: DataModule) -> dict[str, Any]:
    """The plan's training FLOPs against the full model's (counted on ``meta``), and the step count
    that matches ``train.steps`` steps of the full model in FLOPs."""
    from subnetdp.sdp.construct import meta_model
    from subnetdp.sdp.flops import plan_flops

    ratios = plan_flops(adapter, meta_model(adapter, spec), partition, plan, cfg.masker,
                        data.example_batch(spec, cfg.train.batch_size))
    steps = cfg.train.steps
    return {**ratios.to_dict(), "steps": steps, "flop_matched_steps": ratios.matched_steps(steps)}


def flop_line(report: dict[str, Any]) -> str:
    f = report["flops"]
    return (f"FLOPs per training step (forward + backward of one micro-batch, counted on meta): "
            f"{f['train_step']:.3f} x the full model's on the mean rank (forward alone {f['forward']:.3f}); "
            f"train.steps={f['steps']} matches the full model's training FLOPs at {f['flop_matched_steps']} steps "
            "(train.flop_matched=true trains that many)")


def failure_line(report: dict[str, Any]) -> str:
    """``failures: ...``: what the plan survives, and the coverage that survives one failure."""
    f = report["failures"]
    who = "replicas" if "fsdp_shard_size" in report else "ranks"
    if f["survived"] > 0:
        text = (f"failures: survives any {f['survived']} of {report['world_size'] // report.get('fsdp_shard_size', 1)} "
                f"{who} dying at once: every unit keeps an owner (each has at least {f['survived'] + 1})")
    else:
        text = (f"failures: one dead rank can take units no other rank holds ({', '.join(f['weakest_units'])}"
                f"{', ...' if len(f['weakest_units']) == 8 else ''})")
    if "nodes" in f:
        n, lost = f["nodes"], f["nodes_survived"]
        text += (f"; survives any {lost} of {n} nodes dying at once" if lost > 0 else
                 f"; one dead node of {n} can take units held only on it (owners across nodes need each unit on "
                 f"at least 2 ranks: masker.min_owners=2)")
    c = f.get("coverage_for_one")
    if c is not None:
        text += f"; the smallest masker.coverage that survives one failure here is {c:.4g} (with masker.min_owners=2)"
    elif "coverage_for_one" in f:
        text += "; no masker.coverage below 1 survives one failure at this world size"
    return text


GAP_NOTE = ("  (components: groups of ranks linked by the units they own together; spectral gap, 0 to 1: "
            "how fast one step's averaging mixes values across all ranks, shared parameters included and "
            "weighted by size; near 1 mixes like DDP, small values are normal at low coverage. Reported, not "
            "enforced: worry only when the union model's accuracy lags and the gap is near 0)")


def ownership_table(report: dict[str, Any], width: int = 96) -> str:
    """Ranks x units as ``#`` (owned) and ``.``; the last line gives each unit's owner count."""
    n = report["num_units"]
    shown = min(n, width)
    owned_all = report["owned"]
    rows = owned_all if len(owned_all) <= SHOWN_RANKS else owned_all[:SHOWN_RANKS // 2]
    lines = [f"ranks x units ({n} units{'' if shown == n else f', first {shown} shown'}"
             + (f"; first {len(rows)} of {len(owned_all)} ranks shown" if len(rows) < len(owned_all) else "") + "):"]
    for r, owned in enumerate(rows):
        mine = set(owned)
        lines.append(f"  rank {r:>3} " + "".join("#" if u in mine else "." for u in range(shown)))
    counts = [len(u["owners"]) for u in report["units"]]
    lines.append("  owners   " + "".join(str(c) if c < 10 else "+" for c in counts[:shown]))
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    """``23.89 GiB`` or ``51.2 MiB``."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _rank_line(row: dict[str, Any], full: int, est: bool, label: str | None = None, held: int | None = None) -> str:
    line = (f"{label or row['rank']:>9}  {row['owned_units']:>5}  {row['coverage']:>8.3f}  "
            + (f"{held:>14,}  " if held is not None else "") + f"{row['params_per_rank']:>14,}  "
            f"{row['params_per_rank'] / full:>7.1%}  {row['cost'] / 1e9:>10.3f}")
    if est:
        line += f"  {human_bytes(row['peak_memory_bytes']):>15}  {row['bytes_per_step'] / 2**20:>9.2f} MiB"
    return line


def rank_table(report: dict[str, Any]) -> list[str]:
    """One line per rank (up to :data:`SHOWN_RANKS`), else one per distinct row with its rank range."""
    full, ranks = report["full_model_params"], report["ranks"]
    est = "peak_memory_bytes" in ranks[0]
    backward = report.get("regime") == "backward"  # every rank holds the full model, trains its units
    header = (f"{'rank':>9}  {'units':>5}  {'coverage':>8}  " + (f"{'params held':>14}  {'trained':>14}" if backward
              else f"{'params':>14}") + f"  {'of full':>7}  {'cost GFLOP':>10}")
    if est:
        header += f"  {'est. peak memory':>15}  {'bytes/step':>13}"
    lines = [header]
    if len(ranks) <= SHOWN_RANKS:
        return lines + [_rank_line(row, full, est, held=full if backward else None) for row in ranks]
    groups: dict[tuple, list[int]] = {}
    for row in ranks:
        key = (row["owned_units"], row["params_per_rank"], row["cost"], row.get("peak_memory_bytes"), row.get("bytes_per_step"))
        groups.setdefault(key, []).append(row["rank"])
    for members in groups.values():
        label = f"{len(members)} ranks" if len(members) > 1 else str(members[0])
        lines.append(_rank_line(ranks[members[0]], full, est, label, held=full if backward else None) + (f"   (ranks {members[0]}..{members[-1]})" if len(members) > 1 else ""))
    return lines


def assumptions(cfg: DictConfig, spec: DataSpec) -> dict[str, Any]:
    """What the memory estimate of one training step depends on beyond the plan, from the config."""
    return {"precision": cfg.train.precision, "micro_batch": cfg.train.batch_size,
            "grad_accum": cfg.train.grad_accum, "seq_len": int(spec.seq_len),
            "activation_checkpointing": cfg.train.activation_checkpointing,
            "optimizer": cfg.optim.name}


def assumptions_line(a: dict[str, Any]) -> str:
    """``estimates assume: fp32 (train.precision), micro-batch 32 per rank (train.batch_size), ...``."""
    ac = a["activation_checkpointing"]
    parts = [f"{a['precision']} (train.precision)",
             f"micro-batch {a['micro_batch']} per rank (train.batch_size; train.grad_accum={a['grad_accum']} "
             "micro-batches per step, one at a time in memory)"]
    parts += [f"sequence length {a['seq_len']} (data.seq_len)"] if a["seq_len"] else []
    parts += [f"activation checkpointing {'on' if ac else 'off'} (train.activation_checkpointing={ac})",
              f"{a['optimizer']} optimizer state (optim.name)"]
    return "estimates assume: " + ", ".join(parts)


def format_report(report: dict[str, Any]) -> str:
    counts = [len(u["owners"]) for u in report["units"]]
    spec = ", ".join(f"{k} {v}" for k, v in report["data_spec"].items() if v)
    cap = report.get("capacity") or []
    lines = [f"plan: masker {report['masker']}, {report['granularity']} level, {report['regime']} masking, "
             + (f"capacity per rank {cap}" if cap else f"coverage {report['coverage']:g}")
             + f", {report['world_size']} ranks, digest {report['digest']}",
             f"data shape: {spec or 'none'} (from the {report['data_source']})",
             *([assumptions_line(report["assumes"])] if "peak_memory_bytes" in report["ranks"][0] else []),
             ownership_table(report),
             f"owner counts: min {min(counts)}, max {max(counts)}, mean {sum(counts) / len(counts):.2f}; "
             f"{report['owner_sets']} distinct owner sets "
             f"({report['sync']} sync, "
             f"sync.max_groups={report['max_groups']})",
             f"rank graph: {report['components']} connected component(s); spectral gap {report['spectral_gap']:.4f}",
             GAP_NOTE, failure_line(report), ""]
    lines += rank_table(report)
    lines.append(f"cost balance (mean / slowest rank's cost: every step waits for the slowest rank): "
                 f"{report['cost_balance']:.3f}")
    if "fsdp_shard_size" in report:
        lines.append(f"fsdp.shard_size={report['fsdp_shard_size']}: ranks r*S..r*S+S-1 form replica r and shard "
                     "its subnetwork with FSDP2 (estimated params and memory: this rank's shards); the plan above is the replicas' plan, repeated for each shard")
    if "flops" in report:
        lines.append(flop_line(report))
    if "peak_memory_bytes" in report["ranks"][0]:
        lines.append(f"peak memory: tensors of one training step (dry run under FakeTensorMode, {report['dry_runs']} "
                     "distinct subnetwork shape(s) dry-run); communication libraries' own buffers are not included")
    if report.get("regime") == "backward":
        lines.append(f"backward masking: every rank holds the full model ({report['full_model_params']:,} parameters) "
                     "and runs its full forward; it trains (keeps gradients and optimizer state for) the parameters "
                     "of its own units only (the params column)")
    return "\n".join(lines)
