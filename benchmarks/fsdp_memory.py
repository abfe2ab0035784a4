"""Per-device peak memory and bytes of one LLaMA step: DDP, FSDP2, activation checkpointing and SDP, 8 workers.

For the ``1b`` and ``500m`` LLaMA at the micro-batch and sequence length of their recipes
(``configs/recipes/llama_{1b,500m}_fineweb.yaml``) and the recipes' 8 workers, this builds rank 0's
model for each configuration and measures one steady-state training step (forward, backward,
gradient synchronisation, AdamW step; the optimizer state exists, as from the second step on):

- ``DDP``: the full model, ``masker.coverage=1`` (subnetdp's DDP: one world owner group,
  gradients as views of persistent buckets, as DDP's ``gradient_as_bucket_view``).
- ``FSDP`` / ``FSDP+AC``: the full model, FSDP2 ``fully_shard`` over a 1-D mesh of 8 through
  :func:`subnetdp.parallel.fsdp.apply_fsdp` (each block, then the root).
- ``SDP`` / ``SDP+AC``: block-level SDP, cyclic masker, rank 0's materialised subnetwork.
- ``SDP+FSDP(+AC)``: the plan is made over R replicas (cyclic masker), rank 0 = replica 0 shard 0
  holds replica 0's subnetwork sharded over the S ranks of its replica (2-D mesh R x S).
- ``... 2mb``: two micro-batches, the first under the averager's ``no_sync()`` (the recipes
  accumulate 8 and 2); FSDP reduce-scatters each one (``fsdp.reduce_each_micro_batch=true``, the
  default); ``2mb defer``: FSDP's reduce-scatter waits for the last one, keeping the unsharded
  gradients until then (``fsdp.reduce_each_micro_batch=false``).

AC is :func:`subnetdp.parallel.checkpointing.apply_ac` on every block. Everything runs in ONE
process simulating rank 0 of 8 over torch's fake process group, under ``FakeTensorMode``: the
real FSDP2, DTensor, autograd, optimizer and collectives code runs, nothing is allocated, so the
1B model measures on a laptop CPU in seconds.

Memory: subnetdp's dispatch-level ``TensorMemoryTracker`` (as ``benchmarks/llama_memory.py``),
extended in :class:`ShardTracker` for the two things FSDP2 does that a storage-creation tracker
does not see: sharded parameters and gradients are ``DTensor`` wrappers whose storage reports the
*full* size (counted here with their local shard), and FSDP2 allocates and frees the all-gathered
(unsharded) parameters with ``UntypedStorage.resize_`` (counted here by wrapping ``resize_``). FSDP
rows are cross-checked with ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, DDP/SDP
rows without AC with ``llama_memory.measure`` (the same step without the averager).

Bytes: measured as the step dispatches them. Owner-group all-reduces (DDP, SDP, SDP+FSDP): the
project's averager (``OwnerGroupAverager`` / ``ShardedOwnerAverager``) over :class:`FakeCommunicator`,
whose ``ByteCounter`` counts every ``all_reduce`` payload; FSDP's all-gathers and reduce-scatters:
``subnetdp.parallel.fsdp.CollectiveBytes``; every ``c10d`` op the step dispatches is also counted by
:class:`C10dOps` as a cross-check.

Run: ``.venv/bin/python benchmarks/fsdp_memory.py`` (about 3 minutes on 2 shared cores; fp32, as
the recipes) and ``--precision bf16`` (FSDP2 ``MixedPrecisionPolicy`` bf16 compute / fp32
reduction when sharded, ``torch.autocast`` bf16 otherwise). Writes
``fsdp_memory.json`` (``fsdp_memory_bf16.json``) in the results directory (``benchmarks/_results.py``)
and prints a table.

``--loss``: DDP, FSDP+AC, SDP C=0.5 and SDP+FSDP+AC (2 x 4) at C=0.5 and 0.69, each with the full
logits and with the chunked LM-head loss (``model.loss_chunk=1024``), fp32 and bf16 in one run
(``fsdp_memory_loss.json``; ratios to plain DDP of the same precision). Each row also says what is
live at its peak (:class:`PeakBreakdown`): the state, this step's sharded and unsharded gradients, the gathered
parameters, FSDP2's all-gather and reduce-scatter buffers, and the activations and temporaries,
with the largest of them by op, shape and the function that allocated them.
Not measured: the CUDA caching allocator's fragmentation and reserve, NCCL's buffers, the CUDA
context, gradient clipping (its norm needs ``.item()``, impossible on fake tensors; it allocates
one scalar per parameter).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
import llama_memory  # noqa: E402  (benchmarks/ is not a package)

from subnetdp.train.configure import load_config  # noqa: E402
from subnetdp.core.contracts import DataSpec  # noqa: E402
from subnetdp.core.errors import PlanError  # noqa: E402
from subnetdp.parallel.memory import live_state_bytes, training_state_tensors  # noqa: E402
from subnetdp.train.optim import build_optimizer  # noqa: E402
from subnetdp.core.plan import make_plan  # noqa: E402
from subnetdp.core.plugins import PluginManager  # noqa: E402
from subnetdp.sdp.sync import OwnerGroupAverager  # noqa: E402
from subnetdp.parallel.fsdp import ShardedMemoryTracker as ShardTracker  # noqa: E402
from subnetdp.parallel.checkpointing import apply_ac  # noqa: E402
from subnetdp.parallel.fsdp import CollectiveBytes, ShardedOwnerAverager, apply_fsdp, mixed_precision  # noqa: E402
from subnetdp.parallel.dryrun_comm import FakeGroupCommunicator as FakeCommunicator  # noqa: E402

RESULTS, GiB, MiB = llama_memory.RESULTS, llama_memory.GiB, 2**20
WORLD = 8
# The method's reported figures (1B LLaMA, 8 workers; GB and MB read as 10^9 and 10^6 bytes).
PAPER = {"memory_GB": {"DDP": 70.9, "FSDP+AC": 11.0, "SDP+FSDP+AC": 9.7},
         "bytes_MB_per_step": {"DDP": 3143, "SDP+FSDP": 2253}}


@dataclass(frozen=True)
class Setup:
    """One configuration: coverage, shard size S (1 = no FSDP; R = 8 / S replicas) and AC."""

    mode: str
    coverage: float
    shard: int = 1
    ac: bool = False
    accum: int = 1  # micro-batches per step; all but the last under the averager's no_sync()
    defer: bool = False  # fsdp.reduce_each_micro_batch=false: one reduce-scatter per step
    chunk: int = 0  # model.loss_chunk: 0 = the full logits at once; > 0 = the chunked LM-head loss

    @property
    def replicas(self) -> int:
        return WORLD // self.shard


SETUPS = (
    Setup("DDP", 1.0), Setup("FSDP", 1.0, 8), Setup("FSDP+AC", 1.0, 8, True),
    Setup("SDP", 0.69), Setup("SDP", 0.5), Setup("SDP+AC", 0.69, ac=True), Setup("SDP+AC", 0.5, ac=True),
    Setup("SDP+FSDP", 0.69, 4), Setup("SDP+FSDP", 0.5, 4),
    Setup("SDP+FSDP+AC", 0.69, 4, True), Setup("SDP+FSDP+AC", 0.5, 4, True),
    Setup("SDP+FSDP+AC", 0.69, 2, True), Setup("SDP+FSDP+AC", 0.5, 2, True),
    # Gradient accumulation (the recipes use 8 and 2 micro-batches): a reduce-scatter per micro-batch,
    # or one per step with the unsharded gradients kept until then (defer).
    Setup("DDP", 1.0, accum=2), Setup("FSDP+AC", 1.0, 8, True, 2), Setup("SDP+FSDP+AC", 0.5, 4, True, 2),
    Setup("FSDP+AC", 1.0, 8, True, 2, True), Setup("SDP+FSDP+AC", 0.5, 4, True, 2, True),
)
# --loss: the chunked LM-head loss (model.loss_chunk=1024) against the full logits, 1B, rank 0 of 8.
LOSS_SETUPS = tuple(Setup(m, c, s, ac, chunk=k) for k in (0, 1024) for m, c, s, ac in (
    ("DDP", 1.0, 1, False), ("FSDP+AC", 1.0, 8, True), ("SDP", 0.5, 1, False),
    ("SDP+FSDP+AC", 0.5, 4, True), ("SDP+FSDP+AC", 0.69, 4, True)))


class C10dOps(TorchDispatchMode):
    """Every ``c10d`` op the step dispatches: calls and input payload by op name (a cross-check)."""

    INPUT_ARG = {"_allgather_base_": 1, "_reduce_scatter_base_": 1, "allgather_into_tensor_coalesced_": 1,
                 "reduce_scatter_tensor_coalesced_": 1}

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            name = func.overloadpacket.__name__
            arg = args[self.INPUT_ARG.get(name, 0)] if args else ()
            items = arg if isinstance(arg, (list, tuple)) else [arg]
            nbytes = sum(x.numel() * x.element_size() for x in items if isinstance(x, torch.Tensor))
            rec = self.ops.setdefault(name, {"calls": 0, "payload_bytes": 0})
            rec["calls"] += 1
            rec["payload_bytes"] += nbytes
        return func(*args, **(kwargs or {}))

    def payload(self) -> int:
        return sum(r["payload_bytes"] for r in self.ops.values())


class PeakBreakdown(ShardTracker):
    """``ShardTracker`` that also keeps, at the step's peak, which storages were live and who made them.

    At every new peak the live storages created during the step are copied (key -> bytes) with the
    phase of the step (``forward``, ``backward``, ``sync``, ``optimizer``), the op and, for those of
    1 MiB or more, the function that allocated them, together with the storages of the gradients
    that exist at that moment (``grad_keys``); :meth:`breakdown` sorts them into this step's sharded
    gradients, FSDP2's unsharded gradients (``.grad`` of its unsharded parameters, before their
    reduce-scatter), gathered parameters (FSDP2's ``resize_``), FSDP2's all-gather and reduce-scatter
    buffers, and activations/temporaries, and names the largest of the last. The state (parameters,
    AdamW moments, persistent buckets: every gradient without FSDP) is the baseline.
    """

    def __init__(self, baseline: int = 0, grad_keys: Any = lambda: (set(), set())) -> None:
        super().__init__(baseline)
        self.grad_keys = grad_keys  # () -> (sharded .grad storages, FSDP2's unsharded .grad storages), now
        self.grads_at_peak: tuple[set[int], set[int]] = (set(), set())
        self.phase = "forward"
        self._made: dict[int, tuple] = {}  # key -> (phase, op, shape, dtype, allocating function)
        self._resized_keys: set[int] = set()
        self.at_peak: dict[int, tuple[int, tuple]] = {}  # key -> (bytes, what made it), at the peak
        self.peak_phase = self.peak_op = ""
        self._op = ""
        self._snap_peak = -1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._op = func.overloadpacket.__name__
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track(self, t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        if key not in self._live:
            where = ""
            if t.untyped_storage().nbytes() >= 2**20:  # which function allocated it (FSDP2's buffers by name)
                frames = [f for f in traceback.extract_stack()[:-3]
                          if not any(x in f.filename for x in ("_python_dispatch", "_dynamo", "_compile.py", "eval_frame",
                                                               "fsdp_memory.py", "_ops.py", "utils/_", "_tensor.py"))]
                where = " < ".join(f"{Path(f.filename).name}:{f.name}" for f in frames[-4:][::-1])
            self._made[key] = (self.phase, self._op, tuple(t.shape), str(t.dtype).replace("torch.", ""), where)
        super()._track(t)

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        self._resized_keys.add(storage._cdata)
        super()._resized(storage, before)

    def _note_peak(self) -> None:
        super()._note_peak()
        if self.current >= self.peak and self.current > self._snap_peak:
            self._snap_peak = self.current
            unknown = ("before", "?", (), "?", "")  # FSDP2's unsharded parameters: storages of an earlier step
            self.at_peak = {k: (b, self._made.get(k, unknown)) for k, b in self._live.items()}
            self.peak_phase, self.peak_op = self.phase, self._op
            self.grads_at_peak = self.grad_keys()

    def breakdown(self, top: int = 12) -> dict:
        """The peak as state + gradients + gathered parameters + FSDP2's all-gather / reduce-scatter
        buffers + activations and temporaries (bytes), with the largest of the last."""
        sharded, unsharded = self.grads_at_peak
        g = sum(b for k, (b, _m) in self.at_peak.items() if k in sharded and k not in self._resized_keys)
        ug = sum(b for k, (b, _m) in self.at_peak.items() if k in unsharded and k not in sharded | self._resized_keys)
        gathered = sum(b for k, (b, _m) in self.at_peak.items() if k in self._resized_keys)
        rest = [(b, m) for k, (b, m) in self.at_peak.items() if k not in sharded | unsharded | self._resized_keys]
        ag = sum(b for b, m in rest if "foreach_all_gather" in m[4])
        rs = sum(b for b, m in rest if "foreach_reduce" in m[4])
        rest = [(b, m) for b, m in rest if "foreach_all_gather" not in m[4] and "foreach_reduce" not in m[4]]
        by_phase: dict[str, int] = {}
        for b, (phase, *_x) in rest:
            by_phase[phase] = by_phase.get(phase, 0) + b
        rest.sort(key=lambda r: -r[0])
        return {"phase": self.peak_phase, "op": self.peak_op, "state_bytes": self.baseline,
                "grad_bytes": g, "unsharded_grad_bytes": ug, "gathered_bytes": gathered, "all_gather_buffer_bytes": ag,
                "reduce_scatter_buffer_bytes": rs, "activation_bytes": sum(b for b, _ in rest),
                "activation_bytes_by_phase_made": by_phase,
                "largest": [{"bytes": b, "phase": m[0], "op": m[1], "shape": list(m[2]), "dtype": m[3],
                             **({"by": m[4]} if m[4] else {})}
                            for b, m in rest[:top]]}


def measure(variant: str, setup: Setup, pm: PluginManager, comm: FakeCommunicator, precision: str,
            meshes: dict[tuple[int, int], Any], crosscheck: bool = True) -> dict:
    """Rank 0's peak tensor memory and collective bytes for one steady-state step of ``setup``."""
    cfg = load_config(f"llama_{variant}_fineweb", [f"masker.coverage={setup.coverage}", f"model.loss_chunk={setup.chunk}"],
                      pm.registries)
    assert int(cfg.launch.nproc) == WORLD
    batch, seq, R, S = int(cfg.train.batch_size), int(cfg.data.seq_len), setup.replicas, setup.shard
    spec = DataSpec(vocab_size=32_000, seq_len=seq)
    adapter = pm.get("model", "llama")(cfg.model)
    masker = pm.get("masker", cfg.masker.name)(cfg.masker)
    row: dict[str, Any] = {"variant": variant, "mode": setup.mode, "coverage": setup.coverage, "replicas": R,
                           "shard": S, "ac": setup.ac, "accum": setup.accum, "defer": setup.defer, "loss_chunk": setup.chunk, "precision": precision,
                           "micro_batch": batch, "seq_len": seq}
    with FakeTensorMode(allow_non_fake_inputs=True):
        full = adapter.build(spec)
        partition = adapter.partition(full, "block", spec)
        try:  # the plan is made over the R replicas (over the 8 ranks without FSDP)
            plan = make_plan(masker, partition, R, int(cfg.seed), int(cfg.masker.min_owners))
        except PlanError as e:
            return {**row, "skipped": f"plan over {R} replicas at C={setup.coverage}: {e}"}
        model, pmap = adapter.materialize(full, plan.owned[0], partition)
        del full
        blocks = adapter.blocks(model)
        if setup.ac:
            apply_ac(blocks, every=1)
        if S > 1:
            apply_fsdp(model, blocks, meshes[(R, S)]["shard"], mp_policy=mixed_precision(precision))
        optimizer = build_optimizer(cfg.optim, model.parameters())
        if S > 1:
            averager = ShardedOwnerAverager(model, pmap, plan, partition, comm, S, float(cfg.sync.bucket_cap_mb),
                                            reduce_each_micro_batch=not setup.defer)
        else:
            averager = OwnerGroupAverager(model, pmap, plan, partition, comm, float(cfg.sync.bucket_cap_mb),
                                          int(cfg.sync.max_groups))
        # As the loop (subnetdp.parallel.apply.RankParallelism.autocast): no weight cache under AC.
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=not setup.ac)
                    if precision == "bf16" and S == 1 else contextlib.nullcontext())
        tokens = torch.zeros(batch, seq, dtype=torch.int64)
        data = (tokens, tokens)

        active: list[ShardTracker] = []  # the tracker of the measured step, to read after the forward
        after_forward: list[int] = []

        def phase(name: str) -> None:
            for t in active:
                t.phase = name

        def step() -> None:  # what subnetdp.train.loop does per step (no clipping)
            for micro in range(setup.accum):
                with averager.no_sync() if micro < setup.accum - 1 else contextlib.nullcontext():
                    phase("forward")
                    with autocast:
                        loss = adapter.training_loss(model, data) / setup.accum
                    after_forward.extend(t.current for t in active)
                    phase("backward")
                    loss.backward()
            phase("sync")
            averager.finish()  # collective: the owner groups average the gradients
            phase("optimizer")
            optimizer.step()

        averager.prepare()
        step()  # creates gradients and AdamW state, as the first real step does
        averager.prepare()  # steady state: OwnerGroupAverager's buckets persist, FSDP's gradients are set to None
        state = training_state_tensors(model, optimizer, averager.state_tensors())
        baseline = live_state_bytes(state)
        comm.bytes.reset()
        fsdp_bytes, ops = CollectiveBytes(), C10dOps()
        t0 = time.perf_counter()
        groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
        fsdp_params = [fp for g in groups if g is not None for fp in g.fsdp_params]

        def grad_keys() -> tuple[set[int], set[int]]:  # this step's gradients at this moment, by storage
            # While a block is unsharded FSDP2 registers its unsharded parameters on the module: their
            # .grad are the unsharded gradients (before the reduce-scatter), the DTensors' the shards.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            sharded = {g._local_tensor.untyped_storage()._cdata for g in grads if isinstance(g, DTensor)}
            unsharded = {g.untyped_storage()._cdata for g in grads if fsdp_params and not isinstance(g, DTensor)}
            unsharded |= {fp._unsharded_param.grad.untyped_storage()._cdata for fp in fsdp_params
                          if getattr(fp, "_unsharded_param", None) is not None and fp._unsharded_param.grad is not None}
            return sharded, unsharded

        with ops, fsdp_bytes, PeakBreakdown(baseline, grad_keys) as tracker:
            active.append(tracker)
            step()
            active.clear()
        breakdown = tracker.breakdown()
        seconds = time.perf_counter() - t0
        sdp_payload, sdp_wire = comm.bytes.total(), comm.bytes.ring_estimate()  # before the cross-check's step
        cross = None
        if crosscheck and S > 1 and setup.accum == 1:  # FSDPMemTracker follows one forward per step
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            averager.prepare()
            fmt = FSDPMemTracker(model, optimizer)
            fmt.track_inputs((tokens,))
            with fmt:
                step()
            cross = sum(d["Total"] for d in fmt.get_tracker_snapshot("peak").values())
        if crosscheck and not setup.ac and S == 1 and precision == "fp32" and setup.accum == 1 and not setup.chunk:
            cross = llama_memory.measure(variant, setup.coverage, pm)["peak_bytes"]
    held = sum(ShardTracker._local(p).numel() for p in model.parameters())
    return {**row, "blocks_held": len(plan.owned[0]), "blocks": plan.num_units,
            "owner_groups": len(plan.owner_sets()), "params_held_local": held,
            "state_bytes": baseline, "peak_bytes": tracker.peak, "transient_bytes": tracker.peak - baseline,
            "after_forward_bytes": after_forward[-1],  # live at the last loss: state, saved activations, logits
            "gathered_params_at_peak_bytes": tracker.gathered_at_peak, "gathered_params_max_bytes": tracker.gathered_peak,
            "peak_breakdown": breakdown, "crosscheck_peak_bytes": cross,
            "crosscheck_by": ("FSDPMemTracker" if S > 1 else "llama_memory.measure") if cross is not None else None,
            "sdp_allreduce_payload_bytes": sdp_payload, "sdp_allreduce_wire_bytes": sdp_wire,
            "sdp_averager_bytes_per_step": averager.bytes_per_step(),
            "fsdp_payload_bytes": fsdp_bytes.payload, "fsdp_wire_bytes": fsdp_bytes.wire,
            "fsdp_by_kind": dict(fsdp_bytes.by_kind),
            "payload_bytes": sdp_payload + fsdp_bytes.payload, "wire_bytes": sdp_wire + fsdp_bytes.wire,
            "c10d_ops": ops.ops, "c10d_payload_bytes": ops.payload(), "measure_s": seconds}


def table(rows: list[dict]) -> str:
    head = (f"{'model':>5} {'config':>21} {'C':>5} {'RxS':>5} {'blocks':>6} {'params/dev':>13} {'state':>6} "
            f"{'peak GiB':>8} {'vs DDP':>7} {'gathered':>8} {'payload MiB':>11} {'vs DDP':>6} {'wire MiB':>9} {'vs DDP':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rxs = f"{r['replicas']}x{r['shard']}"
        label = (r["mode"] + (f" {r['accum']}mb" if r["accum"] > 1 else "") + (" defer" if r.get("defer") else "")
                 + (" chunked" if r.get("loss_chunk") else ""))
        if "skipped" in r:
            lines.append(f"{r['variant']:>5} {label:>21} {r['coverage']:>5g} {rxs:>5}  skipped: {r['skipped'][:60]}")
            continue
        lines.append(
            f"{r['variant']:>5} {label:>21} {r['coverage']:>5g} {rxs:>5} {r['blocks_held']:>2}/{r['blocks']:<3} "
            f"{r['params_held_local']:>13,} {r['state_bytes'] / GiB:>6.2f} {r['peak_bytes'] / GiB:>8.2f} "
            f"{r['peak_ratio_to_ddp']:>7.3f} {r['gathered_params_at_peak_bytes'] / GiB:>8.2f} "
            f"{r['payload_bytes'] / MiB:>11,.0f} {r['payload_ratio_to_ddp']:>6.3f} {r['wire_bytes'] / MiB:>9,.0f} "
            f"{r['wire_ratio_to_ddp']:>6.3f}")
    return "\n".join(lines)


def compare(rows: list[dict], precision: str) -> str:
    """The 1B figures next to the method's (GB = 1e9 bytes and MB = 1e6 bytes, as the paper's units are read)."""
    one = [r for r in rows if r["variant"] == "1b" and "skipped" not in r and r["accum"] == 1 and not r.get("loss_chunk")]
    if not one:
        return ""
    pick = {(r["mode"], r["coverage"], r["replicas"], r["shard"]): r for r in one}
    ddp, fsdp_ac = pick[("DDP", 1.0, 8, 1)], pick[("FSDP+AC", 1.0, 1, 8)]
    gb = lambda r: r["peak_bytes"] / 1e9  # noqa: E731
    combo = [r for r in one if r["mode"] == "SDP+FSDP+AC"]
    sdp_fsdp = [r for r in one if r["mode"] == "SDP+FSDP"]
    paper = PAPER["memory_GB"]
    combos = "; ".join(f"C={r['coverage']:g} {r['replicas']}x{r['shard']}: {gb(r):.1f} GB ({r['peak_ratio_to_ddp'] - 1:+.0%} vs DDP, "
                       f"{r['peak_bytes'] / fsdp_ac['peak_bytes']:.2f}x FSDP+AC)" for r in combo)
    nets = "; ".join(f"C={r['coverage']:g} {r['replicas']}x{r['shard']}: payload {r['payload_bytes'] / 1e6:,.0f} MB "
                     f"({r['payload_ratio_to_ddp']:.2f}x), wire {r['wire_bytes'] / 1e6:,.0f} MB ({r['wire_ratio_to_ddp']:.2f}x)"
                     for r in sdp_fsdp)
    return (f"1B LLaMA, {precision}, rank 0 of 8, micro-batch {ddp['micro_batch']} x {ddp['seq_len']}, one micro-batch "
            f"per step. Memory: DDP {gb(ddp):.1f} GB per device (paper {paper['DDP']}); FSDP+AC {gb(fsdp_ac):.1f} GB "
            f"({fsdp_ac['peak_ratio_to_ddp'] - 1:+.0%} vs DDP; paper {paper['FSDP+AC']} GB, "
            f"{paper['FSDP+AC'] / paper['DDP'] - 1:+.0%}); SDP+FSDP+AC {combos} (paper {paper['SDP+FSDP+AC']} GB, "
            f"{paper['SDP+FSDP+AC'] / paper['DDP'] - 1:+.0%} vs DDP, {paper['SDP+FSDP+AC'] / paper['FSDP+AC']:.2f}x FSDP+AC). "
            f"Bytes per step: DDP payload {ddp['payload_bytes'] / 1e6:,.0f} MB, ring wire {ddp['wire_bytes'] / 1e6:,.0f} MB "
            f"(paper {PAPER['bytes_MB_per_step']['DDP']:,} MB); SDP+FSDP {nets} (paper "
            f"{PAPER['bytes_MB_per_step']['SDP+FSDP']:,} MB, "
            f"{PAPER['bytes_MB_per_step']['SDP+FSDP'] / PAPER['bytes_MB_per_step']['DDP']:.2f}x).")


def loss_summary(rows: list[dict], precision: str) -> str:
    """Each configuration with and without the chunked loss, as a fraction of plain DDP's peak."""
    pick = {(r["mode"], r["coverage"], r["shard"], r["loss_chunk"]): r for r in rows if "skipped" not in r}
    parts = []
    for (mode, c, s, k), r in pick.items():
        if k and (mode, c, s, 0) in pick:
            plain = pick[(mode, c, s, 0)]
            parts.append(f"{mode} C={c:g} {WORLD // s}x{s}: {plain['peak_bytes'] / GiB:.2f} -> {r['peak_bytes'] / GiB:.2f} GiB "
                         f"({plain['peak_ratio_to_ddp']:.3f}x -> {r['peak_ratio_to_ddp']:.3f}x DDP)")
    return f"1B LLaMA, {precision}, rank 0 of 8, chunked loss (model.loss_chunk=1024) vs full logits: " + "; ".join(parts)


def breakdown_table(rows: list[dict], precision: str) -> str:
    """What is live at each row's peak: state, this step's sharded and unsharded (FSDP2) gradients,
    gathered parameters, FSDP2's all-gather and reduce-scatter buffers, activations and temporaries."""
    head = (f"{'config':>21} {'C':>5} {'RxS':>5} {'peak':>6} {'state':>6} {'grads':>6} {'ungrad':>6} {'gather':>6} "
            f"{'AG buf':>6} {'RS buf':>6} {'activ.':>6}  at the peak ({precision}, GiB)")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            continue
        b = r["peak_breakdown"]
        label = r["mode"] + (" chunked" if r.get("loss_chunk") else "")
        lines.append(f"{label:>21} {r['coverage']:>5g} {r['replicas']}x{r['shard']:<3} {r['peak_bytes'] / GiB:>6.2f} "
                     f"{b['state_bytes'] / GiB:>6.2f} {b['grad_bytes'] / GiB:>6.2f} {b['unsharded_grad_bytes'] / GiB:>6.2f} "
                     f"{b['gathered_bytes'] / GiB:>6.2f} "
                     f"{b['all_gather_buffer_bytes'] / GiB:>6.2f} {b['reduce_scatter_buffer_bytes'] / GiB:>6.2f} "
                     f"{b['activation_bytes'] / GiB:>6.2f}  {b['phase']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", choices=("fp32", "bf16", "both"), default=None,
                    help="fp32 (the default), bf16, or both in one run and one JSON (the default with --loss)")
    ap.add_argument("--variants", nargs="+", default=["1b", "500m"], choices=["1b", "500m", "134m"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--loss", action="store_true",
                    help="the chunked LM-head loss against the full logits (1B, fp32 and bf16 unless --precision "
                         "says one; writes fsdp_memory_loss.json, with what is live at each row's peak)")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="only these rows of the table (0-based)")
    ap.add_argument("--no-crosscheck", action="store_true", help="skip the FSDPMemTracker / llama_memory cross-checks")
    args = ap.parse_args(argv)
    setups = LOSS_SETUPS if args.loss else SETUPS
    if args.rows:
        setups = tuple(setups[i] for i in args.rows)
    if args.loss:
        args.variants = ["1b"]
    if args.precision is None:
        args.precision = "both" if args.loss else "fp32"
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    stem = "fsdp_memory_loss" if args.loss else "fsdp_memory"
    out_path = args.out or RESULTS / (f"{stem}.json" if args.precision in ("fp32", "both") else f"{stem}_bf16.json")
    torch.set_num_threads(1)
    pm = PluginManager()
    comm = FakeCommunicator(0, WORLD)  # subnetdp's dry-run communicator over torch's fake process group
    comm.init()
    # Device meshes are made outside FakeTensorMode (DeviceMesh reads its rank layout with .tolist()).
    meshes = {(s.replicas, s.shard): init_device_mesh("cpu", (s.replicas, s.shard), mesh_dim_names=("replica", "shard"))
              for s in setups if s.shard > 1}
    rows = []
    t0 = time.perf_counter()
    for variant, precision in [(v, p) for p in precisions for v in args.variants]:
        ddps: dict[int, dict] = {}  # the DDP row with the same number of micro-batches (and precision)
        for setup in setups:
            r = measure(variant, setup, pm, comm, precision, meshes, not args.no_crosscheck)
            if "skipped" not in r:
                ddp = ddps.setdefault(setup.accum, r)  # plain DDP (full logits): the baseline of every row
                r["peak_ratio_to_ddp"] = r["peak_bytes"] / ddp["peak_bytes"]
                r["payload_ratio_to_ddp"] = r["payload_bytes"] / ddp["payload_bytes"]
                r["wire_ratio_to_ddp"] = r["wire_bytes"] / ddp["wire_bytes"]
            rows.append(r)
            print(f"  {variant} {precision} {setup.mode} C={setup.coverage} {setup.replicas}x{setup.shard}: "
                  f"{r.get('peak_bytes', 0) / GiB:.2f} GiB ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    text = "\n\n".join((f"{p}:\n" if len(precisions) > 1 else "") + table([r for r in rows if r["precision"] == p])
                         for p in precisions)
    if args.loss:
        text += "\n\n" + "\n\n".join(breakdown_table([r for r in rows if r["precision"] == p], p) for p in precisions)
    comparison = " ".join(compare([r for r in rows if r["precision"] == p], p) if not args.loss
                          else loss_summary([r for r in rows if r["precision"] == p], p) for p in precisions)
    print(text + "\n\n" + comparison)
    out = {"benchmark": "fsdp_memory", "command": " ".join([Path(sys.executable).name] + sys.argv),
           "precision": args.precision, "world": WORLD, "rank": 0,
           "measured_by": ("subnetdp TensorMemoryTracker under FakeTensorMode, DTensors counted by their local "
                           "shard and FSDP2's storage resize_ counted (ShardTracker); one process simulating rank 0 "
                           "of 8 over torch's fake process group; tensors only"),
           "bytes_by": ("owner-group all-reduce payload counted by the communicator's ByteCounter as the averager "
                        "issues it (ring wire 2(k-1)/k x payload); FSDP all-gather/reduce-scatter payload and ring "
                        "wire by subnetdp.parallel.fsdp.CollectiveBytes; c10d_ops: every c10d op dispatched"),
           "paper": PAPER, "torch": torch.__version__, "platform": platform.platform(),
           "seconds": time.perf_counter() - t0, "comparison": comparison, "rows": rows, "table": text}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
