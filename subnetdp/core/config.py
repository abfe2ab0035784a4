"""Configuration: OmegaConf structured schemas, composition and validation with clear errors.

Composition, lowest first: each selected plugin's ``Config`` defaults, its file
``configs/<group>/<name>.yaml``, ``configs/defaults.yaml``, the recipe, then ``key=value``
overrides. Everything here runs before any process group exists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import BooleanNode, ValueNode

from subnetdp.core.contracts import CommConfig, DataConfig, MaskerConfig, ModelConfig
from subnetdp.core.errors import ConfigError, suggest
from subnetdp.core.fields import Bounds, check_declared, declared, doc

PLUGIN_GROUPS = ("model", "masker", "comm", "data")
MAX_THREADS_PER_RANK = 1024  # launch.threads_per_rank: more cores than any one node gives a rank


@dataclass
class SyncConfig:
    """``sync.*``: owner-group buckets; ``mode=local_steps`` synchronises every ``every`` steps
    (docs/local_steps.md)."""

    bucket_cap_mb: float = doc('gradient bucket size (MiB) of the owner-group all-reduces', 25.0, lo=0.0, lo_open=True)
    max_groups: int = doc('most distinct owner sets before the synchroniser falls back to dense averaging', 64, lo=1)
    mode: str = doc('every_step or local_steps (owners average parameter deltas every sync.every steps, DiLoCo-style)', "every_step",
                    choices=("every_step", "local_steps"))
    every: int = doc('local_steps: inner steps per synchronisation (H)', 16, lo=1, fix="1 synchronises after every step")
    outer_lr: float = doc('local_steps: outer SGD learning rate (1 with momentum 0 = plain averaging, the default; DiLoCo: 0.7)', 1.0,
                          lo=0.0, lo_open=True, fix="1 with sync.outer_momentum=0 is plain averaging")
    outer_momentum: float = doc('local_steps: outer Nesterov momentum (DiLoCo: 0.9, for runs of many outer steps)', 0.0,
                                lo=0, hi=1, hi_open=True, fix="0 turns outer momentum off; DiLoCo uses 0.9")
    outer_on_host: bool = doc('local_steps: keep the outer state (anchor, momentum) in host memory', False)
    stop_every_step: bool = doc('local_steps: agree on a stop signal after every step (one world all-reduce a step) '
                                'instead of at synchronisations, where a stop waits up to sync.every - 1 steps', False)
    warmup_steps: int = doc('local_steps: steps synchronised after every step before local steps begin (DiLoCo '
                            'warm-starts from a per-step-trained model); a multiple of sync.every', 0, lo=0,
                            fix="0 starts local steps at the first step")


@dataclass
class OptimConfig:
    name: str = doc('torch.optim by name: sgd, adamw, adam', "sgd", choices=("sgd", "adamw", "adam"))
    # 0 would train nothing: a run that cannot learn is a typo, not a setting.
    lr: float = doc('peak learning rate', 0.1, lo=0.0, lo_open=True, fix="use e.g. 0.1 for SGD or 1e-3 for AdamW")
    momentum: float = doc('SGD momentum', 0.9, lo=0.0, hi=1.0, fix="0 turns momentum off; 0.9 is usual")
    nesterov: bool = doc('SGD Nesterov momentum', False)
    betas: list[float] = doc('Adam/AdamW betas (two numbers in [0, 1))', factory=lambda: [0.9, 0.999])
    eps: float = doc('Adam/AdamW epsilon', 1e-8, lo=0.0, lo_open=True, fix="1e-8 is usual")
    # At most 1: a coefficient above it outweighs any gradient (SGD's L2 term) or shrinks the weights
    # by more than lr per step (AdamW's decoupled decay); published recipes use 1e-4 to 0.1.
    weight_decay: float = doc('weight decay (at most 1)', 5e-4, lo=0.0, hi=1.0,
                              fix="0 turns weight decay off; 5e-4 (SGD) or 0.1 (AdamW) is usual")
    schedule: str = doc('cosine or constant, after linear warm-up', "cosine", choices=("cosine", "constant"))
    warmup_steps: int = doc('linear warm-up steps (at most train.steps)', 0, lo=0, fix="0 starts at the full learning rate")
    clip_grad_norm: float = doc("clip the averaged gradient's global norm to this (0 = off)", 0.0, lo=0.0,
                                fix="0 turns clipping off")


@dataclass
class TrainConfig:
    steps: int = doc('optimizer steps', 100, lo=1)
    flop_matched: bool = doc("train round(train.steps / r) steps instead, r = the plan's training FLOPs per step "
                             "over the full model's (subnetdp plan shows both): the compute of train.steps "
                             "full-model steps, the schedule stretched to span them", False)
    batch_size: int = doc('batch size per rank (per micro-batch)', 32, lo=1)
    grad_accum: int = doc('micro-batches per optimizer step', 1, lo=1)
    precision: str = doc("fp32 or bf16 (autocast; FSDP2's MixedPrecisionPolicy when sharded)", "fp32",
                         choices=("fp32", "bf16"))
    activation_checkpointing: int = doc('k: recompute every k-th materialised block in backward; 0 = off', 0, lo=0,
                                        fix="0 turns it off, 1 checkpoints every block")
    compile: bool = doc('torch.compile each materialised block', False)
    compile_backend: str = doc('inductor, aot_eager or eager', "inductor", choices=("inductor", "aot_eager", "eager"))
    device: str = doc('auto, cpu or cuda (cuda needs comm.name=nccl)', "auto", choices=("auto", "cpu", "cuda"))
    log_every: int = doc('steps between log lines (and world-mean losses)', 10, lo=1)
    # Steps count from 1; one past train.steps measures the last step.
    memory_step: int = doc("the step whose tensor memory (and FSDP's bytes) is measured (steps count from 1; "
                           "beyond train.steps: the last)", 2, lo=1, fix="2 is the default (the first step warms up)")
    progress: Optional[bool] = doc("progress bar on rank 0: true, false, or null (the default): only when its output "
                                   "is a terminal (a pipe, a file or a batch job gets plain log lines); log lines "
                                   "are printed either way", None)
    on_nonfinite: str = doc('stop or skip: what an inf/NaN loss or gradient does', "stop", choices=("stop", "skip"))
    grad_alignment_every: int = doc("every N steps: cosine of SDP's averaged gradient with the full-batch DDP gradient (0 = off)", 0,
                                    lo=0, fix="0 turns the probe off")


@dataclass
class EvalConfig:
    every: int = doc('steps between union-model evaluations (0 = at the end only)', 0, lo=0,
                     fix="0 evaluates only at the end")
    batches: int = doc('evaluation batches (0 = the whole held-out split)', 0, lo=0,
                       fix="0 evaluates the whole held-out split")
    batch_size: int = doc('evaluation batch size', 256, lo=1, fix="256 is the default")
    bn_recalibrate_batches: int = doc('training batches that recalibrate BatchNorm statistics of the union model', 20,
                                      lo=0, fix="0 keeps the averaged statistics")
    # Downstream tasks of lm-evaluation-harness on the union model at every evaluation (language
    # models; needs subnetdp[eval]); see docs/downstream.md.
    tasks: list[str] = doc('lm-evaluation-harness tasks run on the union model at every evaluation (language models; subnetdp[eval])', factory=list)
    include_path: str = doc('a folder of lm-eval task YAML files (your own tasks, local data)', "")
    task_limit: float = doc('at most this many documents per task (a fraction if < 1; 0 = all)', 0.0, lo=0.0,
                            fix="0 evaluates every document")
    num_fewshot: Optional[int] = doc("few-shot examples per task (empty: each task's own)", None, lo=0,
                                     fix="0 asks for none; leave it empty for each task's own")
    task_batch_size: int = doc('batch size of the lm-eval requests', 16, lo=1)
    offline: bool = doc('never download task data: the datasets cache and local files only', False)
    block_union: str = doc('block-level forward masking: the union evaluated with each residual branch x its training keep rate k(u)/W (rescaled) or as it is (x1), and a re-plan that raises a rate scales the branch by old/new rate or not; docs/evidence.md', "rescaled",
                           choices=("rescaled", "x1"))
    breakdown: bool = doc("at the last step also evaluate the union at x1 and rescaled and every rank's own subnetwork (summary.json eval_union)", False)


@dataclass
class LaunchConfig:
    nproc: int = doc('local workers started by subnetdp train', 1, lo=1)
    # A fixed cap, not the cores of the machine that composes (a login node for srun): more than any
    # node has cores for one rank, so above it the number is a typo.
    threads_per_rank: int = doc(f'torch threads per rank (0 = the cores shared evenly; at most {MAX_THREADS_PER_RANK})', 0,
                                lo=0, hi=MAX_THREADS_PER_RANK, fix="0 shares the cores evenly among the local ranks")
    nodes: int = doc('nodes of a subnetdp launch job, launch.nproc workers each (the largest number of an elastic job)', 1,
                     lo=1, fix="1 runs on this node alone")
    min_nodes: int = doc('fewest nodes an elastic job goes on with (0 = launch.nodes: not elastic; needs resume=auto)', 0,
                         lo=0, fix="0 makes the job fixed at launch.nodes")
    max_restarts: int = doc("restarts of the worker group after a failure or a lost node (torchrun, subnetdp launch, launch.nproc=N; needs resume=auto)", 0,
                            lo=0, fix="0 ends the job at the first failure")
    rdzv_endpoint: str = doc("HOST:PORT where the nodes' torchrun agents meet (a free port on the node started first)", "")
    rdzv_id: str = doc("the job's rendezvous id, the same on every node (empty: subnetdp-RUN.NAME)", "")
    rdzv_conf: str = doc("torchrun's --rdzv-conf, e.g. last_call_timeout=30,join_timeout=600", "")
    # SLURM and Kubernetes wait 30 s between SIGTERM and SIGKILL by default; a checkpoint of a large
    # model can take longer, hence a longer default here (the launcher says what it waits for).
    stop_timeout_s: float = doc('after SIGINT/SIGTERM, seconds the local workers get to finish their step and checkpoint '
                                'before the launcher kills them', 120.0, lo=1.0, hi=86400.0,
                                fix="120 is the default")


@dataclass
class RunDirConfig:
    dir: str = doc('where run directories go', "runs", writes=True)
    name: str = doc("the run directory's name: one folder name of printable characters (empty: made on rank 0 "
                    "with a timestamp)", "")
    tensorboard: bool = doc('write TensorBoard events', True)
    overwrite: bool = doc('delete what run.dir/run.name holds before a new run starts there (resume=never); '
                          'without it such a run is refused', False, writes=True)


@dataclass
class CheckpointConfig:
    """``checkpoint.*``: see docs/checkpoints.md."""

    enabled: bool = doc('write checkpoints (docs/checkpoints.md)', True)
    every: int = doc('steps between checkpoints (0 = only at the end)', 0, lo=0, fix="0 saves only at the end")
    keep: int = doc('newest complete checkpoints kept (0 = all)', 2, lo=0, fix="0 keeps every checkpoint")
    final: str = doc('auto, always or never: the checkpoint after the last step (auto: when checkpoint.every > 0, resume is not never, or train.steps >= 1000)', "auto",
                     choices=("auto", "always", "never"),
                     fix="auto writes the final checkpoint for long or resumable runs (docs/checkpoints.md)")
    survivors: bool = doc("when a peer dies, every survivor writes its units as of its last finished step, so a "
                          "restart with resume=auto loses no finished step (docs/checkpoints.md)", True)


@dataclass
class FSDPConfig:
    """``fsdp.*``: FSDP2 sharding inside each replica (docs/fsdp.md)."""

    shard_size: int = doc(
        'S: ranks that hold one subnetwork shard it with FSDP2 (world = replicas x S); 1 = no FSDP',
        1, lo=1, fix="1 turns FSDP off")
    reshard_after_forward: bool = doc('ZeRO-3; false keeps the gathered block until backward (ZeRO-2)', True)
    reduce_each_micro_batch: bool = doc(
        'with train.grad_accum > 1; false: one reduce-scatter per step, more memory',
        True)


@dataclass
class RunConfig:
    """The non-plugin sections. Plugin groups (``model``, ``masker``, ``comm``, ``data``) are
    mounted from the selected plugin's ``Config`` at composition time."""

    seed: int = doc('every random choice derives from it (model init, data order, plans)', 0)
    sync: SyncConfig = field(default_factory=SyncConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    run: RunDirConfig = field(default_factory=RunDirConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    resume: str = doc('never, auto (newest checkpoint of run.dir/run.name) or a checkpoint PATH', "never")


SHARED_PLUGIN_SCHEMAS = {"model": ModelConfig, "masker": MaskerConfig, "comm": CommConfig, "data": DataConfig}


def documented_keys() -> list[tuple[str, str, str, str]]:
    """Every key of the run schema and of the plugin groups' shared schemas: (key, type, default, doc).

    A field without a ``doc`` has an empty doc (the config-doc test refuses it).
    """
    def walk(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
        rows = []
        for f in dataclasses.fields(cls):
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            if dataclasses.is_dataclass(kind) or kind in _SECTIONS:
                rows += walk(_SECTIONS[kind], f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if f.name == "name" and prefix[:-1] in SHARED_PLUGIN_SCHEMAS:
                default = OmegaConf.load(config_root() / "defaults.yaml")[prefix[:-1]]["name"]  # the selection
            rows.append((prefix + f.name, kind.replace("Optional[bool]", "bool or empty"),
                         "" if default is None else json.dumps(default), f.metadata.get("doc", "")))
        return rows

    rows = walk(RunConfig, "")
    for group, cls in SHARED_PLUGIN_SCHEMAS.items():
        rows += walk(cls, f"{group}.")
    return sorted(rows, key=lambda r: (r[0].count(".") > 0, r[0]))


def declared_keys(cfg: DictConfig | None = None, registries: dict[str, Any] | None = None) -> dict[str, Bounds]:
    """Every key that declares a range or choices, with them: the run schema's, and for each plugin
    group the selected plugin's ``Config`` (given a composed ``cfg`` and the registries) or else the
    group's shared schema."""
    found = dict(declared(RunConfig, "", _SECTIONS))
    for group, cls in SHARED_PLUGIN_SCHEMAS.items():
        if cfg is not None and registries is not None:
            cls = registries[group].get(cfg[group].name).Config
        if dataclasses.is_dataclass(cls):
            found.update(declared(cls, f"{group}."))
    return found


def key_table() -> str:
    """The README's configuration table, generated from the schema (``python -m subnetdp.core.config``)."""
    valid = {key: bounds.text() for key, bounds in declared_keys().items()}
    lines = ["| key | type | default | valid | meaning |", "|---|---|---|---|---|"]
    for key, kind, default, text in documented_keys():
        shown = f"`{valid[key]}`" if key in valid else ""
        lines.append(f"| `{key}` | {kind} | {f'`{default}`' if default else ''} | {shown} | {text} |")
    return "\n".join(lines)


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


def first_lines(path: Path, lines: int = 3, width: int = 100) -> str:
    """The opening of a file for an error message: a few lines, each cut short, never the whole file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(lines * (width + 1) * 4)
    except OSError as e:
        return f"<unreadable: {e.strerror}>"
    if b"\0" in raw:
        return "<binary data>"
    head = ["".join(c if c.isprintable() else "?" for c in line)
            for line in raw.decode("utf-8", "replace").splitlines()[:lines]]
    return " | ".join(line[:width] + ("..." if len(line) > width else "") for line in head)


def clipped(value: Any, width: int = 80) -> Any:
    """A value for an error message: its first line, at most ``width`` characters (a short
    non-string value is kept as it is, so the message shows its type)."""
    text = str(value)
    if not isinstance(value, str) and len(text) <= width and "\n" not in text:
        return value
    first = text.splitlines()[0] if text.strip() else text
    return first[:width] + ("..." if len(first) > width or first != text else "")


def _load_yaml(path: Path, what: str) -> DictConfig:
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # a YAML syntax error, reported with the file's opening, never all of it
        raise ConfigError(what, str(path), f"cannot be parsed ({clipped(e)}); it begins: {first_lines(path)}",
                          "give a YAML file of config keys, e.g. a file from configs/recipes") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(what, str(path), f"must hold a mapping of config keys; it begins: {first_lines(path)}",
                          "give a YAML file of config keys, e.g. a file from configs/recipes")
    return cfg


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``key=value`` strings into a config; anything else is an error naming the bad item's key."""
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError("override", item, "is not of the form key=value",
                              "write e.g. masker.coverage=0.5")
        key, value = item.split("=", 1)
        if any(not part.strip() for part in key.split(".")):
            raise ConfigError(clipped(key), clipped(value), "has an empty part in its dotted key",
                              "write e.g. seed=1 or masker.coverage=0.5 (no leading, trailing or doubled dots)")
        try:  # one by one, so an error names the key whose value YAML cannot read
            OmegaConf.from_dotlist([item])
        except Exception as e:  # YAML scanner/parser/constructor errors and OmegaConf's own
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(key, value, f"cannot be parsed as a YAML value ({first})",
                              f"quote it, e.g. {key}='\"{value}\"'") from None
    given = {item.split("=", 1)[0]: item.split("=", 1)[1] for item in overrides}
    for key, value in given.items():
        # OmegaConf lets the later one win silently (`masker=5 masker.coverage=0.5` drops the 5) or
        # fails inside its merge (`train=[1,2] train.grad_accum=2`).
        sub = next((k for k in given if k.startswith(f"{key}.")), None)
        if sub is not None:
            raise ConfigError(key, clipped(value), f"is given a value and also the sub-key {sub}",
                              f"drop {key}={clipped(value)} and set its keys one by one, e.g. {sub}={clipped(given[sub])}")
    return OmegaConf.from_dotlist(list(overrides))


def delete_keys(layers: Sequence[tuple[DictConfig, str]], deletions: Sequence[str]) -> None:
    """``~key`` overrides: remove ``key`` from the defaults and the recipe, so the schema's default
    (or, for a whole plugin group like ``~data``, the new ``data.*`` overrides alone) applies."""
    for item in deletions:
        key = item[1:]
        found = False
        for layer, _ in layers:
            parent_key, _, last = key.rpartition(".")
            parent = OmegaConf.select(layer, parent_key) if parent_key else layer
            if isinstance(parent, DictConfig) and last in parent:
                del parent[last]
                found = True
        if not key or not found:
            raise ConfigError(key or "~", "~", "is deleted, but neither defaults.yaml nor the recipe sets it",
                              "write ~KEY for a key the recipe sets, e.g. ~data.image_size or ~data")


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
    """A value for an error message, containers as plain dicts and lists."""
    node = layer._get_node(key)
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=False)
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
        _check_leaf(full, sub, child, source)
        if isinstance(sub, DictConfig) and isinstance(child, DictConfig):
            _check_keys(sub, child, f"{full}.", source)
        elif isinstance(sub, DictConfig) and isinstance(child, ListConfig):
            raise ConfigError(full, "{...}", f"takes a list, not sub-keys (from {source})", f"write {full}=[...]")


def _check_leaf(key: str, node: Any, schema_node: Any, source: str) -> None:
    """What OmegaConf's conversion accepts but changes: a bool key given ``2`` or ``"0x10"`` (it becomes
    ``true``), and an integer beyond 64 bits (an ``OverflowError`` inside the merge for a float key)."""
    if not isinstance(node, ValueNode) or node._is_interpolation() or node._is_none():
        return
    value = node._value()
    if isinstance(schema_node, BooleanNode) and not isinstance(value, bool):
        raise ConfigError(key, clipped(value), f"takes true or false (from {source}), not {type(value).__name__}",
                          f"write {key}=true or {key}=false")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        raise ConfigError(key, clipped(value), f"does not fit in 64 bits (from {source}; at most {INT64_MAX})",
                          "use a smaller number (1e6 or 1000000)")


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
        if value is None and "None" in msg:  # `key=` with nothing after the '='
            raise ConfigError(key, "", f"is empty ({source})",
                              f"give it a value ({key}=...), or leave it out to keep the default") from None
        raise ConfigError(key, value, f"wrong type ({source}): {msg}") from None
    except (TypeError, ValueError) as e:  # OmegaConf lets a few container clashes through as these
        key = prefix.rstrip(".") or ", ".join(map(str, layer.keys()))
        raise ConfigError(key, None, f"cannot be merged ({source}): {e}") from None


def compose(recipe: str | None = None, overrides: Sequence[str] = (),
            registries: dict[str, Any] | None = None) -> DictConfig:
    """Build the resolved run config and check what the contracts say of it (:func:`validate`).

    Rules across keys that belong to a subsystem (FSDP, local steps, checkpoints, rendezvous,
    downstream tasks) are checked beside that subsystem: :func:`subnetdp.train.configure.load_config`
    composes and runs them all, and is what commands and tests call.

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
    deletions = [o for o in overrides if o.startswith("~")]
    layers.append((parse_overrides([o for o in overrides if not o.startswith("~")]), "command line"))
    delete_keys(layers[:-1], deletions)

    top = OmegaConf.structured(RunConfig)
    valid = sorted(list(top.keys()) + list(PLUGIN_GROUPS))
    if recipe and len(layers[1][0]) and not any(k in valid for k in layers[1][0].keys()):
        raise ConfigError("recipe", recipe, f"is not a subnetdp recipe: none of its top-level keys is a config "
                          f"key ({', '.join(valid)}); it begins: {first_lines(path)}",
                          "give a YAML file of config keys, e.g. a file from configs/recipes")
    for layer, source in layers:
        check_sections(layer, top, source)
        for key in layer.keys():
            if key not in top.keys() and key not in PLUGIN_GROUPS:
                raise ConfigError(clipped(key), clipped(_shown(layer, key)),
                                  f"unknown top-level key (from {source}); valid: {', '.join(valid)}"
                                  + suggest(str(key), valid))
    cfg = top
    for layer, source in layers:
        rest = OmegaConf.masked_copy(layer, [k for k in layer.keys() if k not in PLUGIN_GROUPS])
        cfg = _merge(cfg, rest, source)

    for group in PLUGIN_GROUPS:
        name = None
        for layer, source in layers:
            sel = _selector(layer, group, source)
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


def _selector(layer: DictConfig, group: str, source: str) -> Any:
    """``{group}.name`` as ``layer`` gives it (None: not given). It picks the plugin whose schema the rest
    of the config is checked against, so it is chosen before the config it could refer to exists: a
    ``${...}`` there is refused, not resolved against a half-built config."""
    sub = layer._get_node(group) if group in layer else None
    if not isinstance(sub, DictConfig) or "name" not in sub:
        return None
    node = sub._get_node("name")
    if node._is_interpolation():
        raise ConfigError(f"{group}.name", clipped(node._value()), f"is an interpolation (from {source}); a plugin "
                          "is selected by its name, before the config it could refer to is built",
                          f"give the plugin's name, e.g. {group}.name=NAME (subnetdp plugins lists them)")
    return node._value()


def check_sections(layer: DictConfig, top: DictConfig, source: str) -> None:
    """A group of keys (``model``, ``train``, ...) given a scalar, list or null, or a scalar key given a
    group: one message naming the key and what was typed, before anything is merged."""
    for key in layer.keys():
        node = layer._get_node(key)
        typed = "null" if node is None or node._is_none() else (
            "a list" if isinstance(node, ListConfig) else "a group of keys" if isinstance(node, DictConfig)
            else f"the value {clipped(node._value())!r}")
        is_group = key in PLUGIN_GROUPS or (key in top.keys() and isinstance(top._get_node(key), DictConfig))
        if is_group and not isinstance(node, DictConfig):
            raise ConfigError(str(key), clipped(_shown(layer, key)), f"is a group of keys, but {source} gives it "
                              f"{typed}", f"set its keys one by one, e.g. {key}.{'name' if key in PLUGIN_GROUPS else 'KEY'}=VALUE"
                              + (" (a recipe writes them indented under it)" if source.startswith("recipe") else ""))
        if key in top.keys() and not is_group and isinstance(node, (DictConfig, ListConfig)):
            raise ConfigError(str(key), clipped(_shown(layer, key)), f"takes one value, but {source} gives it {typed}",
                              f"write e.g. {key}={OmegaConf.select(top, str(key))}")


def _check_declared(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """Every range and choice that a field declares with it: the run's sections and each selected
    plugin's ``Config`` (whose shared fields come from the group's base schema)."""
    check_declared(cfg, RunConfig, "", _SECTIONS)
    for group in PLUGIN_GROUPS:
        schema = registries[group].get(cfg[group].name).Config
        if dataclasses.is_dataclass(schema):
            check_declared(cfg[group], schema, f"{group}.")


def validate(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """What the contracts say of a composed config: declared ranges and choices, finite numbers, a
    run name that is one folder, what the model adapter implements, each selected plugin's own
    ``validate_config``, and data the model can train on.

    Each subsystem's rules across keys (FSDP, local steps, checkpoints and resume, rendezvous,
    downstream tasks, the optimizer's) live beside that subsystem; ``subnetdp.train.configure``
    runs them after this.
    """
    _check_declared(cfg, registries)
    check_numbers(cfg)
    _check_run_name(cfg)
    adapter = registries["model"].get(cfg.model.name)
    _check_regularizers(cfg, adapter)
    if cfg.masker.granularity not in adapter.granularities:
        raise ConfigError("masker.granularity", cfg.masker.granularity,
                          f"model '{cfg.model.name}' supports: {', '.join(adapter.granularities)}")
    for group in PLUGIN_GROUPS:
        registries[group].get(cfg[group].name).validate_config(cfg[group], cfg)
    check_data_fits_model(cfg, registries)
    # After the checks of the choices themselves: a wrong data.name is the error, not the keys it ignores.
    check_ignored(cfg, registries)
    check_image_size(cfg)
    warn_threads(cfg)


def check_ignored(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """A shared key that the selected plugin does not read (its ``ignores``) keeps its default: a value
    set there would otherwise be accepted and do nothing (``data.root`` for ``digits``)."""
    for group in PLUGIN_GROUPS:
        name, registry = str(cfg[group].name), registries[group]
        cls = registry.get(name)
        if not cls.ignores:
            continue
        defaults = OmegaConf.structured(cls.Config)
        for key, why in cls.ignores.items():
            if key not in cfg[group]:
                continue
            value, default = _shown(cfg[group], key), _shown(defaults, key)
            if value == default:
                continue
            users = [n for n in registry.names() if key not in registry.get(n).ignores]
            raise ConfigError(f"{group}.{key}", value, f"{group}.name={name} does not use it ({why})",
                              f"leave it at its default {default!r} (~{group}.{key} drops a recipe's value)"
                              + (f"; it is read by {group}.name={', '.join(users)}" if users else ""))


def _check_regularizers(cfg: DictConfig, adapter: Any) -> None:
    """``model.stochastic_depth`` / ``model.hidden_dropout`` (ranges declared in ``ModelConfig``): set
    only where the model adapter implements them."""
    for key in ("stochastic_depth", "hidden_dropout"):
        value = OmegaConf.select(cfg, f"model.{key}", default=0.0) or 0.0
        if value and key not in adapter.regularizers:
            raise ConfigError(f"model.{key}", value, f"model '{cfg.model.name}' does not implement it",
                              f"set model.{key}=0")


NAME_MAX = 255  # bytes in one file name on Linux, macOS and Windows file systems


def _check_run_name(cfg: DictConfig) -> None:
    """``run.name`` is one folder inside ``run.dir``: no separators, no ``..``, not absolute, not too
    long, and no control characters (a newline would split every log line and shell command naming it)."""
    name = str(cfg.run.name)
    if not name:
        return
    fix = "use a plain folder name such as run.name=exp1 (put the parent folder in run.dir)"
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        raise ConfigError("run.name", name, f"would put the run outside run.dir={cfg.run.dir}", fix)
    control = next((c for c in name if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        raise ConfigError("run.name", name[:80] + ("..." if len(name) > 80 else ""),
                          f"holds the control character U+{ord(control):04X}; a run name is one line of "
                          "printable characters", fix)
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise ConfigError("run.name", name[:40] + "...", f"is {len(name.encode('utf-8', 'surrogateescape'))} "
                          f"bytes long; a file name may have at most {NAME_MAX}", "use a shorter name")


def check_world(cfg: DictConfig, world_size: int) -> int:
    """The number of replicas R = W / S, or a ConfigError when ``fsdp.shard_size`` does not divide W."""
    size = int(cfg.fsdp.shard_size)
    if world_size % size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError("fsdp.shard_size", size, f"must divide the world size {world_size} "
                          f"(world = replicas x shard_size)", f"use one of {divisors}, or change the number of ranks")
    return world_size // size


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
    variant = cfg.model.variant or cfg.model.name
    return f"{variant}-{cfg.masker.granularity}-c{cfg.masker.coverage:g}-w{world_size}"


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


# --------------------------------------------------------------------------- values no schema type catches

INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38


def leaves(node: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a plain container (lists as ``key[i]``)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from leaves(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from leaves(v, f"{prefix.rstrip('.')}[{i}].")
    else:
        yield prefix.rstrip("."), node


def check_numbers(cfg: DictConfig) -> None:
    """No NaN or infinity anywhere, and no integer beyond 64 bits (torch, numpy and C take int64)."""
    for key, value in leaves(OmegaConf.to_container(cfg, resolve=True)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, value, "must be a finite number", "give a plain number such as 0.5")
        if isinstance(value, float) and abs(value) > FLOAT32_MAX:
            # Python keeps 1e308, but the training tensors are float32: optim.lr=1e308 is inf at step 1.
            raise ConfigError(key, value, f"is beyond float32's range (at most {FLOAT32_MAX:.3g}), which the "
                              "training tensors use", "give a number of ordinary size such as 0.1")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
            raise ConfigError(key, value, f"does not fit in 64 bits (at most {INT64_MAX})", "use a smaller integer")


def check_data_fits_model(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """The data module yields the kind of data the model trains on (``data_kind``: image, tokens)."""
    model, data = registries["model"].get(cfg.model.name), registries["data"].get(cfg.data.name)
    consumes, produces = model.data_kind, data.data_kind
    if consumes != produces:
        fitting = [n for n in registries["data"].names() if registries["data"].get(n).data_kind == consumes]
        raise ConfigError("data.name", str(cfg.data.name), f"yields {produces} data, but model.name={cfg.model.name} "
                          f"trains on {consumes} data", f"use {consumes} data" + (f": {', '.join(fitting)}" if fitting else ""))


MAX_IMAGE_SIDE = 4096  # the FLOP count runs a real sample: far above 4096 it cannot allocate (or takes hours)


def check_image_size(cfg: DictConfig) -> None:
    """``data.image_size`` small enough that one sample (the FLOP measurement's) can be allocated."""
    size = OmegaConf.select(cfg, "data.image_size", default=0) or 0
    if isinstance(size, int) and size > MAX_IMAGE_SIDE:
        gib = 3 * 4 * size * size / 2**30
        raise ConfigError("data.image_size", size, f"one image is {gib:,.0f} GiB at this size (at most "
                          f"{MAX_IMAGE_SIDE} is accepted)", "use the model's native size, e.g. 32 or 224")


def warn_threads(cfg: DictConfig) -> None:
    """More threads per rank than cores for all local ranks: warn (it runs, slowly).

    The local ranks are ``launch.nproc``, or under a launcher the node's own (``LOCAL_WORLD_SIZE``, set by
    torchrun per node): on a node of a multi-node job the recipe's ``launch.nproc`` says nothing.
    """
    import warnings

    threads, cores = int(cfg.launch.threads_per_rank), os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks, what = (int(local), "local ranks") if local.isdigit() else (int(cfg.launch.nproc), "launch.nproc")
    if threads * max(1, ranks) > cores:
        warnings.warn(f"launch.threads_per_rank={threads} x {what}={ranks} is more threads than "
                      f"the {cores} cores: ranks will slow each other down; 0 shares the cores evenly", stacklevel=2)


_SECTIONS = {c.__name__: c for c in (SyncConfig, OptimConfig, TrainConfig, EvalConfig, LaunchConfig, RunDirConfig,
                                     CheckpointConfig, FSDPConfig)}

if __name__ == "__main__":
    print(key_table())
