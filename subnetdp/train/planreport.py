"""``subnetdp plan``: the mask plan of a config for N ranks, without training or a process group.

The report holds the ranks x units ownership table, owner counts, the connectivity and spectral gap
of the averaging graph, and per rank: parameters held, compute cost, and the peak memory and bytes
per step of one training step, from a dry run under FakeTensorMode (:mod:`subnetdp.train.dryrun`).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from subnetdp.train.dryrun import estimate_rank


def plan_report(cfg: DictConfig, world_size: int, pm: Any, estimate: bool = True) -> dict[str, Any]:
    """Everything ``subnetdp plan`` shows, as a JSON-ready dict."""
    from subnetdp.train.loop import build_plan

    data, spec, adapter, full, partition, plan = build_plan(cfg, world_size, pm)
    del full
    report = plan.to_dict(partition)
    report.update({"granularity": partition.granularity, "regime": str(cfg.masker.regime),
                   "masker": str(cfg.masker.name), "coverage": float(cfg.masker.coverage),
                   "owner_sets": len(plan.owner_sets()), "max_groups": int(cfg.sync.max_groups),
                   "full_model_params": partition.shared_numel() + sum(partition.unit_numel(u) for u in partition.units)})
    shard = int(cfg.fsdp.shard_size)
    estimator = estimate_rank
    if shard > 1:
        report["fsdp_shard_size"] = shard
        from subnetdp.train.dryrun_fsdp import estimate_sharded_rank  # FSDP2 over torch's fake process group

        estimator = estimate_sharded_rank
    ranks = []
    cache: dict[tuple[int, ...], dict[str, Any]] = {}
    batch = next(iter(data.train_loader(0, world_size, int(cfg.train.batch_size)))) if estimate else None
    for r in range(world_size):
        row: dict[str, Any] = {"rank": r, "owned_units": len(plan.owned[r]),
                               "params_per_rank": report["params_per_rank"][r], "cost": report["cost_per_rank"][r]}
        if estimate:
            key = tuple(plan.owned[r])
            # Ranks that own the same units in the same owner sets have the same step.
            sig = key + tuple(len(plan.owners(u)) for u in key) + ((r % shard,) if shard > 1 else ())
            if sig not in cache:  # with FSDP, shard indices can hold slightly different shard sizes
                cache[sig] = estimator(cfg, adapter, spec, partition, plan, r, batch)
            row.update(cache[sig])
            if shard > 1:
                row["params_per_rank"] = row["params_held"]  # this rank's shards
        ranks.append(row)
    report["ranks"] = ranks
    return report


GAP_NOTE = ("  (components: groups of ranks linked by the units they own together; spectral gap, 0 to 1: "
            "how fast one step's averaging mixes values across all ranks, shared parameters included and "
            "weighted by size; near 1 mixes like DDP, small values are normal at low coverage. Reported, not "
            "enforced: worry only when the union model's accuracy lags and the gap is near 0)")


def ownership_table(report: dict[str, Any], width: int = 96) -> str:
    """Ranks x units as ``#`` (owned) and ``.``; the last line gives each unit's owner count."""
    n = report["num_units"]
    shown = min(n, width)
    lines = [f"ranks x units ({n} units{'' if shown == n else f', first {shown} shown'}):"]
    for r, owned in enumerate(report["owned"]):
        mine = set(owned)
        lines.append(f"  rank {r:>3} " + "".join("#" if u in mine else "." for u in range(shown)))
    counts = [len(u["owners"]) for u in report["units"]]
    lines.append("  owners   " + "".join(str(c) if c < 10 else "+" for c in counts[:shown]))
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    counts = [len(u["owners"]) for u in report["units"]]
    full = report["full_model_params"]
    lines = [f"plan: masker {report['masker']}, {report['granularity']} level, {report['regime']} masking, "
             f"coverage {report['coverage']:g}, {report['world_size']} ranks, digest {report['digest']}",
             ownership_table(report),
             f"owner counts: min {min(counts)}, max {max(counts)}, mean {sum(counts) / len(counts):.2f}; "
             f"{report['owner_sets']} distinct owner sets "
             f"({'dense' if report['owner_sets'] > report['max_groups'] else 'grouped'} sync, "
             f"sync.max_groups={report['max_groups']})",
             f"rank graph: {report['components']} connected component(s); spectral gap {report['spectral_gap']:.4f}",
             GAP_NOTE, ""]
    backward = report.get("regime") == "backward"
    header = f"{'rank':>4}  {'units':>5}  " + (f"{'params held':>12}  {'trained':>12}" if backward else f"{'params':>12}") \
        + f"  {'of full':>7}  {'cost GFLOP':>10}"
    est = "peak_memory_bytes" in report["ranks"][0]
    if est:
        header += f"  {'est. peak memory':>16}  {'bytes/step':>12}"
    lines.append(header)
    for row in report["ranks"]:
        held = f"{full:>12,}  " if backward else ""  # backward masking: every rank holds the full model
        line = (f"{row['rank']:>4}  {row['owned_units']:>5}  {held}{row['params_per_rank']:>12,}  "
                f"{row['params_per_rank'] / full:>7.1%}  {row['cost'] / 1e9:>10.3f}")
        if est:
            line += f"  {row['peak_memory_bytes'] / 2**20:>12.1f} MiB  {row['bytes_per_step'] / 2**20:>8.2f} MiB"
        lines.append(line)
    if "fsdp_shard_size" in report:
        lines.append(f"fsdp.shard_size={report['fsdp_shard_size']}: ranks r*S..r*S+S-1 form replica r and shard "
                     "its subnetwork with FSDP2 (estimated params and memory: this rank's shards); the plan above is the replicas' plan, repeated for each shard")
    if backward:
        lines.append("backward masking: every rank holds the full model and runs its full forward; it trains "
                     "(keeps gradients and optimizer state for) the parameters of its own units only")
    if est:
        lines.append("peak memory: tensors of one training step (dry run under FakeTensorMode); "
                     "communication libraries' own buffers are not included")
    return "\n".join(lines)
