"""Per-rank peak memory of one LLaMA training step: DDP vs block- and neuron-level SDP, at 134M, 500M and 1B.

For every variant, at the micro-batch and sequence length of its recipe
(``configs/recipes/llama_*_fineweb.yaml``) and the recipe's 8 workers, this builds rank 0's model —
the full model for DDP (coverage 1), the materialised subnetwork of the cyclic plan for B-SDP at
coverage 0.69 and 0.5 and for N-SDP at 0.5 (8 SwiGLU hidden ranges per layer, narrowed MLPs) — and measures a steady-state training step (forward, backward, AdamW step;
gradients persist between steps, as DDP's ``gradient_as_bucket_view`` and subnetdp's buckets keep
them, and the loop's own OwnerGroupAverager runs over a counting communicator) with subnetdp's dispatch-level ``TensorMemoryTracker`` under ``FakeTensorMode``: every tensor
torch would allocate is counted, nothing is allocated, so 1B models measure on a laptop CPU.
Peak = parameters + gradients + AdamW state + the step's transient tensors (activations, logits).
Not counted: the CUDA caching allocator's fragmentation, NCCL's buffers, the CUDA context.

Run: ``.venv/bin/python benchmarks/llama_memory.py`` (about a minute). Writes
``benchmarks/results/llama_memory.json`` and prints a table.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from subnetdp.train.configure import load_config
from subnetdp.plan.dryrun import DryRunCommunicator
from subnetdp.core.contracts import DataSpec
from subnetdp.parallel.memory import TensorMemoryTracker, live_state_bytes, training_state_tensors
from subnetdp.train.optim import build_optimizer
from subnetdp.core.plan import make_plan
from subnetdp.core.plugins import PluginManager
from subnetdp.sdp.sync import OwnerGroupAverager
from _results import results_dir  # benchmarks/_results.py: ./bench-results unless told otherwise

RESULTS = results_dir()
GiB = 2**30
VARIANTS = ("134m", "500m", "1b")
COVERAGES = ((1.0, "block"), (0.69, "block"), (0.5, "block"), (0.5, "neuron"))
REPORTED = {("1b", 0.69, "B-SDP"): -0.28, ("500m", 0.5, "B-SDP"): -0.40}  # the method's reported peak-memory change vs DDP


def measure(variant: str, coverage: float, pm: PluginManager, granularity: str = "block") -> dict:
    """Rank 0's peak tensor memory for one steady-state step of the recipe of ``variant``."""
    cfg = load_config(f"llama_{variant}_fineweb", [f"masker.coverage={coverage}"], pm.registries)
    world, batch, seq = int(cfg.launch.nproc), int(cfg.train.batch_size), int(cfg.data.seq_len)
    spec = DataSpec(vocab_size=32_000, seq_len=seq)
    adapter = pm.get("model", "llama")(cfg.model)
    masker = pm.get("masker", cfg.masker.name)(cfg.masker)
    with FakeTensorMode(allow_non_fake_inputs=True):
        full = adapter.build(spec)
        if granularity == "neuron":
            partition = adapter.partition(full, "neuron", spec, units_per_layer=8)
            plan = make_plan(masker, partition, world, int(cfg.seed), 1)
            model, pmap = adapter.materialize(full, plan.owned[0], partition, rescale=True)
        else:
            partition = adapter.partition(full, "block", spec)
            plan = make_plan(masker, partition, world, int(cfg.seed), 1)
            model, pmap = adapter.materialize(full, plan.owned[0], partition)
        del full
        optimizer = build_optimizer(cfg.optim, model.parameters())
        # The loop's own synchroniser (its buckets are part of a rank's memory: views of the gradients
        # at block level, per-step copies of the sliced gradients at neuron level); the dry run's
        # communicator only counts what it is handed.
        averager = OwnerGroupAverager(model, pmap, plan, partition, DryRunCommunicator(0, world))
        tokens = torch.zeros(batch, seq, dtype=torch.int64)
        data = (tokens, tokens)

        def step() -> None:
            adapter.loss(model(adapter.inputs(data)), data).backward()
            averager.finish()
            optimizer.step()

        averager.prepare()
        step()  # creates gradients and AdamW state, as the first real step does
        averager.prepare()  # as the loop: last step's gradients dropped before the baseline
        state = training_state_tensors(model, optimizer, averager.state_tensors())
        baseline = live_state_bytes(state)
        t0 = time.perf_counter()
        with TensorMemoryTracker(baseline) as tracker:
            step()
        seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    return {"variant": variant, "mode": "DDP" if coverage == 1 else ("N-SDP" if granularity == "neuron" else "B-SDP"), "coverage": coverage,
            "blocks_held": len(plan.owned[0]), "blocks": plan.num_units, "workers": world,
            "micro_batch": batch, "seq_len": seq, "params_held": params,
            "full_params": partition.shared_numel() + sum(partition.unit_numel(u) for u in partition.units),
            "state_bytes": baseline, "peak_bytes": tracker.peak, "transient_bytes": tracker.peak - baseline,
            "measure_s": seconds}


def main() -> int:
    pm = PluginManager()
    rows = []
    for variant in VARIANTS:
        ddp = None
        for c, granularity in COVERAGES:
            r = measure(variant, c, pm, granularity)
            ddp = ddp or r
            r["ratio_to_ddp"] = r["peak_bytes"] / ddp["peak_bytes"]
            r["reported_change"] = REPORTED.get((variant, c, r["mode"]))
            rows.append(r)
    head = (f"{'variant':>7} {'mode':>5} {'C':>5} {'units':>7} {'batch x seq':>11} {'params held':>13} "
            f"{'state GiB':>9} {'transient':>9} {'peak GiB':>8} {'vs DDP':>7} {'reported':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rep = f"{r['reported_change']:+.0%}" if r["reported_change"] is not None else ""
        lines.append(f"{r['variant']:>7} {r['mode']:>5} {r['coverage']:>5g} {r['blocks_held']:>3}/{r['blocks']:<3} "
                     f"{r['micro_batch']:>4} x {r['seq_len']:<4} {r['params_held']:>13,} {r['state_bytes'] / GiB:>9.2f} "
                     f"{r['transient_bytes'] / GiB:>9.2f} {r['peak_bytes'] / GiB:>8.2f} {r['ratio_to_ddp'] - 1:>+7.1%} {rep:>8}")
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "llama_memory", "command": " ".join([Path(sys.executable).name] + sys.argv),
           "measured_by": "subnetdp TensorMemoryTracker under FakeTensorMode (CPU; fp32; tensors only)",
           "torch": torch.__version__, "platform": platform.platform(), "rows": rows, "table": table}
    (RESULTS / "llama_memory.json").write_text(json.dumps(out, indent=2))
    print(f"\nwrote {RESULTS / 'llama_memory.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
