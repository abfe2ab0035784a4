"""The union model from a checkpoint's files alone: evaluate it, or export it for use without subnetdp.

Everything here runs in one process, without a process group::

    subnetdp eval RUN_DIR|CHECKPOINT        # metrics of the union model (newest checkpoint of a run)
    subnetdp export CHECKPOINT OUT          # OUT/model.safetensors + OUT/reference.json

    import subnetdp.evaluate.export
    model = subnetdp.evaluate.export.load_reference("OUT")   # e.g. a plain torchvision ResNet, weights loaded

The union model is assembled as :func:`subnetdp.sdp.union.assemble_union` does inside a run, one
piece at a time from the files the manifest's index names (:func:`fill_union`): every parameter
piece is stored once (all its owners held the same values), float buffers are averaged among the
owners' own copies, integer buffers taken from ``min(owners)`` (per ``plan.json``), shared float
buffers averaged over all ranks. The model is built once and filled in place; export writes it
tensor by tensor (:func:`~subnetdp.train.checkpoints.files.save_safetensors`), so no second copy of
the model is ever held. With block-level forward masking and ``eval.block_union=rescaled`` (the default) each
residual branch is then scaled by its training keep rate, folded into the branch's last affine
layer, as the in-run evaluation does (``reference.json`` lists the scales). Export then recalibrates BatchNorm statistics on ``eval.bn_recalibrate_batches`` training
batches, as the in-run evaluation does, so the exported model scores the run's metric exactly.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from subnetdp.core import records
from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints import units
from subnetdp.train.checkpoints.source import read_plan
from subnetdp.core.contracts import DataSpec, ModelAdapter, Partition, TensorSlice
from subnetdp.core.errors import CheckpointError, ConfigError, SubnetdpError
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.construct import meta_model, poison, poisoned, to_empty
from subnetdp.sdp.variants import partition_model
from subnetdp.core.plugins import PluginManager
from subnetdp.sdp.branches import fold_branch_scales
from subnetdp.sdp.union import evaluate, recalibrate_batchnorm, union_branch_scales

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


def _config(ckpt: Path, manifest: dict[str, Any], pm: PluginManager, data: Sequence[str] = ()) -> Any:
    """The checkpoint's config, with what this invocation decides instead: where files are written,
    and with ``data`` (``data.key=value`` the user typed) their data.

    What a checkpoint's ``config.yaml`` is trusted with: the model, masker, seed and evaluation
    settings (they build tensors and read nothing). It is data: loaded without resolving anything,
    refused if it holds an interpolation (:func:`~subnetdp.core.stored.load_stored`). It never
    chooses where files are written: every key declared ``writes`` (``data.cache_dir``,
    ``data.download``, ``run.dir``) takes this invocation's value, the default or the user's
    ``data.KEY=...``. Its ``data.*`` section names files to read, so it is used only when the data
    module says reading them cannot run code (:meth:`~subnetdp.core.contracts.DataModule.unsafe_to_open`);
    otherwise the user names the data, and any ``data.*`` override other than a write key replaces
    the checkpoint's whole data section.
    """
    from omegaconf import OmegaConf

    from subnetdp.core.config import parse_overrides
    from subnetdp.core.stored import drop_keys, invocation_keys, load_stored
    from subnetdp.train.configure import load_config

    path = ck.verify_file(ckpt, "config.yaml", manifest)
    for item in data:
        key = item.split("=", 1)[0]
        if not key.startswith("data."):
            raise ConfigError(key, item.split("=", 1)[-1], "eval and export take data.* overrides only (the "
                              "rest of the config is the checkpoint's)", "e.g. data.root=DIR")
    parse_overrides(data)  # a malformed override names its key before the checkpoint is read
    raw = load_stored(path)
    local = invocation_keys(raw, pm.registries)
    replaced = any(item.split("=", 1)[0] not in local for item in data)
    if replaced:  # the user's data replaces the checkpoint's whole data section; its name is the default
        name = OmegaConf.select(raw, "data.name", default=None)
        raw.data = OmegaConf.create({"name": name} if name is not None else {})
    drop_keys(raw, local)
    with tempfile.TemporaryDirectory() as tmp:
        recipe = str(Path(tmp) / "config.yaml")
        OmegaConf.save(raw, recipe)
        try:
            # Training-only keys are neutral here: no resume, and no warm-up for a stored run shorter
            # than its warm-up (refused for training since; the optimizer is never built here).
            cfg = load_config(recipe, ["resume=never", "launch.nproc=1", "optim.warmup_steps=0", *data], pm.registries)
        except SubnetdpError as e:
            where = "with the data given" if data else "with the installed plugins"
            raise CheckpointError(f"{path}: no longer a valid config {where} ({e})") from None
    if not replaced:
        reason = pm.registries["data"].get(cfg.data.name).unsafe_to_open(cfg.data)
        if reason:
            raise CheckpointError(
                f"{path}: selects data.name={cfg.data.name} data.root={cfg.data.get('root')}, but {reason}; a "
                "checkpoint is not trusted to choose data whose reading can run code — evaluate on data you "
                f"choose: subnetdp eval {ckpt} data.root=DIR (checksums verified), adding "
                "data.verify_checksums=false only for files you trust")
    return cfg


def _skeleton(ckpt: Path, manifest: dict[str, Any], adapter: ModelAdapter, cfg: Any,
              spec: DataSpec) -> tuple[nn.Module, Partition]:
    """The union model on ``meta`` and its partition, from the checkpoint's settings and data spec."""
    try:
        model = meta_model(adapter, spec)
        return model, partition_model(adapter, model, cfg.masker, spec)
    except SubnetdpError:
        raise
    except Exception as e:  # the settings are the checkpoint's data: a model they cannot build is its fault
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{ckpt}: its model settings and data spec {manifest['data_spec']} build no "
                              f"{cfg.model.name} model ({type(e).__name__}: {first})") from None


def _check_size(ckpt: Path, manifest: dict[str, Any], model: nn.Module) -> None:
    """Every tensor of the union is read from the checkpoint's files, so they hold at least its bytes:
    settings that describe a bigger model (a crafted data spec) are refused before it is allocated."""
    need = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    held = 0
    for name in manifest["files"]:  # plain names (read_manifest); links are not the checkpoint's bytes
        try:
            info = os.lstat(ckpt / name)
        except OSError:
            continue
        held += info.st_size if stat.S_ISREG(info.st_mode) else 0
    if need > held:
        for name in manifest["files"]:  # a missing or truncated file is named as such
            ck.check_size(ckpt, name, manifest)
        raise CheckpointError(f"{ckpt}: its config and {ck.MANIFEST} describe a model of {need:,} bytes, its files "
                              f"hold {held:,}: they do not belong together (an edited data_spec or config.yaml)")


def _plan(ckpt: Path, manifest: dict[str, Any], partition: Partition) -> MaskPlan:
    plan = read_plan(ckpt, manifest)
    if plan.num_units != len(partition.units):
        raise CheckpointError(f"{ckpt / 'plan.json'}: plans {plan.num_units} units, the model has {len(partition.units)}")
    return plan


@torch.no_grad()
def fill_union(model: nn.Module, partition: Partition, plan: MaskPlan, reader: units.PieceReader) -> None:
    """Copy a checkpoint's union into ``model``, one piece at a time (nothing else is held).

    Parameters: each piece once, from the file the index names (every owner held the same values).
    Buffers: float ones averaged over the owners' copies (summed in rank order, then divided, as the
    in-run all-reduce does), integer ones from ``min(owners)``; shared buffers over all ranks. A
    checkpoint assembled from the survivors of a lost worker has no files of the dead ranks
    (``absent_ranks``): their buffers are left out, as a resume does.
    """
    target = dict(model.named_parameters())
    target.update(dict(model.named_buffers()))
    absent = set(reader.manifest.get("absent_ranks", ()))
    world = tuple(r for r in range(plan.world_size) if r not in absent)

    def dst_of(s: Any) -> torch.Tensor:
        return target[s.name] if s.dim is None else target[s.name].narrow(s.dim, s.start, s.stop - s.start)

    def fill_buffer(s: Any, owners: tuple[int, ...]) -> None:
        units.read_buffer_mean(reader, units.piece_key(s.name, s.dim, s.start, s.stop), owners, dst_of(s))

    for unit in partition.units:
        for s in unit.slices:
            reader.read_into(units.piece_key(s.name, s.dim, s.start, s.stop), dst_of(s))
        for s in unit.buffers:
            fill_buffer(s, tuple(r for r in plan.owners(unit.id) if r not in absent))
    for name in partition.shared:
        reader.read_into(name, target[name])
    for name in partition.shared_buffers:
        fill_buffer(TensorSlice(name), world)


#: What a run writes into its directory and never into a checkpoint (both hold config.yaml and plan.json).
RUN_RECORDS = ("metrics.jsonl", "summary.json", "tensorboard")


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory's newest checkpoint; a run that kept none says so.

    Raises:
        CheckpointError: for a run directory without ``checkpoints/``, naming how to keep one.
    """
    path = Path(path)
    if not (path / ck.MANIFEST).is_file() and not ck.checkpoints_dir(path).exists():
        found = [name for name in RUN_RECORDS if (path / name).exists()]
        if found:
            raise CheckpointError(
                f"{path}: a run directory ({', '.join(found)}) whose run kept no checkpoint: "
                "checkpoint.enabled=false writes none, and checkpoint.final=auto keeps none after a short run "
                "(fewer than 1000 steps, no checkpoint.every, resume=never) — train it again with "
                "checkpoint.final=always to keep the final model (or checkpoint.every=N for one every N steps)")
    return ck.resolve_checkpoint(path)


@torch.no_grad()
def load_union(path: str | Path, pm: PluginManager | None = None, data: Sequence[str] = ()) -> LoadedUnion:
    """The union model of a checkpoint (or of a run directory's newest checkpoint), on CPU.

    ``data``: ``data.key=value`` overrides naming the data to evaluate on instead of the checkpoint's.
    """
    pm = pm or PluginManager()
    ckpt = find_checkpoint(Path(path))
    manifest = ck.read_manifest(ckpt)
    cfg = _config(ckpt, manifest, pm, data)
    adapter = pm.registries["model"].get(cfg.model.name)(cfg.model)
    spec = DataSpec(**manifest["data_spec"])
    # Built once, on meta (structure only), then given storage: every tensor is read from the pieces.
    model, partition = _skeleton(ckpt, manifest, adapter, cfg, spec)
    plan = _plan(ckpt, manifest, partition)
    _check_size(ckpt, manifest, model)
    to_empty(model, "cpu")
    poison(model)
    fill_union(model, partition, plan, units.PieceReader(ckpt, manifest))
    unset = poisoned(model)
    if unset:
        raise CheckpointError(f"{ckpt}: holds no value for {unset[:3]} of the union model: the checkpoint is incomplete")
    # eval.block_union=rescaled: the union the run evaluated, with each branch x its keep rate.
    layers = adapter.branch_output_layers(model)
    scales = {n: s for n, s in union_branch_scales(cfg, partition, plan).items() if layers.get(n)}
    fold_branch_scales(layers, scales)
    return LoadedUnion(model, cfg, adapter, spec, manifest, ckpt, scales)


def evaluate_checkpoint(path: str | Path, pm: PluginManager | None = None,
                        data: Sequence[str] = ()) -> tuple[LoadedUnion, dict[str, float]]:
    """The run's eval metrics of a checkpoint's union model (BatchNorm recalibrated as in the run).

    ``data``: ``data.key=value`` overrides naming the data to evaluate on instead of the checkpoint's.
    """
    pm = pm or PluginManager()
    loaded = load_union(path, pm, data)
    data = _data(loaded, pm)
    return loaded, evaluate(loaded.model, loaded.adapter, data, loaded.cfg)


def _data(loaded: LoadedUnion, pm: PluginManager) -> Any:
    cfg = loaded.cfg
    data = pm.registries["data"].get(cfg.data.name)(cfg.data, seed=cfg.seed)
    data.check()
    if data.spec() != loaded.spec:
        raise ConfigError("data.name", cfg.data.name, f"gives data of shape {data.spec()}, the checkpoint's "
                          f"model was trained on {loaded.spec}", "choose data of the same kind and size "
                          "(e.g. the same data.image_size)")
    return data


def export(path: str | Path, out: str | Path, recalibrate: bool = True, pm: PluginManager | None = None,
           data: Sequence[str] = ()) -> Path:
    """Write the union model as the reference architecture's plain ``state_dict`` and its options.

    Args:
        path: a checkpoint directory, or a run directory (its newest checkpoint).
        out: output folder; receives ``model.safetensors`` and ``reference.json``.
        recalibrate: recompute BatchNorm statistics on ``eval.bn_recalibrate_batches`` training
            batches first, as the run's own evaluation does.
        data: ``data.key=value`` overrides naming the recalibration data instead of the checkpoint's.
    """
    pm = pm or PluginManager()
    loaded = load_union(path, pm, data)
    cfg, model = loaded.cfg, loaded.model
    options = loaded.manifest.get("reference")
    if options is None:
        raise SubnetdpError(f"model plugin '{cfg.model.name}' does not say how to rebuild its reference "
                            "architecture (reference_options / reference_model): it cannot be exported")
    n_cal = cfg.eval.bn_recalibrate_batches if recalibrate else 0
    if n_cal > 0:
        batches = iter(_data(loaded, pm).train_loader(0, 1, cfg.train.batch_size))
        n_cal = recalibrate_batchnorm(model, batches, n_cal, loaded.adapter.inputs)
    # The model's own tensors (views): written one at a time, never copied as a whole.
    state = loaded.adapter.reference_state_dict(model)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": EXPORT_FORMAT, "model": cfg.model.name, "run_id": loaded.manifest["run_id"],
            "step": str(loaded.manifest["step"])}
    ck.write_atomic(out / "model.safetensors", lambda p: ck.save_safetensors(p, state, meta))
    info = {"format": EXPORT_FORMAT, "model": cfg.model.name, "options": options,
            "checkpoint": str(loaded.path), "run_id": loaded.manifest["run_id"], "step": loaded.manifest["step"],
            "bn_recalibrated_batches": n_cal, "branch_scales_folded": loaded.branch_scales,
            "rebuild": "subnetdp.evaluate.export.load_reference(OUT), or the plugin's reference_model(options) "
                       "then load_state_dict(safetensors.torch.load_file(OUT/model.safetensors))"}
    ck.write_text_atomic(out / "reference.json", json.dumps(info, indent=2))
    return out


def load_reference(out: str | Path, pm: PluginManager | None = None) -> nn.Module:
    """Rebuild an exported model: the plain reference architecture with its weights, in eval mode."""
    from safetensors.torch import load_file

    out = Path(out)
    info_path = out / "reference.json"
    try:
        info = records.read_json(info_path)
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
