"""``subnetdp.parallelize`` in a user's loop: its step time against DDP at C = 1, and what a rank holds at C = 0.5.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/own_loop.py --steps 20

1. Step time: the GPT of ``examples/own_loop.py`` wrapped at C = 1 and the same model under torch's
   ``DistributedDataParallel``, stepped in alternation (one step of each, same batch, same load on
   this shared machine); the figure is the median over steps of the paired ratio (wrapper / DDP,
   the slower rank's time), after 3 warm-up steps.
2. Memory: a Hugging Face ``LlamaForCausalLM`` (8 decoder layers, hidden 256) wrapped at C = 0.5 and
   at C = 1: parameters held per rank, and the peak tensor memory of building it and two AdamW steps
   (:class:`subnetdp.parallel.memory.TensorMemoryTracker`, which counts every storage torch allocates).

Writes ``RESULTS/own_loop.json`` (``benchmarks/_results.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import subnetdp
from subnetdp.parallel.memory import TensorMemoryTracker

HERE = Path(__file__).resolve().parent


def _example():
    spec = importlib.util.spec_from_file_location("own_loop", HERE.parent / "examples" / "own_loop.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _timed_step(model, opt, x, y) -> float:
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    (model.clip_grad_norm_(1.0) if hasattr(model, "clip_grad_norm_")
     else torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    opt.zero_grad()
    slowest = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # collective: every rank, after each timed step
    return float(slowest)


def step_ratio(steps: int) -> dict:
    ex = _example()
    with torch.device("meta"):
        meta = ex.GPT()
    sdp = subnetdp.parallelize(meta, units="blocks.*", coverage=1.0, seed=0, skip="identity")
    ref = ex.GPT()
    ref.load_state_dict(sdp.state_dict_full())
    ddp = DistributedDataParallel(ref)
    opt_s, opt_d = torch.optim.AdamW(sdp.parameters(), lr=3e-3), torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    ratios, ts, td = [], [], []
    for step in range(steps):
        x, y = ex.batch(gen)
        a, b = _timed_step(sdp, opt_s, x, y), _timed_step(ddp, opt_d, x, y)
        if step >= 3:
            ratios.append(a / b)
            ts.append(a)
            td.append(b)
    q = statistics.quantiles(ratios, n=4)
    return {"steps_timed": len(ratios), "ratio_median": statistics.median(ratios), "ratio_iqr": [q[0], q[2]],
            "wrapper_step_s": statistics.median(ts), "ddp_step_s": statistics.median(td)}


def llama_memory(coverage: float) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4)
    with TensorMemoryTracker() as tracker:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model = subnetdp.parallelize(model, units="model.layers.*", coverage=coverage, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(2):
            ids = torch.randint(0, config.vocab_size, (4, 64), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
    full = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    return {"coverage": coverage, "params_held": model.params_held, "params_full": full,
            "units_held": model.units_held, "peak_bytes": tracker.peak, "bytes_per_step": model.bytes_per_step}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    out = {"world_size": dist.get_world_size(), "c1_vs_ddp": step_ratio(args.steps),
           "llama": [llama_memory(0.5), llama_memory(1.0)]}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, out["llama"])  # collective: every rank's memory figures
    out["llama_per_rank"] = per_rank
    del out["llama"]
    if dist.get_rank() == 0:
        import sys

        sys.path.insert(0, str(HERE))
        from _results import results_dir

        path = results_dir() / "own_loop.json"
        path.write_text(json.dumps(out, indent=1))
        print(json.dumps(out, indent=1))
        print(f"written to {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
