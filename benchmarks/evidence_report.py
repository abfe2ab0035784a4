"""Tables, plots and verdicts of the evidence study, from a results folder of ``benchmarks/evidence.py``.

Error bars: mean ± sample standard deviation (``n - 1``) over the seeds of a row. A comparison of
two rows uses the standard error of the difference of their means, ``sqrt(s_a^2/n_a + s_b^2/n_b)``:
a claim that SDP "keeps quality" is *held* when SDP is better, or worse by at most 2 standard errors
(the difference is not distinguishable from seed noise), and *did not hold* when it is worse by more.
With one seed there is no error bar, and the verdict says so.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.evidence_tasks import TASKS  # noqa: E402

BEGIN, END = "<!-- evidence:begin -->", "<!-- evidence:end -->"
ORDER = ["DDP", "DDP+SD", "DDP+HD", "B-SDP", "B-SDP FM", "N-SDP", "N-SDP FM", "Bb-SDP", "Bb-SDP FM",
         "Nb-SDP", "Nb-SDP FM", "DDP+AC", "FSDP+AC"]
MiB = 2 ** 20


def _stats(xs: list[float]) -> tuple[float, float, int]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan"), 0
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else float("nan"), len(xs)


def load(folder: Path) -> dict[str, dict[str, list[dict]]]:
    """task -> row -> the run records (one per seed)."""
    out: dict[str, dict[str, list[dict]]] = {}
    for path in sorted((folder / "runs").glob("*/*.json")):
        if path.name == "flops.json":
            continue
        rec = json.loads(path.read_text())
        out.setdefault(rec["task"], {}).setdefault(rec["row"], []).append(rec)
    return out


def summarise(recs: list[dict], metric: str) -> dict[str, Any]:
    m, s, n = _stats([r["eval"].get(metric, float("nan")) for r in recs])
    return {"mean": m, "std": s, "n": n, "seeds": sorted(r["seed"] for r in recs), "steps": recs[0]["steps"],
            "flops": recs[0]["flops"].get("forward", float("nan")),
            "train_flops": recs[0]["flops"].get("train_step", float("nan")),
            "mem": statistics.fmean(max(r["peak_memory_bytes"]) for r in recs) / MiB,
            "params": max(recs[0]["params_held"]) / recs[0]["full_model_params"],
            "bytes": statistics.fmean(statistics.fmean(r["bytes_sent_per_step"]) for r in recs) / MiB,
            # rank 0's: the other ranks' steps after an evaluation include waiting for rank 0 to evaluate
            "step_ms": statistics.fmean(r["step_time_s"][0] or float("nan") for r in recs) * 1000,
            "wall": sum(r["wall_s"] for r in recs), "memory_only": recs[0].get("memory_only", False),
            "command": recs[0]["command"], "owned": recs[0]["owned_units"]}


def _fmt(m: float, s: float, n: int, digits: int = 4) -> str:
    if n == 0 or math.isnan(m):
        return "n/a"
    return f"{m:.{digits}f} ± {s:.{digits}f}" if n > 1 else f"{m:.{digits}f}"


def compare(a: dict, b: dict, higher: bool) -> tuple[str, float, float]:
    """(verdict, signed advantage of a over b, standard error); advantage > 0 means a is better."""
    d = (a["mean"] - b["mean"]) * (1 if higher else -1)
    if a["n"] < 2 or b["n"] < 2:
        return ("indicative only (one seed, no error bar): " + ("better" if d > 0 else "equal" if d == 0 else "worse")), d, float("nan")
    se = math.sqrt(a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"])
    if d >= 0:
        return "held (better)" if d > 2 * se else "held (within 2 standard errors)", d, se
    return ("held (within 2 standard errors)" if -d <= 2 * se else "did not hold (worse by more than 2 standard errors)"), d, se


def task_tables(task_name: str, rows: dict[str, list[dict]]) -> tuple[list[str], dict[str, dict]]:
    task = TASKS[task_name]
    summ = {row: summarise(recs, task.metric) for row, recs in rows.items()}
    ddp = summ.get("DDP")
    lines = [f"### {task_name}: {task.description}", "",
             f"| row | steps | fwd FLOPs/step vs DDP | train FLOPs/step vs DDP | val {task.metric} (mean ± std) | seeds | "
             f"vs DDP | params/rank | peak MiB/rank | MiB sent/step | ms/step (rank 0) |", "|" + "---|" * 11]
    for row in [r for r in ORDER if r in summ]:
        s = summ[row]
        quality = "memory/bytes only" if s["memory_only"] else _fmt(s["mean"], s["std"], s["n"])
        delta = "" if s["memory_only"] or ddp is None or row == "DDP" else f"{s['mean'] - ddp['mean']:+.4f}"
        lines.append(f"| {row} | {s['steps']} | {s['flops']:.3f} | {s['train_flops']:.3f} | {quality} | "
                     f"{','.join(map(str, s['seeds']))} | {delta} | {s['params']:.1%} | {s['mem']:.1f} | "
                     f"{s['bytes']:.2f} | {s['step_ms']:.0f} |")
    lines.append("")
    return lines, summ


def breakdown_table(task_name: str, rows: dict[str, list[dict]]) -> list[str]:
    task = TASKS[task_name]
    out = []
    for row in ("B-SDP", "B-SDP FM"):
        recs = [r for r in rows.get(row, []) if r.get("eval_union", {}).get("union_x1")]
        if not recs:
            continue
        x1 = _stats([r["eval_union"]["union_x1"][task.metric] for r in recs])
        sc = _stats([r["eval_union"]["union_rescaled"][task.metric] for r in recs])
        own = _stats([statistics.fmean(o["metrics"][task.metric] for o in r["eval_union"]["own_subnetworks"]) for r in recs])
        best = _stats([(max if task.higher_is_better else min)(o["metrics"][task.metric]
                                                                for o in r["eval_union"]["own_subnetworks"]) for r in recs])
        out.append(f"| {task_name} {row} | {_fmt(*x1)} | {_fmt(*sc)} | {_fmt(*own)} | {_fmt(*best)} |")
    return out


def alignment_table(task_name: str, rows: dict[str, list[dict]]) -> tuple[list[str], dict[str, float]]:
    out, means = [], {}
    for row in ("B-SDP", "N-SDP", "Bb-SDP", "Nb-SDP"):
        recs = rows.get(row, [])
        points: dict[int, list[float]] = {}
        for r in recs:
            for a in r.get("grad_alignment", []):
                points.setdefault(a["step"], []).append(a["cosine"])
        if not points:
            continue
        allc = [c for cs in points.values() for c in cs]
        means[row] = statistics.fmean(allc)
        cells = ", ".join(f"{step}: {statistics.fmean(cs):.3f}" for step, cs in sorted(points.items()))
        out.append(f"| {task_name} | {row} | {cells} | {means[row]:.3f} |")
    return out, means


def verdicts(task_name: str, summ: dict[str, dict], align: dict[str, float], rows: dict[str, list[dict]]) -> list[str]:
    task = TASKS[task_name]
    hib = task.higher_is_better
    ddp = summ.get("DDP")
    lines = [f"**{task_name}**", ""]
    if ddp is None:
        return lines + ["- no DDP run: nothing to compare", ""]

    def claim(text: str, a: str, b: str) -> None:
        if a in summ and b in summ:
            v, d, se = compare(summ[a], summ[b], hib)
            se_s = "" if math.isnan(se) else f", standard error {se:.4f}"
            lines.append(f"- {text}: **{v}** ({a} {summ[a]['mean']:.4f} vs {b} {summ[b]['mean']:.4f}, "
                         f"{task.metric}, "
                         f"advantage {d:+.4f}{se_s})")

    for v in ("B-SDP", "N-SDP", "Bb-SDP", "Nb-SDP"):
        claim(f"{v} keeps DDP's quality at the same number of steps", v, "DDP")
    for v in ("B-SDP", "N-SDP", "Bb-SDP", "Nb-SDP"):
        if f"{v} FM" in summ:
            claim(f"{v} keeps DDP's quality FLOP-matched ({summ[v + ' FM']['steps']} steps, forward-FLOPs ratio "
                  f"{summ[v]['flops']:.3f})", f"{v} FM", "DDP")
        elif v in summ:
            lines.append(f"- {v} FLOP-matched: the measured forward-FLOPs ratio is {summ[v]['flops']:.3f}, so the "
                         "FLOP-matched run is the iteration-matched one")
    claim("B-SDP matches or beats DDP with stochastic depth at the same keep rate", "B-SDP", "DDP+SD")
    claim("N-SDP matches or beats DDP with hidden-channel dropout at the same keep rate", "N-SDP", "DDP+HD")
    mem = [(v, summ[v]["mem"] / ddp["mem"]) for v in ("B-SDP", "N-SDP", "Bb-SDP", "Nb-SDP", "DDP+AC", "FSDP+AC") if v in summ]
    if mem:
        lines.append("- Peak memory per rank below DDP's (measured, tensors only): "
                     + ", ".join(f"{v} x{r:.2f}" for v, r in mem) + " — **"
                     + ("held" if all(r < 0.99 for v, r in mem if "SDP" in v and not v.startswith("F")) else "did not hold for every variant")
                     + "** for the SDP variants")
    byt = [(v, summ[v]["bytes"] / ddp["bytes"]) for v in ("B-SDP", "N-SDP", "Bb-SDP", "Nb-SDP") if v in summ and ddp["bytes"]]
    if byt:
        lines.append("- Bytes per step below DDP's: " + ", ".join(f"{v} x{r:.2f}" for v, r in byt)
                     + " — **" + ("held" if all(r < 1 for _, r in byt) else "did not hold for every variant") + "**"
                     + " (backward masking adds the refresh broadcasts)")
    sdp = [(v, summ[v]["mean"]) for v in ("B-SDP", "N-SDP", "Bb-SDP", "Nb-SDP") if v in summ]
    if sdp:
        best = (max if hib else min)(sdp, key=lambda t: t[1])
        lines.append(f"- Block-level forward masking trains best among the variants (same steps): **"
                     f"{'held' if best[0] == 'B-SDP' else 'did not hold'}** (best: {best[0]} {best[1]:.4f})")
    if align:
        pairs = [(f, b) for f, b in (("B-SDP", "Bb-SDP"), ("N-SDP", "Nb-SDP")) if f in align and b in align]
        if pairs:
            ok = all(align[b] > align[f] for f, b in pairs)
            lines.append("- Backward masking has gradients more aligned with DDP's (mean cosine over probe steps and "
                         "seeds): **" + ("held" if ok else "did not hold") + "** ("
                         + ", ".join(f"{b} {align[b]:.3f} vs {f} {align[f]:.3f}" for f, b in pairs) + ")")
    recs = [r for r in rows.get("B-SDP", []) if r.get("eval_union", {}).get("union_x1")]
    if recs:
        x1 = _stats([r["eval_union"]["union_x1"][task.metric] for r in recs])
        sc = _stats([r["eval_union"]["union_rescaled"][task.metric] for r in recs])
        a, b = {"mean": sc[0], "std": sc[1], "n": sc[2]}, {"mean": x1[0], "std": x1[1], "n": x1[2]}
        v, d, se = compare(a, b, hib)
        lines.append(f"- The rescaled block-level union is at least as good as the union at x1 (B-SDP): **{v}** "
                     f"(rescaled {sc[0]:.4f} vs x1 {x1[0]:.4f}, {task.metric})")
    lines.append("")
    return lines


def plots(folder: Path, data: dict[str, dict[str, list[dict]]], summs: dict[str, dict[str, dict]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for task_name, rows in data.items():
        task = TASKS[task_name]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for row in [r for r in ORDER if r in rows and not summs[task_name][r]["memory_only"]]:
            recs = rows[row]
            steps = sorted({s for r in recs for s, _ in r["curve"]})
            ratio = recs[0]["flops"].get("forward", 1.0)
            mean, lo, hi = [], [], []
            for s in steps:
                vals = [v for r in recs for st, v in r["curve"] if st == s]
                m, sd, n = _stats(vals)
                mean.append(m)
                lo.append(m - (sd if n > 1 else 0))
                hi.append(m + (sd if n > 1 else 0))
            x = [s * ratio for s in steps]
            (line,) = ax.plot(x, mean, marker=".", label=f"{row} (n={len(recs)})",
                              linestyle="--" if row.endswith("FM") else "-")
            ax.fill_between(x, lo, hi, alpha=0.15, color=line.get_color())
        ax.set_xlabel("compute: steps x forward-FLOPs ratio (DDP steps)")
        ax.set_ylabel(f"validation {task.metric} (union model)")
        ax.set_title(f"{task_name}: mean ± std over seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        name = f"{task_name}_curves.png"
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
        names.append(name)
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        order = [r for r in ORDER if r in summs[task_name] and not r.endswith("FM")]
        axes[0].bar(order, [summs[task_name][r]["mem"] for r in order], color="tab:blue")
        axes[0].set_ylabel("peak MiB per rank (max over ranks)")
        axes[1].bar(order, [summs[task_name][r]["bytes"] for r in order], color="tab:orange")
        axes[1].set_ylabel("MiB sent per step per rank")
        for a in axes:
            a.tick_params(axis="x", rotation=60, labelsize=7)
            a.grid(alpha=0.3, axis="y")
        fig.suptitle(f"{task_name}: measured memory and bytes")
        fig.tight_layout()
        name = f"{task_name}_memory_bytes.png"
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
        names.append(name)
    return names


def write_report(folder: Path, docs: Path | None = None) -> str:
    """Write ``folder/report.md`` and the plots; with ``docs``, splice the report into that file."""
    data = load(folder)
    meta = json.loads((folder / "meta.json").read_text()) if (folder / "meta.json").is_file() else {}
    body = [f"Results folder: `{folder}`; " + (f"{'--quick' if meta.get('quick') else 'full study'}, seeds "
            f"{meta.get('seeds')}, started {meta.get('started')}, wall time of the last invocation "
            f"{meta.get('wall_s', float('nan')) / 60:.1f} min (all invocations {meta.get('wall_s_total', float('nan')) / 60:.1f} min), "
            f"{meta.get('cpus')} CPUs." if meta else "")
            + ("" if meta.get("finished", True) else " **Incomplete: the study was still running when this report was made.**"), ""]
    summs, aligns, ver, brk, ali = {}, {}, [], [], []
    for task_name, rows in data.items():
        lines, summ = task_tables(task_name, rows)
        body += lines
        summs[task_name] = summ
        b = breakdown_table(task_name, rows)
        brk += b
        a, means = alignment_table(task_name, rows)
        ali += a
        aligns[task_name] = means
    masks = []
    for task_name, rows in data.items():
        for row in ("B-SDP", "N-SDP", "Bb-SDP", "Nb-SDP"):
            if row in summs[task_name]:
                owned = summs[task_name][row]["owned"]
                masks.append(f"| {task_name} | {row} | " + "; ".join(f"rank {r}: {_ranges(u)}" for r, u in enumerate(owned)) + " |")
    if masks:
        body += ["#### Masks used (cyclic masker, unit ids of `plan.json` per rank; the same for every seed)", "",
                 "| task | variant | owned units |", "|---|---|---|", *masks, ""]
    if brk:
        body += ["#### Block-level union: x1, rescaled, and the ranks' own subnetworks (same validation batches)", "",
                 "| run | union x1 | union rescaled | own subnetworks (mean) | best own subnetwork |", "|---|---|---|---|---|",
                 *brk, ""]
    if ali:
        body += ["#### Gradient alignment: cosine of SDP's averaged gradient with the full-batch DDP gradient", "",
                 "| task | variant | step: cosine (mean over seeds) | mean |", "|---|---|---|---|", *ali, ""]
    for task_name, rows in data.items():
        ver += verdicts(task_name, summs[task_name], aligns[task_name], rows)
    names = plots(folder, data, summs) if data else []
    rel = (lambda n: f"{folder}/{n}") if docs is None else (lambda n: _relpath(folder / n, docs.parent))
    body += [f"![{n}]({rel(n)})" for n in names] + [""]
    body += ["#### Verdicts (generated from the results above)", "", *ver]
    text = "\n".join(body)
    (folder / "report.md").write_text(text + "\n")
    if docs is not None:
        doc = docs.read_text()
        if BEGIN in doc and END in doc:
            head, rest = doc.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
            docs.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
        else:
            docs.write_text(doc + f"\n{BEGIN}\n{text}\n{END}\n")
    print(text)
    return text


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out, start, prev = [], None, None
    for i in sorted(ids):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


def _relpath(target: Path, start: Path) -> str:
    import os

    return os.path.relpath(target.resolve(), start.resolve())
