"""Configuration: OmegaConf structured schemas, composition and validation with clear errors.

Composition, lowest first: each selected plugin's ``Config`` defaults, its file
``configs/<group>/<name>.yaml``, ``configs/defaults.yaml``, the recipe, then ``key=value``
overrides. Everything here runs before any process group exists.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from subnetdp.core.errors import ConfigError, suggest

PLUGIN_GROUPS = ("model", "masker", "comm", "data")


@dataclass
class SyncConfig:
    bucket_cap_mb: float = 25.0
    max_groups: int = 64


@dataclass
class OptimConfig:
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    clip_grad_norm: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 100
    batch_size: int = 32
    grad_accum: int = 1
    precision: str = "fp32"  # fp32 | bf16 (autocast; FSDP2's MixedPrecisionPolicy when sharded)
    activation_checkpointing: int = 0  # k: recompute every k-th materialised block; 0 = off
    compile: bool = False  # torch.compile each materialised block
    compile_backend: str = "inductor"
    device: str = "auto"
    log_every: int = 10
    memory_step: int = 2
    progress: bool = True
    on_nonfinite: str = "stop"
    # Every N steps: cosine of SDP's averaged gradient with the full-batch DDP gradient (0 = off).
    grad_alignment_every: int = 0


@dataclass
class EvalConfig:
    every: int = 0
    batches: int = 0
    batch_size: int = 256
    bn_recalibrate_batches: int = 20
    # Block-level forward masking: the union model's residual branches at x1, or each scaled by its
    # training keep rate k(u)/W (the stochastic-depth rule; docs/evidence.md says why it is the default).
    block_union: str = "rescaled"
    # At the last step, also evaluate the union at x1 and rescaled and every rank's own subnetwork on
    # the same validation batches (block-level forward masking; summary.json "eval_union").
    breakdown: bool = False


@dataclass
class LaunchConfig:
    nproc: int = 1
    threads_per_rank: int = 0


@dataclass
class RunDirConfig:
    dir: str = "runs"
    name: str = ""
    tensorboard: bool = True


@dataclass
class CheckpointConfig:
    """``checkpoint.*``: see docs/checkpoints.md."""

    enabled: bool = True
    every: int = 0  # 0 = only at the end
    keep: int = 2  # complete checkpoints kept, newest first; 0 = all


@dataclass
class FSDPConfig:
    """``fsdp.*``: FSDP2 sharding inside each replica (docs/fsdp.md)."""

    shard_size: int = 1  # S ranks hold one subnetwork and shard it; 1 = no FSDP
    reshard_after_forward: bool = True  # ZeRO-3; false keeps the gathered block until backward (ZeRO-2)
    reduce_each_micro_batch: bool = True  # false: one reduce-scatter per step, unsharded gradients kept meanwhile


@dataclass
class RunConfig:
    """The non-plugin sections. Plugin groups (``model``, ``masker``, ``comm``, ``data``) are
    mounted from the selected plugin's ``Config`` at composition time."""

    seed: int = 0
    sync: SyncConfig = field(default_factory=SyncConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    run: RunDirConfig = field(default_factory=RunDirConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    resume: str = "never"  # never | auto | PATH of a checkpoint


CHOICES = {
    "masker.granularity": ("block", "neuron"),
    "masker.regime": ("forward", "backward"),
    "optim.name": ("sgd", "adamw", "adam"),
    "optim.schedule": ("cosine", "constant"),
    "train.precision": ("fp32", "bf16"),
    "train.compile_backend": ("inductor", "aot_eager", "eager"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.on_nonfinite": ("stop", "skip"),
    "eval.block_union": ("rescaled", "x1"),
}


def config_root() -> Path:
    """The ``configs`` folder: inside an installed wheel, else at the repository root."""
    here = Path(__file__).resolve().parent.parent
    packaged = here / "_configs"
    return packaged if packaged.is_dir() else here.parent / "configs"


def resolve_recipe(recipe: str) -> Path:
    """A recipe path, or a bare name looked up in ``configs/recipes``."""
    p = Path(recipe)
    if p.is_file():
        return p
    candidate = config_root() / "recipes" / (recipe if recipe.endswith(".yaml") else f"{recipe}.yaml")
    if candidate.is_file():
        return candidate
    known = sorted(f.stem for f in (config_root() / "recipes").glob("*.yaml"))
    raise ConfigError("recipe", recipe, f"no such file; built-in recipes: {', '.join(known)}"
                      + suggest(p.stem, known))


def _load_yaml(path: Path, what: str) -> DictConfig:
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # a YAML syntax error, reported with the file
        raise ConfigError(what, str(path), f"cannot be parsed: {e}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(what, str(path), "must hold a mapping of config keys")
    return cfg


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``key=value`` strings into a config; anything else is an error naming the bad item's key."""
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError("override", item, "is not of the form key=value",
                              "write e.g. masker.coverage=0.5")
        key, value = item.split("=", 1)
        try:  # one by one, so an error names the key whose value YAML cannot read
            OmegaConf.from_dotlist([item])
        except Exception as e:  # YAML scanner/parser/constructor errors and OmegaConf's own
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(key, value, f"cannot be parsed as a YAML value ({first})",
                              f"quote it, e.g. {key}='\"{value}\"'") from None
    return OmegaConf.from_dotlist(list(overrides))


def _resolve(cfg: DictConfig) -> None:
    """Resolve ``${...}`` interpolations once, so a bad one is a ConfigError naming its key."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", "") or "config")
        msg = str(getattr(e, "msg", e)).splitlines()[0]
        raw: Any = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            raw = raw.get(part) if isinstance(raw, dict) else None
        raise ConfigError(key, raw, f"interpolation cannot be resolved: {msg}", "refer to an existing key, without cycles") from None


def _shown(layer: DictConfig, key: Any) -> Any:
    """A value for an error message: containers are shown as ``{...}``."""
    node = layer._get_node(key)
    if isinstance(node, (DictConfig, ListConfig)):
        return "{...}"
    return node._value() if node is not None else None


def _check_keys(layer: Any, schema: Any, prefix: str, source: str) -> None:
    """Every key in ``layer`` must exist in ``schema``: else a ConfigError with close matches."""
    if not isinstance(layer, DictConfig):
        return
    for key in layer.keys():
        full = f"{prefix}{key}"
        if not isinstance(schema, DictConfig) or key not in schema.keys():
            valid = sorted(schema.keys()) if isinstance(schema, DictConfig) else []
            raise ConfigError(full, _shown(layer, key),
                              f"unknown key (from {source}); valid keys here: {', '.join(map(str, valid))}"
                              + suggest(str(key), map(str, valid)))
        child = schema._get_node(key)
        sub = layer._get_node(key)
        if isinstance(sub, DictConfig) and isinstance(child, DictConfig):
            _check_keys(sub, child, f"{full}.", source)
        elif isinstance(sub, DictConfig) and isinstance(child, ListConfig):
            raise ConfigError(full, "{...}", f"takes a list, not sub-keys (from {source})", f"write {full}=[...]")


def _merge(base: DictConfig, layer: Any, source: str, prefix: str = "") -> DictConfig:
    if layer is None:
        return base
    _check_keys(layer, base, prefix, source)
    try:
        return OmegaConf.merge(base, layer)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = f"{prefix}{e.full_key}" if getattr(e, "full_key", None) else prefix.rstrip(".")
        value = OmegaConf.select(layer, str(e.full_key)) if getattr(e, "full_key", None) else None
        msg = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(key, value, f"wrong type ({source}): {msg}") from None
    except (TypeError, ValueError) as e:  # OmegaConf lets a few container clashes through as these
        key = prefix.rstrip(".") or ", ".join(map(str, layer.keys()))
        raise ConfigError(key, None, f"cannot be merged ({source}): {e}") from None


def compose(recipe: str | None = None, overrides: Sequence[str] = (),
            registries: dict[str, Any] | None = None) -> DictConfig:
    """Build the resolved, validated run config.

    Args:
        recipe: a recipe file or built-in recipe name, or None.
        overrides: ``key=value`` strings, applied last.
        registries: kind -> :class:`~subnetdp.core.plugins.Registry`; built from entry points if None.
    """
    if registries is None:
        from subnetdp.core.plugins import PluginManager
        registries = PluginManager().registries
    layers: list[tuple[DictConfig, str]] = [(_load_yaml(config_root() / "defaults.yaml", "defaults"), "defaults.yaml")]
    if recipe:
        path = resolve_recipe(recipe)
        layers.append((_load_yaml(path, "recipe"), f"recipe {path.name}"))
    layers.append((parse_overrides(overrides), "command line"))

    top = OmegaConf.structured(RunConfig)
    for layer, source in layers:
        for key in layer.keys():
            if key not in top.keys() and key not in PLUGIN_GROUPS:
                valid = sorted(list(top.keys()) + list(PLUGIN_GROUPS))
                raise ConfigError(str(key), _shown(layer, key),
                                  f"unknown top-level key (from {source}); valid: {', '.join(valid)}"
                                  + suggest(str(key), valid))
    cfg = top
    for layer, source in layers:
        rest = OmegaConf.masked_copy(layer, [k for k in layer.keys() if k not in PLUGIN_GROUPS])
        cfg = _merge(cfg, rest, source)

    for group in PLUGIN_GROUPS:
        name = None
        for layer, _ in layers:
            sel = OmegaConf.select(layer, f"{group}.name", default=None)
            if sel is not None:
                name = sel
        if name is None:
            raise ConfigError(f"{group}.name", None, "no plugin selected", f"set {group}.name")
        cls = registries[group].get(str(name), f"{group}.name")
        node = OmegaConf.structured(cls.Config)
        plugin_file = cls.config_file or config_root() / group / f"{name}.yaml"
        if Path(plugin_file).is_file():
            node = _merge(node, _load_yaml(Path(plugin_file), f"{group}.name"), f"{Path(plugin_file).name}", f"{group}.")
        for layer, source in layers:
            sub = layer.get(group)
            if isinstance(sub, DictConfig):
                node = _merge(node, sub, source, f"{group}.")
            elif sub is not None:
                raise ConfigError(group, sub, f"must be a mapping (from {source})", f"write {group}.name=...")
        node.name = str(name)
        OmegaConf.set_struct(cfg, False)
        cfg[group] = node
        OmegaConf.set_struct(cfg, True)
    _resolve(cfg)
    validate(cfg, registries)
    return cfg


def _check_choice(cfg: DictConfig, key: str, choices: Iterable[str]) -> None:
    value = OmegaConf.select(cfg, key)
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(key, value, f"valid choices: {', '.join(choices)}" + suggest(str(value), choices))


def _check_range(cfg: DictConfig, key: str, lo: float | None, hi: float | None, lo_open: bool = False,
                 fix: str = "") -> None:
    value = OmegaConf.select(cfg, key)
    bad = (lo is not None and (value < lo or (lo_open and value == lo))) or (hi is not None and value > hi)
    if bad:
        lo_s = "" if lo is None else ("(" if lo_open else "[") + str(lo)
        hi_s = "" if hi is None else str(hi) + "]"
        raise ConfigError(key, value, f"must be in {lo_s}, {hi_s}".replace(" ,", ",") if lo is not None and hi is not None
                          else f"must be {'>' if lo_open else '>='} {lo}", fix)


def validate(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """Range and choice checks, then each selected plugin's own ``validate_config``."""
    for key, choices in CHOICES.items():
        _check_choice(cfg, key, choices)
    _check_range(cfg, "masker.coverage", 0.0, 1.0, lo_open=True, fix="use a coverage such as 0.5 (1 = plain DDP)")
    _check_range(cfg, "masker.min_owners", 1, None)
    _check_masker_counts(cfg)
    _check_range(cfg, "train.steps", 1, None)
    _check_range(cfg, "train.batch_size", 1, None)
    _check_range(cfg, "train.grad_accum", 1, None)
    _check_range(cfg, "train.log_every", 1, None)
    _check_range(cfg, "optim.lr", 0.0, None)
    _check_range(cfg, "sync.bucket_cap_mb", 0.0, None, lo_open=True)
    _check_range(cfg, "sync.max_groups", 1, None)
    _check_range(cfg, "launch.nproc", 1, None)
    _check_range(cfg, "launch.threads_per_rank", 0, None)
    _check_range(cfg, "train.activation_checkpointing", 0, None, fix="0 turns it off, 1 checkpoints every block")
    _check_checkpoint_keys(cfg)
    _check_fsdp(cfg)
    _check_range(cfg, "train.grad_alignment_every", 0, None, fix="0 turns the probe off")
    if int(cfg.train.grad_alignment_every) and int(cfg.fsdp.shard_size) > 1:
        raise ConfigError("train.grad_alignment_every", int(cfg.train.grad_alignment_every),
                          f"the probe needs whole gradients, and fsdp.shard_size={int(cfg.fsdp.shard_size)} shards them",
                          "use fsdp.shard_size=1 for the probe, or train.grad_alignment_every=0")
    adapter = registries["model"].get(cfg.model.name)
    _check_regularizers(cfg, adapter)
    if cfg.masker.granularity not in adapter.granularities:
        raise ConfigError("masker.granularity", cfg.masker.granularity,
                          f"model '{cfg.model.name}' supports: {', '.join(adapter.granularities)}")
    for group in PLUGIN_GROUPS:
        registries[group].get(cfg[group].name).validate_config(cfg[group], cfg)


def _check_regularizers(cfg: DictConfig, adapter: Any) -> None:
    """``model.stochastic_depth`` / ``model.hidden_dropout``: drop probabilities in [0, 1) that the
    model adapter implements."""
    for key in ("stochastic_depth", "hidden_dropout"):
        value = OmegaConf.select(cfg, f"model.{key}", default=0.0) or 0.0
        if not 0.0 <= float(value) < 1.0:
            raise ConfigError(f"model.{key}", value, "is a drop probability and must be in [0, 1)",
                              f"use e.g. model.{key}=0.5 for a keep rate of 0.5 (0 turns it off)")
        if value and key not in getattr(adapter, "regularizers", ()):
            raise ConfigError(f"model.{key}", value, f"model '{cfg.model.name}' does not implement it",
                              f"set model.{key}=0")


def _check_checkpoint_keys(cfg: DictConfig) -> None:
    """``checkpoint.*`` ranges and ``resume`` (``never``, ``auto`` or an existing path)."""
    _check_range(cfg, "checkpoint.every", 0, None, fix="0 saves only at the end")
    _check_range(cfg, "checkpoint.keep", 0, None, fix="0 keeps every checkpoint")
    resume = str(cfg.resume)
    if resume != "never" and int(OmegaConf.select(cfg, "masker.resample_every", default=0) or 0) > 0:
        raise ConfigError("resume", resume, f"runs whose plan is re-drawn (masker.resample_every="
                          f"{cfg.masker.resample_every}) cannot be resumed in this release",
                          "use resume=never, or masker.resample_every=0")
    if resume == "auto":
        if not cfg.run.name:
            raise ConfigError("resume", "auto", "needs a fixed run.name, so a restarted job finds its run directory",
                              "add run.name=NAME (the same on every start)")
    elif resume != "never" and not Path(resume).exists():
        raise ConfigError("resume", resume, "is neither never, auto nor an existing checkpoint path",
                          "use resume=auto, or the path of a checkpoints/step_XXXXXXXX directory")


def _check_fsdp(cfg: DictConfig) -> None:
    """``fsdp.shard_size > 1`` composes with forward, block-level masking over torch.distributed only."""
    _check_range(cfg, "fsdp.shard_size", 1, None, fix="1 turns FSDP off")
    size = int(cfg.fsdp.shard_size)
    if size == 1:
        return
    needs = (("masker.granularity", "block", "FSDP shards whole blocks; neuron-level units would cut its shards"),
             ("masker.regime", "forward", "backward masking broadcasts whole units, which FSDP holds in shards"),
             ("masker.resample_every", 0, "a re-drawn plan would have to re-shard the blocks"))
    for key, want, why in needs:
        value = OmegaConf.select(cfg, key, default=want)
        if value != want:
            raise ConfigError(key, value, f"fsdp.shard_size={size} needs {key}={want}: {why}",
                              f"set {key}={want}, or fsdp.shard_size=1")
    if cfg.comm.name not in ("gloo", "nccl"):
        raise ConfigError("comm.name", cfg.comm.name, f"fsdp.shard_size={size} needs torch.distributed process "
                          "groups (FSDP2 all-gathers and reduce-scatters through them)",
                          "use comm.name=gloo (CPU) or comm.name=nccl (GPU)")


def check_world(cfg: DictConfig, world_size: int) -> int:
    """The number of replicas R = W / S, or a ConfigError when ``fsdp.shard_size`` does not divide W."""
    size = int(cfg.fsdp.shard_size)
    if world_size % size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError("fsdp.shard_size", size, f"must divide the world size {world_size} "
                          f"(world = replicas x shard_size)", f"use one of {divisors}, or change the number of ranks")
    return world_size // size


def _check_masker_counts(cfg: DictConfig) -> None:
    """``units_per_layer`` and ``refresh_every`` at least 1, ``resample_every`` at least 0."""
    for key, lo, fix in (("units_per_layer", 1, "the default is 8"),
                         ("refresh_every", 1, "1 refreshes non-owned copies after every step"),
                         ("resample_every", 0, "0 keeps the plan fixed")):
        if OmegaConf.select(cfg, f"masker.{key}") is not None:
            _check_range(cfg, f"masker.{key}", lo, None, fix=fix)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def digest(cfg: DictConfig, ignore: Sequence[str] = ("launch", "run")) -> str:
    """Hash of the config without per-process keys, compared across ranks."""
    c = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(c, dict)
    for k in ignore:
        c.pop(k, None)
    return hashlib.sha256(OmegaConf.to_yaml(OmegaConf.create(c)).encode()).hexdigest()[:16]


def default_run_name(cfg: DictConfig, world_size: int) -> str:
    """A run name from what distinguishes runs; the caller adds a timestamp once, on rank 0."""
    variant = getattr(cfg.model, "variant", "") or cfg.model.name
    return f"{variant}-{cfg.masker.granularity}-c{cfg.masker.coverage:g}-w{world_size}"


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
