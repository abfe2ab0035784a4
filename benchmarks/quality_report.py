"""Tables, figures and generated verdict lines of the quality-along-training study
(``benchmarks/quality_horizon.py``), from a results folder's stored run records alone.

A row's gap to DDP is paired by seed (a seed draws both runs' initial weights and data order) and
by evaluation index: the k-th of a run's evaluations lands at k/8 of its steps, so an
iteration-matched row is compared with DDP at equal steps (equal tokens) and a FLOP-matched row at
equal training FLOPs; the figures plot it at the row's own tokens and FLOPs. Error bars: mean ±
sample standard deviation (``n - 1``) over seeds. A trend (a paired difference of gaps) is called a
change only when its two-sided 95% Student-t interval, ``mean ± t(n - 1) std / sqrt(n)``, excludes 0:
with 2 or 3 seeds that needs 12.7 or 4.3 standard errors, not 2 (the evidence study's looser rule).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BEGIN, END = "<!-- quality:begin -->", "<!-- quality:end -->"
ORDER = ["DDP", "B-SDP", "B-SDP FM", "N-SDP", "N-SDP FM", "Bb-SDP FM", "B-SDP C=0.75 FM", "B-SDP resample FM"]
Runs = dict[int, dict[str, dict[int, dict]]]  # horizon -> row -> seed -> record


def load(folder: Path) -> Runs:
    out: Runs = {}
    for path in sorted((folder / "runs").glob("h*/*.json")):
        rec = json.loads(path.read_text())
        out.setdefault(int(rec["horizon"]), {}).setdefault(rec["row"], {})[int(rec["seed"])] = rec
    return out


def stats(xs: list[float]) -> tuple[float, float, int]:
    """Mean, sample std (nan below 2 values) and count."""
    if not xs:
        return float("nan"), float("nan"), 0
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else float("nan"), len(xs)


def fmt(m: float, s: float, n: int, digits: int = 3, sign: bool = True) -> str:
    if n == 0 or math.isnan(m):
        return "n/a"
    head = f"{m:+.{digits}f}" if sign else f"{m:.{digits}f}"
    return f"{head} ± {s:.{digits}f}" if n > 1 else head


def losses(rec: dict) -> list[float]:
    return [p["loss"] for p in sorted(rec["curve"], key=lambda p: p["step"])]


def paired_gaps(row: dict[int, dict], ddp: dict[int, dict]) -> list[dict[int, float]]:
    """For every evaluation index, seed -> the row's loss minus DDP's (seeds both have)."""
    seeds = sorted(set(row) & set(ddp))
    n = min((min(len(losses(row[s])), len(losses(ddp[s]))) for s in seeds), default=0)
    return [{s: losses(row[s])[k] - losses(ddp[s])[k] for s in seeds} for k in range(n)]


def best_flop_matched(rows: dict[str, dict[int, dict]]) -> str | None:
    """The FLOP-matched row with the smallest mean paired gap at its last evaluation."""
    if "DDP" not in rows:
        return None
    ends = {}
    for name, recs in rows.items():
        if next(iter(recs.values()))["flop_matched"]:
            gaps = paired_gaps(recs, rows["DDP"])
            if gaps and gaps[-1]:
                ends[name] = statistics.fmean(gaps[-1].values())
    return min(ends, key=ends.get) if ends else None


def ordered(rows: dict[str, Any]) -> list[str]:
    return [r for r in ORDER if r in rows] + sorted(r for r in rows if r not in ORDER)


def end_table(horizon: int, rows: dict[str, dict[int, dict]]) -> list[str]:
    """Per row at the end of the run: loss, paired gap, compute, wall time and load."""
    ddp = rows.get("DDP", {})
    out = [f"#### Horizon {horizon} DDP steps: the end of every run", "",
           "| row | seeds | steps | tokens seen | training FLOPs / DDP's | val loss | gap to DDP (paired) "
           "| wall min (sum) | load avg 1 min (start-end, range) |", "|---|---|---|---|---|---|---|---|---|"]
    for name in ordered(rows):
        recs = rows[name]
        first = next(iter(recs.values()))
        end = [losses(r)[-1] for r in recs.values()]
        gaps = paired_gaps(recs, ddp) if name != "DDP" and ddp else []
        gap = fmt(*stats(list(gaps[-1].values()))) if gaps else "-"
        loads = [x for r in recs.values() for x in (r["load_avg_start"][0], r["load_avg_end"][0])]
        ddp_flops = ddp and next(iter(ddp.values()))["curve"][-1]["train_flops"]
        rel = first["curve"][-1]["train_flops"] / ddp_flops if ddp_flops else float("nan")
        out.append(f"| {name} | {', '.join(map(str, sorted(recs)))} | {first['steps']} | "
                   f"{first['curve'][-1]['tokens'] / 1e6:.2f} M | {rel:.3f} | {fmt(*stats(end), digits=4, sign=False)} "
                   f"| {gap} | {sum(r['wall_s'] for r in recs.values()) / 60:.1f} "
                   f"| {min(loads):.1f}-{max(loads):.1f} |")
    return out + [""]


def gap_table(horizon: int, rows: dict[str, dict[int, dict]]) -> tuple[list[str], dict[str, list]]:
    """Per row, the paired gap at each evaluation (k/8 of the run) and the change from 4/8 to 8/8."""
    ddp = rows.get("DDP")
    if not ddp:
        return [], {}
    all_gaps = {name: paired_gaps(rows[name], ddp) for name in ordered(rows) if name != "DDP"}
    n = max((len(g) for g in all_gaps.values()), default=0)
    out = [f"#### Horizon {horizon}: gap to DDP along the run (validation loss, row minus DDP, paired by seed)", "",
           "| row | " + " | ".join(f"{k + 1}/{n}" for k in range(n)) + f" | {n}/{n} minus {n // 2}/{n} |",
           "|---|" + "---|" * (n + 1)]
    for name, gaps in all_gaps.items():
        cells = [fmt(*stats(list(g.values()))) for g in gaps] + ["n/a"] * (n - len(gaps))
        out.append(f"| {name} | " + " | ".join(cells) + f" | {fmt(*trend(gaps))} |")
    return out + [""], all_gaps


def trend(gaps: list[dict[int, float]]) -> tuple[float, float, int]:
    """The gap at the last evaluation minus the gap at the middle one, paired by seed."""
    if len(gaps) < 2:
        return float("nan"), float("nan"), 0
    mid, last = gaps[len(gaps) // 2 - 1], gaps[-1]
    return stats([last[s] - mid[s] for s in last if s in mid])


T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]  # t(0.975, dof 1..10)


def called(m: float, s: float, n: int, up: str, down: str) -> str:
    """The paired change, its 95% t-interval and ``up``/``down``/holds: a change only if it excludes 0."""
    if n < 2 or math.isnan(s):
        return f"{fmt(m, s, n)} (n = {n}, no error bar): indicative only"
    half = (T975[n - 2] if n - 2 < len(T975) else 1.96) * s / math.sqrt(n)
    word = "holds" if abs(m) <= half else up if m > 0 else down
    return f"{fmt(m, s, n)} (paired, n = {n}; 95% interval {m - half:+.3f} to {m + half:+.3f}): **{word}**"


def breakdown_table(runs: Runs) -> list[str]:
    out = []
    for horizon, rows in sorted(runs.items()):
        for name in ordered(rows):
            pairs = [(r["eval_union"]["union_x1"]["loss"], r["eval_union"]["union_rescaled"]["loss"])
                     for r in rows[name].values() if "union_x1" in r.get("eval_union", {})]
            if pairs:
                x1, rescaled = [a for a, _ in pairs], [b for _, b in pairs]
                out.append(f"| {horizon} | {name} | {fmt(*stats(x1), 4, False)} | {fmt(*stats(rescaled), 4, False)} | "
                           f"{fmt(*stats([a - b for a, b in pairs]), 4)} |")
    if not out:
        return []
    return ["#### The block-level union at x1 and rescaled, at the last evaluation (same batches, same model)", "",
            "| horizon | row | union x1 | union rescaled | x1 minus rescaled (paired) |", "|---|---|---|---|---|",
            *out, ""]


def horizon_table(runs: Runs) -> tuple[list[str], list[str]]:
    """Rows run at two horizons: the gap at the end of each, and its change, paired by seed."""
    if len(runs) < 2:
        return [], []
    (h1, a), (h2, b) = sorted(runs.items())[:2]
    out, lines = [], []
    for name in ordered(b):
        if name == "DDP" or name not in a or "DDP" not in a or "DDP" not in b:
            continue
        g1, g2 = paired_gaps(a[name], a["DDP"]), paired_gaps(b[name], b["DDP"])
        if not g1 or not g2:
            continue
        change = stats([g2[-1][s] - g1[-1][s] for s in g2[-1] if s in g1[-1]])
        out.append(f"| {name} | {fmt(*stats(list(g1[-1].values())))} | {fmt(*stats(list(g2[-1].values())))} | "
                   f"{fmt(*change)} |")
        lines.append(f"- **{name}, {h1} to {h2} DDP steps** (ends of runs, both annealed): the gap changes by "
                     f"{called(*change, 'grows', 'shrinks')}.")
    if not out:
        return [], []
    return ([f"#### The gap at the end of a {h1}- and a {h2}-step horizon", "",
             f"| row | gap at {h1} | gap at {h2} | change (paired) |", "|---|---|---|---|", *out, ""], lines)


def verdict_lines(horizon: int, all_gaps: dict[str, list]) -> list[str]:
    out = []
    for name, gaps in all_gaps.items():
        if not gaps:
            continue
        n = len(gaps)
        at = lambda k: fmt(*stats(list(gaps[k].values())))  # noqa: E731
        tr = trend(gaps)
        out.append(f"- **{name}, horizon {horizon}**: gap to DDP {at(0)} at 1/{n}, {at(n // 2 - 1)} at {n // 2}/{n}, "
                   f"{at(n - 1)} at {n}/{n} of the run; from {n // 2}/{n} to {n}/{n} it changes by "
                   f"{called(*tr, 'grows', 'shrinks')}.")
    return out


def figure(path: Path, horizon: int, rows: dict[str, dict[int, dict]], names: list[str], title: str) -> None:
    """Validation loss and paired gap to DDP against tokens seen and training FLOPs, mean ± std bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex="col")
    for c, name in enumerate(names):
        recs = rows[name]
        first = next(iter(recs.values()))
        curve = sorted(first["curve"], key=lambda p: p["step"])
        style = {"linestyle": "--" if first["flop_matched"] else "-", "marker": ".", "color": f"C{c}"}
        by_k = [[losses(r)[k] for r in recs.values() if len(losses(r)) > k] for k in range(len(curve))]
        bands = [("loss", by_k)]
        if name != "DDP" and "DDP" in rows:
            bands.append(("gap", [list(g.values()) for g in paired_gaps(recs, rows["DDP"])]))
        for i, (_, series) in enumerate(bands):
            ms = [stats(v) for v in series]
            mean = [m for m, _, _ in ms]
            sd = [s if n > 1 else 0.0 for _, s, n in ms]
            for j, key in enumerate(("tokens", "train_flops")):
                x = [p[key] for p in curve[: len(mean)]]
                ax = axes[i][j]
                ax.plot(x, mean, label=f"{name} (n={len(recs)})", **style)
                ax.fill_between(x, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                                alpha=0.15, color=f"C{c}")
    for j, xlabel in enumerate(("tokens seen (all ranks)", "training FLOPs (forward + backward, all ranks)")):
        axes[1][j].set_xlabel(xlabel)
        axes[1][j].axhline(0, color="black", linewidth=0.8)
    axes[0][0].set_ylabel("validation loss (union model)")
    axes[1][0].set_ylabel("gap to DDP (row - DDP, paired)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=7)
    fig.suptitle(f"{title}: horizon {horizon} DDP steps, mean ± std over seeds; evaluations at k/8 of each run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figures(runs: Runs, where: Path) -> list[str]:
    names = []
    for horizon, rows in sorted(runs.items()):
        part1 = [r for r in ordered(rows) if next(iter(rows[r].values()))["part"] == 1]
        part2 = [r for r in ordered(rows) if next(iter(rows[r].values()))["part"] == 2]
        sets = [(f"quality_h{horizon}.png", part1, "DDP and the SDP variants")]
        if part2:
            ref = [r for r in ("DDP", "B-SDP FM") if r in rows]
            sets.append((f"quality_h{horizon}_recipes.png", ref + part2, "What might narrow the gap"))
        for file, rows_in, title in sets:
            figure(where / file, horizon, rows, rows_in, title)
            names.append(file)
    return names


def write_report(folder: Path, docs: Path | None = None) -> str:
    """``folder/report.md`` and the figures; with ``docs``, figures beside it and the report spliced in."""
    runs = load(folder)
    meta = json.loads((folder / "meta.json").read_text()) if (folder / "meta.json").is_file() else {}
    sittings = meta.get("sittings", [])
    long_horizon = (f"long horizon {meta['long_horizon']} steps, seeds {meta.get('long_seeds')}, row "
                    f"{meta.get('long_row', 'not chosen yet')}" if meta.get("long_horizon") else "no long horizon")
    body = [f"Results folder `{folder.name}`: task {meta.get('task')}, AdamW lr {meta.get('lr')}, FLOP matching on "
            f"{meta.get('match_on')} FLOPs, seeds {meta.get('seeds')} ({long_horizon}), {len(sittings)} sitting(s), "
            f"{sum(s.get('wall_s', 0.0) for s in sittings) / 3600:.2f} h of wall time."
            + ("" if meta.get("finished", True) else " **Incomplete: the study had not finished when this was"
                                                     " rendered.**"),
            "", "Points inside a run are at that point's learning rate (cosine to 0 at the last step); "
            "only the last evaluation of a run is annealed. A row's gap to DDP is paired by seed and by evaluation "
            "index: at equal steps (tokens) for iteration-matched rows, at equal training FLOPs for FLOP-matched "
            "(FM) rows; the figures plot it at the row's own tokens and FLOPs.", ""]
    verdicts = []
    for horizon, rows in sorted(runs.items()):
        body += end_table(horizon, rows)
        table, all_gaps = gap_table(horizon, rows)
        body += table
        verdicts += verdict_lines(horizon, all_gaps)
    table, lines = horizon_table(runs)
    body += table + breakdown_table(runs)
    verdicts += lines
    where = docs.parent if docs is not None else folder
    names = figures(runs, where) if runs else []
    body += [f"![{n}]({n})" for n in names] + [""]
    body += ["#### Generated trend lines (from the tables above)", "", *verdicts]
    text = "\n".join(body)
    (folder / "report.md").write_text(text + "\n")
    if docs is not None:
        doc = docs.read_text() if docs.is_file() else ""
        if BEGIN in doc and END in doc:
            head, rest = doc.split(BEGIN, 1)
            doc = f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}"
        else:
            doc += f"\n{BEGIN}\n{text}\n{END}\n"
        docs.write_text(doc)
    print(text)
    return text
