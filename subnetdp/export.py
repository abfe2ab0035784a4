"""The union model from a checkpoint's files alone: evaluate it, or export it for use without subnetdp.

Everything here runs in one process, without a process group::

    subnetdp eval RUN_DIR|CHECKPOINT        # metrics of the union model (newest checkpoint of a run)
    subnetdp export CHECKPOINT OUT          # OUT/model.safetensors + OUT/reference.json

    import subnetdp.export
    model = subnetdp.export.load_reference("OUT")   # e.g. a plain torchvision ResNet, weights loaded

The union model is assembled as :func:`subnetdp.core.union.assemble_union` does inside a run: each
unit's parameters from ``min(owners)`` (per ``plan.json``), float buffers averaged among the owners,
integer buffers from ``min(owners)``; shared tensors from rank 0, shared float buffers averaged over
all ranks. With block-level forward masking and ``eval.block_union=rescaled`` (the default) each
residual branch is then scaled by its training keep rate, folded into the branch's last affine
layer, as the in-run evaluation does (``reference.json`` lists the scales). Export then recalibrates BatchNorm statistics on ``eval.bn_recalibrate_batches`` training
batches, as the in-run evaluation does, so the exported model scores the run's metric exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from subnetdp.core import checkpoint as ck
from subnetdp.core.contracts import DataSpec, ModelAdapter, Partition, TensorSlice
from subnetdp.core.errors import CheckpointError, SubnetdpError
from subnetdp.core.plan import MaskPlan
from subnetdp.core.plugins import PluginManager
from subnetdp.core.branches import fold_branch_scales
from subnetdp.core.union import evaluate, recalibrate_batchnorm, union_branch_scales

EXPORT_FORMAT = "subnetdp-export/1"


@dataclass
class LoadedUnion:
    """A checkpoint's union model with what it takes to evaluate or rebuild it."""

    model: nn.Module
    cfg: Any
    adapter: ModelAdapter
    spec: DataSpec
    manifest: dict[str, Any]
    path: Path
    branch_scales: dict[str, float] = field(default_factory=dict)  # folded in (eval.block_union=rescaled)


def _config(ckpt: Path, manifest: dict[str, Any], pm: PluginManager) -> Any:
    from subnetdp.core.config import compose

    path = ck.verify_file(ckpt, "config.yaml", manifest)
    try:
        return compose(str(path), ["resume=never", "launch.nproc=1"], pm.registries)
    except SubnetdpError as e:
        raise CheckpointError(f"{path}: no longer a valid config with the installed plugins ({e})") from None


def _plan(ckpt: Path, manifest: dict[str, Any], partition: Partition) -> MaskPlan:
    path = ck.verify_file(ckpt, "plan.json", manifest)
    try:
        plan = MaskPlan.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (SubnetdpError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a valid mask plan ({e})") from None
    if plan.digest() != manifest["plan_digest"] or plan.world_size != manifest["world_size"]:
        raise CheckpointError(f"{path}: does not match {ck.MANIFEST} (plan digest or world size)")
    if plan.num_units != len(partition.units):
        raise CheckpointError(f"{path}: plans {plan.num_units} units, the model has {len(partition.units)}")
    return plan


class _Shards:
    """Every rank's tensors, looked up by (rank, global region)."""

    def __init__(self, ckpt: Path, manifest: dict[str, Any]) -> None:
        self.files = [ckpt / ck.rank_files(r)[0] for r in range(int(manifest["world_size"]))]
        self.shards = [ck.read_tensors(ck.verify_file(ckpt, f.name, manifest), manifest, r)
                       for r, f in enumerate(self.files)]

    def region(self, rank: int, name: str, dim: int | None, start: int, stop: int, shape: tuple[int, ...]) -> torch.Tensor:
        tensors, slices = self.shards[rank]
        if name in tensors:
            whole = tensors[name]
            if tuple(whole.shape) != tuple(shape):
                raise CheckpointError(f"{self.files[rank]}: {name} has shape {tuple(whole.shape)}, the model "
                                      f"needs {tuple(shape)}: the checkpoint is from a different model")
            return whole if dim is None else whole.narrow(dim, start, stop - start)
        if dim is None:
            dim, start, stop = 0, 0, shape[0]
        out_shape = list(shape)
        out_shape[dim] = stop - start
        out, covered = None, 0
        for key, (gname, pdim, pstart, pstop) in slices.items():
            lo, hi = max(start, pstart), min(stop, pstop)
            if gname != name or pdim != dim or lo >= hi:
                continue
            if out is None:
                out = torch.empty(out_shape, dtype=tensors[key].dtype)
            out.narrow(dim, lo - start, hi - lo).copy_(tensors[key].narrow(dim, lo - pstart, hi - lo))
            covered += hi - lo
        if out is None or covered != stop - start:
            raise CheckpointError(f"{self.files[rank]}: lacks {name}[{start}:{stop}] along dim {dim}, which "
                                  f"plan.json says rank {rank} owns")
        return out


@torch.no_grad()
def load_union(path: str | Path, pm: PluginManager | None = None) -> LoadedUnion:
    """The union model of a checkpoint (or of a run directory's newest checkpoint), on CPU."""
    pm = pm or PluginManager()
    ckpt = ck.resolve_checkpoint(Path(path))
    manifest = ck.read_manifest(ckpt)
    cfg = _config(ckpt, manifest, pm)
    adapter = pm.registries["model"].get(cfg.model.name)(cfg.model)
    spec = DataSpec(**manifest["data_spec"])
    torch.manual_seed(int(cfg.seed))
    model = adapter.build(spec)
    partition = adapter.partition(model, str(cfg.masker.granularity), spec)
    plan = _plan(ckpt, manifest, partition)
    shards = _Shards(ckpt, manifest)
    target = dict(model.named_parameters())
    target.update(dict(model.named_buffers()))
    world = tuple(range(plan.world_size))

    def fill(s: Any, owners: tuple[int, ...], average: bool) -> None:
        shape = partition.shapes[s.name]
        sources = owners if average else owners[:1]
        value = shards.region(sources[0], s.name, s.dim, s.start, s.stop, shape).clone()
        for r in sources[1:]:  # summed in rank order, then divided, as the in-run all-reduce does
            value += shards.region(r, s.name, s.dim, s.start, s.stop, shape)
        if average:
            value /= len(sources)
        dst = target[s.name] if s.dim is None else target[s.name].narrow(s.dim, s.start, s.stop - s.start)
        dst.copy_(value.to(dst.dtype))

    for unit in partition.units:
        owners = plan.owners(unit.id)
        for s in unit.slices:
            fill(s, owners, average=False)
        for s in unit.buffers:
            fill(s, owners, average=partition.dtypes[s.name].is_floating_point)
    for name in partition.shared:
        fill(TensorSlice(name), world, average=False)
    for name in partition.shared_buffers:
        fill(TensorSlice(name), world, average=partition.dtypes[name].is_floating_point)
    # eval.block_union=rescaled: the union the run evaluated, with each branch x its keep rate.
    scales = union_branch_scales(cfg, partition, plan)
    fold_branch_scales(adapter.branch_output_layers(model), scales)
    return LoadedUnion(model, cfg, adapter, spec, manifest, ckpt, scales)


def evaluate_checkpoint(path: str | Path, pm: PluginManager | None = None) -> tuple[LoadedUnion, dict[str, float]]:
    """The run's eval metrics of a checkpoint's union model (BatchNorm recalibrated as in the run)."""
    pm = pm or PluginManager()
    loaded = load_union(path, pm)
    data = _data(loaded, pm)
    return loaded, evaluate(loaded.model, loaded.adapter, data, loaded.cfg)


def _data(loaded: LoadedUnion, pm: PluginManager) -> Any:
    cfg = loaded.cfg
    data = pm.registries["data"].get(cfg.data.name)(cfg.data, seed=int(cfg.seed))
    data.check()
    return data


def export(path: str | Path, out: str | Path, recalibrate: bool = True, pm: PluginManager | None = None) -> Path:
    """Write the union model as the reference architecture's plain ``state_dict`` and its options.

    Args:
        path: a checkpoint directory, or a run directory (its newest checkpoint).
        out: output folder; receives ``model.safetensors`` and ``reference.json``.
        recalibrate: recompute BatchNorm statistics on ``eval.bn_recalibrate_batches`` training
            batches first, as the run's own evaluation does.
    """
    from safetensors.torch import save_file

    pm = pm or PluginManager()
    loaded = load_union(path, pm)
    cfg, model = loaded.cfg, loaded.model
    options = loaded.manifest.get("reference")
    if options is None or getattr(loaded.adapter, "reference_model", None) is None:
        raise SubnetdpError(f"model plugin '{cfg.model.name}' does not say how to rebuild its reference "
                            "architecture (reference_options / reference_model): it cannot be exported")
    n_cal = int(cfg.eval.bn_recalibrate_batches) if recalibrate else 0
    if n_cal > 0:
        batches = iter(_data(loaded, pm).train_loader(0, 1, int(cfg.train.batch_size)))
        n_cal = recalibrate_batchnorm(model, batches, n_cal, loaded.adapter.inputs)
    to_reference = getattr(loaded.adapter, "reference_state_dict", None)
    state = to_reference(model) if to_reference else model.state_dict()
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": EXPORT_FORMAT, "model": str(cfg.model.name), "run_id": loaded.manifest["run_id"],
            "step": str(loaded.manifest["step"])}
    ck.write_atomic(out / "model.safetensors", lambda p: save_file(state, str(p), metadata=meta))
    info = {"format": EXPORT_FORMAT, "model": str(cfg.model.name), "options": options,
            "checkpoint": str(loaded.path), "run_id": loaded.manifest["run_id"], "step": loaded.manifest["step"],
            "bn_recalibrated_batches": n_cal, "branch_scales_folded": loaded.branch_scales,
            "rebuild": "subnetdp.export.load_reference(OUT), or the plugin's reference_model(options) "
                       "then load_state_dict(safetensors.torch.load_file(OUT/model.safetensors))"}
    ck.write_text_atomic(out / "reference.json", json.dumps(info, indent=2))
    return out


def load_reference(out: str | Path, pm: PluginManager | None = None) -> nn.Module:
    """Rebuild an exported model: the plain reference architecture with its weights, in eval mode."""
    from safetensors.torch import load_file

    out = Path(out)
    info_path = out / "reference.json"
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SubnetdpError(f"{info_path}: cannot be read ({e}): not a subnetdp export") from None
    if not isinstance(info, dict) or info.get("format") != EXPORT_FORMAT:
        raise SubnetdpError(f"{info_path}: not a subnetdp export (format {EXPORT_FORMAT} expected)")
    cls = (pm or PluginManager()).registries["model"].get(str(info["model"]))
    model = cls.reference_model(dict(info["options"]))
    try:
        state = load_file(str(out / "model.safetensors"))
    except Exception as e:
        raise SubnetdpError(f"{out / 'model.safetensors'}: not a readable safetensors file ({e})") from None
    model.load_state_dict(state)
    return model.eval()
