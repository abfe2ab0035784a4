"""``subnetdp plan --memory``: the options that fit a memory budget, best first, per rank or for all.

Every candidate is judged by the plan's own dry run (:func:`~subnetdp.plan.report.plan_report`),
so "fits" means: the estimated peak tensor memory of one training step is at most the budget less
a margin (``--margin``, default :data:`DEFAULT_MARGIN`). The margin stands for what the estimate does
not count: the CUDA context, the communicator's buffers (NCCL's channels) and the allocator's
fragmentation; an answer at 23.9 of 24 GiB would not survive them.

With one budget for every rank the options are ranked as the README advises: the whole model
(C = 1, plain data parallelism) first, as is or with the cheapest remedy that makes it fit
(:func:`remedies`: the exact ones, activation checkpointing then FSDP shards then smaller
micro-batches, before bf16, which changes the arithmetic), then the largest coverage that fits as
configured. Each option carries its estimated peak and its step cost (training FLOPs against the
full model's, and bytes sent per step). Coverages are searched among the values at which some
group's kept-unit count changes (``n / K_g``), by interpolation on the measured peaks (memory grows
about linearly with the units kept; a masker plan may be invalid below some coverage, which bounds
the search from below). With one budget per rank the ranks get different coverages
(``masker.capacity``): each rank's largest coverage that fits its own budget, judged on a probe
plan in which that rank alone holds the candidate coverage; the final plan is then dry-run as a
whole. When nothing fits, the same search runs with each remedy and reports which would.
"""
from __future__ import annotations

import copy

import re
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from subnetdp.core.errors import ConfigError, PlanError, SubnetdpError
from subnetdp.core.plan import group_units, units_kept

DEFAULT_MARGIN = 0.10  # share of each budget kept back for what the estimate does not count

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


def parse_margin(text: str | float) -> float:
    """``--margin``: ``0.1`` or ``10%`` of each budget kept back, in [0, 1)."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 1:  # NaN fails this too
        raise SubnetdpError(f"--margin={text}: must be a share of the budget in [0, 1), e.g. --margin 0.1 or "
                            f"--margin 10% (default {DEFAULT_MARGIN:g}); --margin 0 plans to the whole budget")
    return value


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
    """A copy of ``cfg`` with ``values`` (dotted keys): typed by the same schemas, ``cfg`` left as it is."""
    new = copy.deepcopy(cfg)
    OmegaConf.set_readonly(new, False)
    for k, v in values.items():
        OmegaConf.update(new, k, v, force_add=True)
    return new


class BudgetSearch:
    """Dry runs of candidate configs, cached by their overrides."""

    def __init__(self, cfg: DictConfig, world_size: int, pm: Any, dry_runs: dict[tuple, Any] | None = None) -> None:
        """``dry_runs``: the dry runs of earlier searches of this ``cfg`` and world size (the same dict,
        filled in here): each candidate is dry-run once however many budgets are searched."""
        from subnetdp.plan.report import shape_plan

        self.cfg, self.world, self.pm = cfg, world_size, pm
        self.partition = shape_plan(cfg, world_size, pm)[4]
        self.cands = candidates(self.partition, str(cfg.masker.get("group_by", "auto")))
        self.tried: list[dict[str, Any]] = []
        self._cache: dict[tuple, Any] = {}
        self._dry_runs = {} if dry_runs is None else dry_runs  # key -> (report, its entry in tried)

    def replicas(self, cfg: DictConfig) -> int:
        return self.world // cfg.fsdp.shard_size

    def evaluate(self, overrides: dict[str, Any], probe_rank_coverage: float | None = None) -> dict[str, Any] | None:
        """The plan report of the config with ``overrides`` (None when the plan or config is invalid).

        ``probe_rank_coverage``: rank 0 keeps that coverage and every other rank the whole model,
        and only rank 0 is dry-run (one rank's peak as a function of its own coverage).
        """
        key = (repr(sorted(overrides.items())), probe_rank_coverage)
        if key in self._cache:
            return self._cache[key]
        if key not in self._dry_runs:
            self._dry_runs[key] = self._dry_run(overrides, probe_rank_coverage)
        report, entry = self._dry_runs[key]
        self.tried.append(entry)  # what this search's answer rests on, dry-run now or by an earlier search
        self._cache[key] = report
        return report

    def _dry_run(self, overrides: dict[str, Any], probe_rank_coverage: float | None) -> tuple[dict | None, dict]:
        from subnetdp.plan.report import plan_report

        try:
            cfg = with_overrides(self.cfg, **overrides)
            if probe_rank_coverage is not None:
                cfg = with_overrides(cfg, **{"masker.capacity": [probe_rank_coverage] + [1.0] * (self.replicas(cfg) - 1)})
            from subnetdp.train.configure import validate

            validate(cfg, self.pm.registries)
            report = plan_report(cfg, self.world, self.pm, only_rank=0 if probe_rank_coverage is not None else None,
                                 flops=False)  # counted for the options alone (step_cost)
        except (PlanError, ConfigError) as e:
            return None, {"overrides": overrides, "probe": probe_rank_coverage, "invalid": str(e)}
        except (ValueError, RuntimeError) as e:
            # A remedy the model cannot train with (BatchNorm at a micro-batch of 1): not an option.
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return None, {"overrides": overrides, "probe": probe_rank_coverage, "invalid": f"the dry run fails: {first}"}
        peaks = [r["peak_memory_bytes"] for r in report["ranks"] if "peak_memory_bytes" in r]
        return report, {"overrides": overrides, "probe": probe_rank_coverage, "max_peak_bytes": max(peaks)}

    def flops(self, coverage: float) -> dict[str, Any]:
        """The FLOP report (:func:`~subnetdp.plan.report.flop_report`) of the plan at ``coverage``."""
        from subnetdp.plan.report import flop_report, shape_plan

        key = ("flops", coverage)
        if key not in self._cache:
            cfg = with_overrides(self.cfg, **{"masker.coverage": coverage, "masker.capacity": []})
            data, spec, _, adapter, partition, plan = shape_plan(cfg, self.world, self.pm)
            self._cache[key] = flop_report(cfg, adapter, spec, partition, plan.replicas(cfg.fsdp.shard_size), data)
        return self._cache[key]

    def flop_counts(self) -> list[dict[str, Any]]:
        """The FLOP reports counted so far."""
        return [v for k, v in self._cache.items() if k[0] == "flops"]

    def largest(self, peak: Callable[[dict[str, Any]], int], budget: int, run: Callable[[float], dict[str, Any] | None],
                known: dict[float, int] | None = None) -> tuple[float | None, dict | None]:
        """The largest candidate coverage whose report exists and whose ``peak`` is within ``budget``.

        Memory grows with coverage, about linearly in the units kept, so each next candidate is the
        one the two bracketing peaks point at (interpolation), which takes two or three dry runs where
        bisection takes five. ``known``: peaks already measured (coverage -> bytes), e.g. C = 1's.
        """
        peaks = dict(known or {})
        lo_valid = None
        for i, c in enumerate(self.cands):  # the smallest valid coverage (plans can be invalid below it)
            if run(c) is not None:
                lo_valid = i
                break
        if lo_valid is None or peak(run(self.cands[lo_valid])) > budget:
            return None, None
        lo, hi = lo_valid, len(self.cands)  # cands[lo] fits, cands[hi] (when it exists) does not
        peaks[self.cands[lo]] = peak(run(self.cands[lo]))
        top = self.cands[-1]
        if top in peaks and peaks[top] > budget:
            hi = len(self.cands) - 1
        while hi - lo > 1:
            c_lo, p_lo = self.cands[lo], peaks[self.cands[lo]]
            if hi < len(self.cands) and self.cands[hi] in peaks and peaks[self.cands[hi]] > p_lo:
                c_hi, p_hi = self.cands[hi], peaks[self.cands[hi]]
                guess = c_lo + (budget - p_lo) * (c_hi - c_lo) / (p_hi - p_lo)
                mid = max(i for i in range(lo, hi) if self.cands[i] <= guess + 1e-12)
                mid = min(max(mid, lo + 1), hi - 1)
            else:
                mid = (lo + hi) // 2
            rep = run(self.cands[mid])
            if rep is not None and peak(rep) <= budget:
                lo = mid
                peaks[self.cands[mid]] = peak(rep)
            else:
                hi = mid
                if rep is not None:
                    peaks[self.cands[mid]] = peak(rep)
        return self.cands[lo], run(self.cands[lo])


def _max_peak(report: dict[str, Any]) -> int:
    return max(r["peak_memory_bytes"] for r in report["ranks"] if "peak_memory_bytes" in r)


def remedies(cfg: DictConfig, world_size: int) -> list[tuple[str, dict[str, Any]]]:
    """What lowers the per-rank peak, cheapest first, each as config overrides.

    The exact remedies come first, by what they cost a step: activation checkpointing (one more
    forward of the checkpointed blocks), FSDP shards (all-gathers and reduce-scatters each
    micro-batch, fewer ranks per shard first), smaller micro-batches with more accumulation (the
    same global batch at a lower arithmetic intensity); bf16 last, because it changes the arithmetic.
    """
    out: list[tuple[str, dict[str, Any]]] = []
    if cfg.train.activation_checkpointing != 1:
        out.append(("activation checkpointing", {"train.activation_checkpointing": 1}))
    for s in range(2, world_size + 1):
        if world_size % s == 0 and s > cfg.fsdp.shard_size:
            out.append((f"FSDP shards of {s}", {"fsdp.shard_size": s}))
    b, a = cfg.train.batch_size, cfg.train.grad_accum
    while b > 1 and b % 2 == 0:
        b, a = b // 2, a * 2
        out.append((f"micro-batch {b} x {a} accumulated (same global batch)", {"train.batch_size": b, "train.grad_accum": a}))
    if cfg.train.precision != "bf16":
        out.append(("bf16", {"train.precision": "bf16"}))
    return out


def step_cost(report: dict[str, Any], f: dict[str, Any], overrides: dict[str, Any]) -> dict[str, float]:
    """An option's step cost: training FLOPs per step against the full model's (plain DDP = 1; ``f``:
    the plan's FLOP report), with activation checkpointing's recomputed forward (every k-th block:
    1/k of the forward), and the most bytes any rank sends per step."""
    flops = f["train_step"]
    k = int(overrides.get("train.activation_checkpointing", 0))
    if k > 0:
        flops += f["forward"] * f["full_forward"] / f["full_train_step"] / k
    return {"step_flops": flops, "bytes_per_step": max(r.get("bytes_per_step", 0.0) for r in report["ranks"])}


def _option(search: BudgetSearch, label: str, overrides: dict[str, Any], coverage: float,
            report: dict[str, Any]) -> dict[str, Any]:
    # The FLOPs do not depend on the remedies (none changes what is computed, only when and where),
    # and the whole model's are the same in every plan: at C = 1 the ratios are 1, and the full
    # model's counts (for checkpointing's recomputed forward) come from any plan counted before.
    if coverage < 1:
        f = search.flops(coverage)
    elif overrides.get("train.activation_checkpointing"):
        f = {**(search.flop_counts() or [search.flops(1.0)])[0], "forward": 1.0, "train_step": 1.0}
    else:
        f = {"forward": 1.0, "train_step": 1.0}
    shown = {"masker.coverage": coverage, "masker.capacity": [], **overrides}
    return {"label": label, "coverage": coverage, "max_peak_bytes": _max_peak(report), "remedy": overrides,
            "overrides": [f"masker.coverage={coverage:.6g}", "masker.capacity=[]"]
            + [f"{k}={v}" for k, v in shown.items() if not k.startswith("masker.")],
            **step_cost(report, f, overrides)}


def budget_search(cfg: DictConfig, world_size: int, pm: Any, budgets: list[int],
                  margin: float = DEFAULT_MARGIN, dry_runs: dict[tuple, Any] | None = None) -> dict[str, Any]:
    """The answer for ``budgets`` (bytes per rank), each less ``margin``: options that fit, best first,
    the search, and remedies when nothing fits. ``dry_runs``: see :class:`BudgetSearch`."""
    search = BudgetSearch(cfg, world_size, pm, dry_runs)
    usable = [int(b * (1 - margin)) for b in budgets]
    uniform = len(set(budgets)) == 1
    result: dict[str, Any] = {"budgets": budgets, "margin": margin, "usable": usable, "candidates": search.cands}
    if uniform:
        budget = usable[0]

        def at(extra: dict[str, Any], c: float) -> dict[str, Any] | None:
            return search.evaluate({**extra, "masker.coverage": c, "masker.capacity": []})

        def uniform_at(extra: dict[str, Any], known: dict[float, int] | None = None) -> tuple[float | None, dict | None]:
            return search.largest(_max_peak, budget, lambda c: at(extra, c), known)

        found: list[tuple[str, dict[str, Any], float, dict[str, Any]]] = []  # label, remedy, coverage, report
        whole = at({}, 1.0)
        if whole is not None and _max_peak(whole) <= budget:
            found.append(("the whole model (plain data parallelism)", {}, 1.0, whole))
        else:
            # The whole model with the cheapest remedy that makes it fit; costlier ones are not tried.
            for label, extra in remedies(cfg, world_size):
                rep = at(extra, 1.0)
                if rep is not None and _max_peak(rep) <= budget:
                    found.append((f"the whole model with {label}", extra, 1.0, rep))
                    break
            c, rep = uniform_at({}, {1.0: _max_peak(whole)} if whole is not None else None)
            if c is not None:
                search.flops(c)  # counted first: its full-model counts serve the options at C = 1
                found.append(("the largest coverage as configured", {}, c, rep))
        options = [_option(search, *f) for f in found]
        if options and options[-1]["coverage"] < 1:
            i = search.cands.index(options[-1]["coverage"])
            nxt = search.cands[i + 1] if i + 1 < len(search.cands) else None
            nrep = at({}, nxt) if nxt is not None else None
            options[-1].update({"next_coverage": nxt, "next_max_peak_bytes": _max_peak(nrep) if nrep else None})
        if options:
            best = options[0]
            result.update({"fits": True, "options": options, "coverage": best["coverage"], "overrides": best["overrides"],
                           "report": search.evaluate({**best["remedy"], "masker.coverage": best["coverage"], "masker.capacity": []}),
                           "max_peak_bytes": best["max_peak_bytes"]})
        else:
            result.update({"fits": False, "would_fit": _remedy_answers(cfg, world_size, search, uniform_at)})
        result["tried"] = search.tried
        return result
    # One budget per rank: each rank's own largest coverage, on the probe plan.
    R = world_size // cfg.fsdp.shard_size
    S = world_size // R
    per_replica = [min(usable[r * S:(r + 1) * S]) for r in range(R)]  # a replica's ranks hold one subnetwork
    chosen: dict[int, float | None] = {}

    def probe_peak(rep: dict[str, Any]) -> int:
        return rep["ranks"][0]["peak_memory_bytes"]

    for b in sorted(set(per_replica)):
        chosen[b] = search.largest(probe_peak, b, lambda c: search.evaluate({"masker.capacity": []}, probe_rank_coverage=c))[0]
    missing = [r for r, b in enumerate(per_replica) if chosen[b] is None]
    if missing:
        result.update({"fits": False, "ranks_without_fit": missing,
                       "would_fit": _remedy_answers(cfg, world_size, search, lambda extra, known=None: search.largest(
                           probe_peak, min(per_replica),
                           lambda c: search.evaluate({**extra, "masker.capacity": []}, probe_rank_coverage=c)))})
        result["tried"] = search.tried
        return result
    capacity = [float(chosen[b]) for b in per_replica]
    rep = search.evaluate({"masker.capacity": capacity})
    if rep is None:
        result.update({"fits": False, "capacity": capacity, "invalid": search.tried[-1].get("invalid")})
    else:
        over = [row["rank"] for row in rep["ranks"] if row["peak_memory_bytes"] > usable[row["rank"]]]
        result.update({"fits": not over, "capacity": capacity, "report": rep, "ranks_over_budget": over,
                       "overrides": ["masker.capacity=[" + ",".join(f"{c:.6g}" for c in capacity) + "]"]})
    result["tried"] = search.tried
    return result


def _remedy_answers(cfg: DictConfig, world_size: int, search: BudgetSearch,
                    at: Callable[..., tuple[float | None, dict | None]]) -> list[dict[str, Any]]:
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
    usable = result.get("usable", budgets)
    if result.get("margin"):
        planned = human_bytes(usable[0]) if len(set(usable)) == 1 else ", ".join(human_bytes(b) for b in usable)
        lines.append(f"planned to: {planned} (--margin {result['margin']:g} of each budget kept back for what the "
                     "estimate does not count: the CUDA context, the communicator's buffers, allocator fragmentation)")
        shown = planned
    for t in result["tried"]:
        what = ", ".join(f"{k}={v}" for k, v in t["overrides"].items() if k != "masker.capacity" or v)
        if t["probe"] is not None:
            what += f" (probe: one rank at coverage {t['probe']:.4g})"
        lines.append(f"  dry run {what}: " + (f"max peak {human_bytes(t['max_peak_bytes'])}" if "max_peak_bytes" in t
                                             else f"invalid ({t['invalid']})"))
    if result.get("options"):
        lines.append("options that fit, best first (the whole model when it fits, with the cheapest remedy that "
                     "makes it fit; then the largest coverage; step FLOPs against plain data parallelism's):")
        for i, o in enumerate(result["options"], 1):
            nxt = o.get("next_coverage")
            lines.append(f"  {i}. {o['label']}: {' '.join(o['overrides'])}: max peak {human_bytes(o['max_peak_bytes'])}, "
                         f"step {o['step_flops']:.2f} x the FLOPs, {human_bytes(o['bytes_per_step'])} sent per rank"
                         + (f" (the next larger coverage {nxt:.6g} needs {human_bytes(o['next_max_peak_bytes'])})"
                            if nxt is not None and o.get("next_max_peak_bytes") else ""))
    if result.get("fits"):
        if "coverage" in result:
            nxt = result.get("next_coverage")
            best = (result.get("options") or [{}])[0]
            lines.append(f"answer: " + (f"option 1, {best['label']}: " if best else "") +
                         f"masker.coverage={result['coverage']:.6g} fits every rank's {shown} (max peak "
                         f"{human_bytes(result['max_peak_bytes'])})" + (
                             f"; the next larger coverage {nxt:.6g} needs {human_bytes(result['next_max_peak_bytes'])}"
                             if nxt is not None and result.get("next_max_peak_bytes") else
                             "; it is the whole model" if result["coverage"] == 1 else ""))
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
