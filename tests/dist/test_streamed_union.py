"""The streamed union (never assembled) gives the assembled union's metrics, and rank 0's tensor peak
while it streams stays below its own state plus one block's unit parameters plus the evaluation's
activations (2 gloo ranks, ResNet-18 on digits: block level at C = 0.5 rescaled and x1, neuron level
at C = 0.75 so some units have two owners whose BatchNorm statistics are averaged; both with
BatchNorm recalibration)."""

from __future__ import annotations

from subnetdp.sdp.branches import fold_branch_scales
from subnetdp.core.contracts import LaunchEnv
from subnetdp.parallel.memory import TensorMemoryTracker, live_state_bytes, training_state_tensors
from subnetdp.sdp.union import StreamedUnion, assemble_union, evaluate, evaluate_union, union_branch_scales
from subnetdp.train.loop import train_loop
from subnetdp.train.setup import setup
from tests.helpers import plugin_manager, run_ranks, small_config

CAL, EVAL = 2, 2  # recalibration batches, evaluation batches: 4 forwards per evaluation


def _one(rank: int, world: int, init_method: str, name: str, *overrides: str) -> dict:
    pm = plugin_manager()
    env = LaunchEnv(rank, world, rank, world, "test")
    cfg = small_config("train.steps=2", "train.batch_size=8", "eval.batch_size=64", f"eval.batches={EVAL}",
                       f"eval.bn_recalibrate_batches={CAL}", f"comm.init_method={init_method}-{name}",
                       f"run.name={name}", *overrides, run_dir=init_method.removeprefix("file://") + "-runs")
    ctx, st = setup(cfg, env, pm)
    out: dict = {}
    try:
        result = train_loop(ctx, st)  # the last step's evaluation is the loop's: streamed
        out["loop"] = dict(result.eval_metrics)
        args = (ctx.adapter, ctx.spec, int(cfg.seed), st.partition, st.plan, st.model, st.pmap, ctx.comm)
        scales = union_branch_scales(cfg, st.partition, st.plan)
        out["rates"] = scales
        out["x1"] = evaluate_union(*args, ctx.data, cfg, {})  # collective
        state = live_state_bytes(training_state_tensors(st.model, st.optimizer, st.synchronizer.state_tensors()))
        with StreamedUnion(ctx.adapter, ctx.spec, st.partition, st.plan, st.model, st.pmap, ctx.comm,
                           scales) as probe:
            out["block_bytes"], out["staging"], resident = probe.block_bytes, probe.staging_bytes, probe.resident_bytes
        counter = ctx.comm.bytes
        eval_before, step_before = counter.total("eval"), dict(counter.by_group)
        with TensorMemoryTracker(state) as tracker, counter.phase("eval"):
            with StreamedUnion(ctx.adapter, ctx.spec, st.partition, st.plan, st.model, st.pmap, ctx.comm,
                               scales) as union:  # collective
                out["streamed"] = evaluate(union.module, ctx.adapter, ctx.data, cfg, device=ctx.comm.device)
        out["metered"] = counter.total("eval") - eval_before  # the communicator's own count, by phase
        out["step_bytes_untouched"] = counter.by_group == step_before
        out["summary_phases"] = result.summary["ranks"][rank]["bytes_by_phase"]
        out["fetched"], out["state"], out["resident"], out["peak"] = union.fetched_bytes, state, resident, tracker.peak
        unit_bytes = sum(st.partition.unit_numel(u) for u in st.partition.units) * 4
        buffer_bytes = sum(t.numel() * t.element_size() for t in union.module.buffers())
        out["expected_fetch"] = (CAL + EVAL) * unit_bytes + buffer_bytes
        assembled = assemble_union(*args)  # collective: the reference, on rank 0
        if assembled is not None:
            out["full_bytes"] = live_state_bytes(list(assembled.parameters()) + list(assembled.buffers()))
            out["assembled_x1"] = evaluate(assembled, ctx.adapter, ctx.data, cfg)
            fold_branch_scales(ctx.adapter.branch_output_layers(assembled), scales)
            with TensorMemoryTracker() as acts:  # the evaluation's own tensors: activations, outputs
                out["assembled"] = evaluate(assembled, ctx.adapter, ctx.data, cfg)
            out["activations"] = acts.peak
    finally:
        ctx.comm.shutdown()
    return out


def _worker(rank: int, world: int, init_method: str) -> dict:
    return {"block": _one(rank, world, init_method, "block", "masker.coverage=0.5"),
            "neuron": _one(rank, world, init_method, "neuron", "masker.granularity=neuron", "masker.coverage=0.75",
                           "masker.units_per_layer=4")}


def test_streamed_union_equals_assembled_and_stays_small(tmp_path):
    r0, r1 = run_ranks(_worker, 2, tmp_path, timeout=300)
    assert r0["block"]["rates"] and not r0["neuron"]["rates"]  # block level is rescaled by default
    for level in ("block", "neuron"):
        a, b = r0[level], r1[level]
        # The same arithmetic on the same tensors: the metrics are equal, not merely close ...
        assert a["streamed"] == a["assembled"] == a["loop"], level
        assert a["x1"] == a["assembled_x1"], level
        # ... on every rank, since every rank evaluates the same batches.
        assert b["streamed"] == a["streamed"] and b["loop"] == a["loop"] and b["x1"] == a["x1"], level
        # Bytes: every buffer once, every unit parameter once per forward.
        assert a["fetched"] == b["fetched"] == a["expected_fetch"], level
        # The communicator meters the same bytes under the evaluation's phase, apart from the step's;
        # the loop's summary reports its own evaluation's bytes by phase.
        assert a["metered"] == a["fetched"] and b["metered"] == b["fetched"], level
        assert a["step_bytes_untouched"] and b["step_bytes_untouched"], level
        assert a["summary_phases"]["eval"] >= a["expected_fetch"], (level, a["summary_phases"])
        # Memory: own training state + one block's unit parameters (with its one staging piece) + every
        # buffer (resident: recalibration accumulates across batches) + the evaluation's activations.
        bound = a["state"] + a["block_bytes"] + a["staging"] + a["resident"] + a["activations"]
        assert a["state"] + a["block_bytes"] + a["resident"] <= a["peak"] <= bound, (level, a["peak"], bound)
        assert a["block_bytes"] + a["staging"] + a["resident"] < a["full_bytes"] / 2, level  # well below the union
    assert r0["block"]["streamed"] != r0["block"]["x1"]  # the rescaled union is a different model
