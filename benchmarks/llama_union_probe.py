"""Where B-SDP's validation gap on ``llama_tiny_stdlib`` comes from: the union vs its subnetworks.

Trains the recipe ``llama_tiny_stdlib`` at coverage 0.5 with 2 and with 4 gloo ranks (spawned
processes, as the test suite does), then evaluates on the same validation batches: every rank's own
subnetwork (the blocks it trained), the union model that subnetdp evaluates (every block), and the
union model with every residual branch scaled by ``s`` (0.75, 0.5) — the test-time rule of
stochastic depth, which a block-level union model never saw in training.

Run: ``.venv/bin/python benchmarks/llama_union_probe.py`` (about 7 minutes on 2 cores). Writes
``benchmarks/results/llama_union_probe.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from subnetdp.train.configure import load_config  # noqa: E402
from subnetdp.core.contracts import LaunchEnv  # noqa: E402
from subnetdp.train.loop import train_loop  # noqa: E402
from subnetdp.train.setup import setup  # noqa: E402
from subnetdp.sdp.union import assemble_union, evaluate  # noqa: E402
from tests.helpers import plugin_manager, run_ranks  # noqa: E402
from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise

RESULTS = results_dir()
SCALES = (1.0, 0.75, 0.5)


def scaled(union: torch.nn.Module, s: float) -> torch.nn.Module:
    """A copy of the union model whose blocks compute ``x + s * branch(x)`` for both branches."""
    model = copy.deepcopy(union)
    for b in model.layers.values():
        def forward(x, cos, sin, b=b):
            x = x + s * b.attention(b.attention_norm(x), cos, sin)
            return x + s * b.feed_forward(b.ffn_norm(x))
        b.forward = forward
    return model


def worker(rank: int, world: int, init_method: str, cache: str, steps: int) -> dict:
    cfg = load_config("llama_tiny_stdlib", [
        f"train.steps={steps}", f"comm.init_method={init_method}", f"data.cache_dir={cache}", "run.name=probe",
        f"run.dir={init_method.removeprefix('file://')}-runs", "train.progress=false", "eval.every=0",
        "launch.threads_per_rank=1", "train.log_every=1000"], plugin_manager().registries)
    pm = plugin_manager()
    ctx, st = setup(cfg, LaunchEnv(rank, world, rank, world, "probe"), pm)
    try:
        train_loop(ctx, st)
        out = {"owned": st.plan.owned[rank], "own_subnetwork": evaluate(copy.deepcopy(st.model), ctx.adapter, ctx.data, cfg)}
        # collective: every rank takes part in assembling the union model on rank 0.
        union = assemble_union(ctx.adapter, ctx.spec, int(cfg.seed), st.partition, st.plan, st.model,
                               st.pmap, ctx.comm)
        if union is not None:
            out["union"] = {f"branch_scale_{s:g}": evaluate(scaled(union, s), ctx.adapter, ctx.data, cfg) for s in SCALES}
        return out
    finally:
        ctx.comm.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_sizes:
            res = run_ranks(worker, world, Path(tmp), str(Path(tmp) / "data"), args.steps, timeout=1800)
            rows[world] = {"ranks": [{"owned": r["owned"], "val_loss": r["own_subnetwork"]["loss"]} for r in res],
                           "union": {k: v["loss"] for k, v in res[0]["union"].items()}}
    lines = [f"llama_tiny_stdlib, coverage 0.5, {args.steps} steps: validation loss",
             f"{'workers':>7}  {'own subnetworks (blocks: loss)':<52} " + " ".join(f"{'union x' + format(s, 'g'):>10}" for s in SCALES)]
    for world, r in rows.items():
        own = ", ".join(f"{''.join(map(str, x['owned']))}: {x['val_loss']:.3f}" for x in r["ranks"])
        lines.append(f"{world:>7}  {own:<52} " + " ".join(f"{v:>10.4f}" for v in r["union"].values()))
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "llama_union_probe.json").write_text(json.dumps({"steps": args.steps, "rows": rows, "table": table}, indent=2))
    print(f"\nwrote {RESULTS / 'llama_union_probe.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
