"""``subnetdp plan --memory``: the largest coverage that fits a memory budget, per rank or for all.

Every candidate is judged by the plan's own dry run (:func:`~subnetdp.plan.report.plan_report`),
so "fits" means: the estimated peak tensor memory of one training step is at most the budget.
Candidates are the coverages at which some group's kept-unit count changes (``n / K_g``), searched
by bisection (memory grows with coverage; a masker plan may be invalid below some coverage, which
bounds the search from below). With one budget per rank the ranks get different coverages
(``masker.capacity``): each rank's largest coverage that fits its own budget, judged on a probe
plan in which that rank alone holds the candidate coverage; the final plan is then dry-run as a
whole. When nothing fits, the same search runs with each remedy (activation checkpointing, bf16,
a smaller micro-batch with more accumulation, FSDP shards) and reports which would.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from subnetdp.core.errors import ConfigError, PlanError, SubnetdpError
from subnetdp.core.plan import group_units, units_kept

UNITS = {"": 2**30, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20, "g": 2**30,
         "gb": 1e9, "gib": 2**30, "t": 2**40, "tb": 1e12, "tib": 2**40}


def parse_memory(text: str, world_size: int) -> list[int]:
    """``24GiB`` (every rank) or ``80GiB,80GiB,24GiB,24GiB`` (one per rank) as bytes per rank."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    out = []
    for p in parts:
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)", p)
        if not m or m.group(2).lower() not in UNITS:
            raise SubnetdpError(f"--memory={text}: cannot read '{p}'; write e.g. --memory 24GiB (GiB, GB, MiB, MB; "
                                "a bare number is GiB) or one budget per rank, 80GiB,80GiB,24GiB,24GiB")
        out.append(int(float(m.group(1)) * UNITS[m.group(2).lower()]))
    if len(out) == 1:
        return out * world_size
    if len(out) != world_size:
        raise SubnetdpError(f"--memory={text}: {len(out)} budgets for {world_size} ranks; give one budget, or one per rank")
    return out


def candidates(partition: Any, group_by: str) -> list[float]:
    """Coverages at which some group's kept-unit count changes, ascending, one per distinct count vector."""
    groups = [len(ids) for ids in group_units(partition, group_by).values()]
    values = sorted({n / k for k in groups for n in range(1, k + 1)})
    out, seen = [], set()
    for c in values:
        vec = tuple(units_kept(c, k) for k in groups)
        if vec not in seen:
            seen.add(vec)
            out.append(c)
    return out


def with_overrides(cfg: DictConfig, **values: Any) -> DictConfig:
    new = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for k, v in values.items():
        OmegaConf.update(new, k, v, force_add=True)
    return new


class BudgetSearch:
    """Dry runs of candidate configs, cached by their overrides."""

    def __init__(self, cfg: DictConfig, world_size: int, pm: Any) -> None:
        from subnetdp.plan.report import shape_plan

        self.cfg, self.world, self.pm = cfg, world_size, pm
        self.partition = shape_plan(cfg, world_size, pm)[4]
        self.cands = candidates(self.partition, str(cfg.masker.get("group_by", "auto")))
        self.tried: list[dict[str, Any]] = []
        self._cache: dict[tuple, Any] = {}

    def replicas(self, cfg: DictConfig) -> int:
        return self.world // int(cfg.fsdp.shard_size)

    def evaluate(self, overrides: dict[str, Any], probe_rank_coverage: float | None = None) -> dict[str, Any] | None:
        """The plan report of the config with ``overrides`` (None when the plan or config is invalid).

        ``probe_rank_coverage``: rank 0 keeps that coverage and every other rank the whole model,
        and only rank 0 is dry-run (one rank's peak as a function of its own coverage).
        """
        from subnetdp.plan.report import plan_report

        key = (repr(sorted(overrides.items())), probe_rank_coverage)
        if key in self._cache:
            return self._cache[key]
        try:
            cfg = with_overrides(self.cfg, **overrides)
            if probe_rank_coverage is not None:
                cfg = with_overrides(cfg, **{"masker.capacity": [probe_rank_coverage] + [1.0] * (self.replicas(cfg) - 1)})
            from subnetdp.train.configure import validate

            validate(cfg, self.pm.registries)
            report = plan_report(cfg, self.world, self.pm, only_rank=0 if probe_rank_coverage is not None else None)
        except (PlanError, ConfigError) as e:
            report = None
            self.tried.append({"overrides": overrides, "probe": probe_rank_coverage, "invalid": str(e)})
        if report is not None:
            peaks = [r["peak_memory_bytes"] for r in report["ranks"] if "peak_memory_bytes" in r]
            self.tried.append({"overrides": overrides, "probe": probe_rank_coverage, "max_peak_bytes": max(peaks)})
        self._cache[key] = report
        return report

    def largest(self, fits: Callable[[dict[str, Any]], bool], run: Callable[[float], dict[str, Any] | None]) -> tuple[float | None, dict | None]:
        """The largest candidate coverage whose report exists and ``fits`` (bisection, memory monotone)."""
        lo_valid = None
        for i, c in enumerate(self.cands):  # the smallest valid coverage (plans can be invalid below it)
            if run(c) is not None:
                lo_valid = i
                break
        if lo_valid is None or not fits(run(self.cands[lo_valid])):
            return None, None
        lo, hi = lo_valid, len(self.cands) - 1  # cands[lo] fits; find the last that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            rep = run(self.cands[mid])
            if rep is not None and fits(rep):
                lo = mid
            else:
                hi = mid - 1
        return self.cands[lo], run(self.cands[lo])


def _max_peak(report: dict[str, Any]) -> int:
    return max(r["peak_memory_bytes"] for r in report["ranks"] if "peak_memory_bytes" in r)


def remedies(cfg: DictConfig, world_size: int) -> list[tuple[str, dict[str, Any]]]:
    """What lowers the per-rank peak, each as config overrides: AC, bf16, smaller micro-batches, FSDP."""
    out: list[tuple[str, dict[str, Any]]] = []
    if int(cfg.train.activation_checkpointing) != 1:
        out.append(("activation checkpointing", {"train.activation_checkpointing": 1}))
    if str(cfg.train.precision) != "bf16":
        out.append(("bf16", {"train.precision": "bf16"}))
    b, a = int(cfg.train.batch_size), int(cfg.train.grad_accum)
    while b > 1 and b % 2 == 0:
        b, a = b // 2, a * 2
        out.append((f"micro-batch {b} x {a} accumulated (same global batch)", {"train.batch_size": b, "train.grad_accum": a}))
    for s in range(2, world_size + 1):
        if world_size % s == 0 and s > int(cfg.fsdp.shard_size):
            out.append((f"FSDP shards of {s}", {"fsdp.shard_size": s}))
    return out


def budget_search(cfg: DictConfig, world_size: int, pm: Any, budgets: list[int]) -> dict[str, Any]:
    """The answer for ``budgets`` (bytes per rank): overrides that fit, the search, and remedies."""
    search = BudgetSearch(cfg, world_size, pm)
    uniform = len(set(budgets)) == 1
    result: dict[str, Any] = {"budgets": budgets, "candidates": search.cands}
    if uniform:
        budget = budgets[0]

        def uniform_at(extra: dict[str, Any]) -> tuple[float | None, dict | None]:
            return search.largest(lambda rep: _max_peak(rep) <= budget,
                                  lambda c: search.evaluate({**extra, "masker.coverage": c, "masker.capacity": []}))

        c, rep = uniform_at({})
        if c is not None:
            i = search.cands.index(c)
            nxt = search.cands[i + 1] if i + 1 < len(search.cands) else None
            nrep = search.evaluate({"masker.coverage": nxt, "masker.capacity": []}) if nxt is not None else None
            result.update({"fits": True, "coverage": c, "overrides": [f"masker.coverage={c:.6g}", "masker.capacity=[]"],
                           "report": rep, "max_peak_bytes": _max_peak(rep), "next_coverage": nxt,
                           "next_max_peak_bytes": _max_peak(nrep) if nrep is not None else None})
        else:
            result.update({"fits": False, "would_fit": _remedy_answers(cfg, world_size, search, uniform_at)})
        result["tried"] = search.tried
        return result
    # One budget per rank: each rank's own largest coverage, on the probe plan.
    R = world_size // int(cfg.fsdp.shard_size)
    S = world_size // R
    per_replica = [min(budgets[r * S:(r + 1) * S]) for r in range(R)]  # a replica's ranks hold one subnetwork
    chosen: dict[int, float | None] = {}
    for b in sorted(set(per_replica)):
        chosen[b] = search.largest(lambda rep, b=b: rep["ranks"][0]["peak_memory_bytes"] <= b,
                                   lambda c: search.evaluate({"masker.capacity": []}, probe_rank_coverage=c))[0]
    missing = [r for r, b in enumerate(per_replica) if chosen[b] is None]
    if missing:
        result.update({"fits": False, "ranks_without_fit": missing,
                       "would_fit": _remedy_answers(cfg, world_size, search, lambda extra: search.largest(
                           lambda rep: rep["ranks"][0]["peak_memory_bytes"] <= min(per_replica),
                           lambda c: search.evaluate({**extra, "masker.capacity": []}, probe_rank_coverage=c)))})
        result["tried"] = search.tried
        return result
    capacity = [float(chosen[b]) for b in per_replica]
    rep = search.evaluate({"masker.capacity": capacity})
    if rep is None:
        result.update({"fits": False, "capacity": capacity, "invalid": search.tried[-1].get("invalid")})
    else:
        over = [row["rank"] for row in rep["ranks"] if row["peak_memory_bytes"] > budgets[row["rank"]]]
        result.update({"fits": not over, "capacity": capacity, "report": rep, "ranks_over_budget": over,
                       "overrides": ["masker.capacity=[" + ",".join(f"{c:.6g}" for c in capacity) + "]"]})
    result["tried"] = search.tried
    return result


def _remedy_answers(cfg: DictConfig, world_size: int, search: BudgetSearch,
                    at: Callable[[dict[str, Any]], tuple[float | None, dict | None]]) -> list[dict[str, Any]]:
    """Each remedy alone, then all of them together, with the largest coverage each would allow."""
    answers = []
    options = remedies(cfg, world_size)
    for label, extra in options:
        c, rep = at(extra)
        if c is not None:
            answers.append({"remedy": label, "overrides": [f"{k}={v}" for k, v in extra.items()], "coverage": c,
                            "max_peak_bytes": _max_peak(rep)})
    if not answers and options:
        combined: dict[str, Any] = {}
        for _, extra in options:  # later entries win: the smallest micro-batch, the largest shards
            combined.update(extra)
        c, rep = at(combined)
        if c is not None:
            answers.append({"remedy": "all of: " + ", ".join(label for label, _ in options),
                            "overrides": [f"{k}={v}" for k, v in combined.items()], "coverage": c,
                            "max_peak_bytes": _max_peak(rep)})
    return answers


def format_budget(result: dict[str, Any]) -> str:
    from subnetdp.plan.report import human_bytes

    budgets = result["budgets"]
    shown = human_bytes(budgets[0]) if len(set(budgets)) == 1 else ", ".join(human_bytes(b) for b in budgets)
    text = str(result.get("memory", ""))
    decimal = re.search(r"[0-9.]\s*[kmgt]b\b", text, re.IGNORECASE)
    lines = [f"memory budget per rank: {shown}" + (f" (--memory {text}: GB and MB are decimal, 10^9 and 10^6 bytes; "
                                                     "GiB and MiB are 2^30 and 2^20, as GPU memory is counted)"
                                                     if decimal else "")]
    for t in result["tried"]:
        what = ", ".join(f"{k}={v}" for k, v in t["overrides"].items() if k != "masker.capacity" or v)
        if t["probe"] is not None:
            what += f" (probe: one rank at coverage {t['probe']:.4g})"
        lines.append(f"  dry run {what}: " + (f"max peak {human_bytes(t['max_peak_bytes'])}" if "max_peak_bytes" in t
                                             else f"invalid ({t['invalid']})"))
    if result.get("fits"):
        if "coverage" in result:
            nxt = result.get("next_coverage")
            lines.append(f"answer: masker.coverage={result['coverage']:.6g} fits every rank's {shown} (max peak "
                         f"{human_bytes(result['max_peak_bytes'])})" + (
                             f"; the next larger coverage {nxt:.6g} needs {human_bytes(result['next_max_peak_bytes'])}"
                             if nxt is not None and result.get("next_max_peak_bytes") else
                             "; it is the whole model" if nxt is None else ""))
        else:
            lines.append(f"answer: {result['overrides'][0]} (each rank's largest coverage within its budget: {shown})")
        lines.append("run with: " + " ".join(result["overrides"]))
    else:
        if result.get("capacity") and result.get("invalid"):
            lines.append(f"each rank's largest coverage {result['capacity']} gives no valid plan: {result['invalid']}")
        elif result.get("ranks_over_budget"):
            lines.append(f"ranks {result['ranks_over_budget']} exceed their budget in the whole plan")
        else:
            lines.append("no coverage fits" + (f" ranks {result['ranks_without_fit']}" if result.get("ranks_without_fit") else " every rank"))
        for a in result.get("would_fit", []):
            lines.append(f"  would fit with {a['remedy']} ({' '.join(a['overrides'])}): coverage up to "
                         f"{a['coverage']:.6g}, max peak {human_bytes(a['max_peak_bytes'])}")
        if not result.get("would_fit") and not result.get("capacity"):
            lines.append("  nothing tried fits: fewer tokens per micro-batch (data.seq_len) or a smaller model")
    return "\n".join(lines)
