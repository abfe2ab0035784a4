"""The contracts between the core and its plugins: data types and base classes.

A plugin class subclasses one of :class:`Masker`, :class:`Communicator`, :class:`ModelAdapter` or
:class:`DataModule` and carries a nested ``Config`` dataclass, its config schema, which is mounted
under the plugin's group key (``masker``, ``comm``, ``model``, ``data``) when it is selected.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Iterable, Iterator, Mapping, Optional, Protocol, Sequence

from subnetdp.core.fields import WRITES, doc, writing_keys  # noqa: F401  (re-exported: plugins declare fields with doc)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from omegaconf import DictConfig

    from subnetdp.core.plan import MaskPlan


# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class TensorSlice:
    """A piece of one global tensor: the whole tensor (``dim`` None) or ``[start, stop)`` along ``dim``."""

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class Unit:
    """The smallest thing a mask keeps or drops.

    Attributes:
        id: position in the partition (units are numbered 0..K-1 in forward order).
        name: human-readable name, e.g. ``layer2.1``.
        group: the group the masker draws from in equal measure (``layer2`` for a ResNet stage).
        cost: forward FLOPs per sample of the unit (measured with ``FlopCounterMode``).
        slices: the parameter pieces the unit consists of.
        buffers: the buffer pieces (BatchNorm statistics) that belong to the unit.
    """

    id: int
    name: str
    group: str
    cost: float
    slices: tuple[TensorSlice, ...]
    buffers: tuple[TensorSlice, ...] = ()


@dataclass
class Partition:
    """How a full model divides into units and shared tensors.

    Attributes:
        granularity: ``block`` or ``neuron``.
        units: the units in forward order; ``units[i].id == i``.
        shared: global names of the parameters outside every unit (averaged over all ranks).
        shared_buffers: global names of buffers outside every unit.
        shapes: global name -> shape, for every parameter and buffer of the full model.
        dtypes: global name -> dtype, likewise.
    """

    granularity: str
    units: list[Unit]
    shared: list[str]
    shared_buffers: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, "torch.dtype"] = field(default_factory=dict)

    @staticmethod
    def tensor_info(model: "nn.Module") -> tuple[dict[str, tuple[int, ...]], dict[str, "torch.dtype"]]:
        """Shapes and dtypes of every parameter and buffer of ``model``, in module order."""
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, "torch.dtype"] = {}
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            shapes[name] = tuple(t.shape)
            dtypes[name] = t.dtype
        return shapes, dtypes

    def unit_numel(self, unit: Unit) -> int:
        """Number of parameter elements in ``unit``."""
        total = 0
        for s in unit.slices:
            shape = self.shapes[s.name]
            n = 1
            for d in shape:
                n *= d
            if s.dim is not None:
                n = n // shape[s.dim] * (s.stop - s.start)
            total += n
        return total

    def shared_numel(self) -> int:
        total = 0
        for name in self.shared:
            n = 1
            for d in self.shapes[name]:
                n *= d
            total += n
        return total

    def groups(self) -> dict[str, list[Unit]]:
        """Units by group, groups in order of first appearance."""
        out: dict[str, list[Unit]] = {}
        for u in self.units:
            out.setdefault(u.group, []).append(u)
        return out


@dataclass(frozen=True)
class Piece:
    """Where part of a local tensor lives in the full model.

    ``local[local_start:local_stop]`` along ``dim`` equals ``global_name[global_start:global_stop]``;
    ``dim`` None means the whole tensor maps to the whole global tensor.
    """

    global_name: str
    dim: int | None = None
    global_start: int = 0
    global_stop: int = 0
    local_start: int = 0
    local_stop: int = 0


@dataclass
class ParamMap:
    """For each tensor of a materialised subnetwork, the pieces of the full model it holds.

    Attributes:
        pieces: local name -> pieces (owned units sit in ascending id order in the local layout).
        unit_of: local name -> id of the unit the tensor belongs to, or None for a shared tensor
            or one that holds pieces of several units (its pieces then say where each lies).
    """

    pieces: dict[str, list[Piece]]
    unit_of: dict[str, int | None]

    @classmethod
    def identity(cls, names: Iterable[str], unit_of: dict[str, int | None]) -> "ParamMap":
        """A map in which every local tensor is the global tensor of the same name."""
        names = list(names)
        return cls({n: [Piece(n)] for n in names}, {n: unit_of.get(n) for n in names})

    def global_names(self) -> list[str]:
        return [p.global_name for ps in self.pieces.values() for p in ps]


@dataclass(frozen=True)
class DataSpec:
    """What the model needs to know about the data before it is built."""

    in_channels: int = 0
    image_size: int = 0
    num_classes: int = 0
    vocab_size: int = 0
    seq_len: int = 0


@dataclass(frozen=True)
class HiddenSite:
    """Where a block's hidden channels can be reached (what :meth:`ModelAdapter.hidden_sites` returns).

    Attributes:
        module: the module whose input (``where="input"``) or output (``where="output"``) they are.
        dim: their dimension in that activation.
        where: ``input`` or ``output``.
    """

    module: "nn.Module"
    dim: int
    where: str = "input"


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits: filled by :mod:`subnetdp.launchers` from the environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"


# --------------------------------------------------------------------------- plugin bases


GROUP_BY = ("auto", "model")  # masker.group_by: the adapter's groups, or one group over all units


@dataclass
class PluginConfig:
    """Every plugin's ``Config`` subclasses this; ``name`` selects the plugin."""

    name: str = doc('the plugin selected by name', "???")


class Plugin:
    """Common base: a config schema, an optional config file and optional extra validation.

    Attributes:
        Config: the dataclass mounted under the plugin's group key when it is selected.
        ignores: shared keys the plugin does not read, with the reason (refused when set).
        config_file: a YAML file of defaults loaded beneath the user's values (built-in plugins use
            ``configs/<group>/<name>.yaml`` instead).
        name: the name the instance was selected by (set by ``Registry.create``).
    """

    Config: ClassVar[type] = PluginConfig
    config_file: ClassVar[str | None] = None
    #: Keys of the kind's shared schema (``DataConfig``, ...) that this plugin does not read, each with
    #: the reason, e.g. ``{"root": "its images ship with scikit-learn"}``: a value other than the
    #: default is refused, naming the key, the reason and the plugins that do read it.
    ignores: ClassVar[Mapping[str, str]] = {}

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.name = ""

    @classmethod
    def validate_config(cls, cfg: Any, root: Any) -> None:
        """Raise :class:`~subnetdp.core.errors.ConfigError` for a bad value of this plugin's section
        ``cfg`` (the whole run config is ``root``). Runs before any process group exists."""

    @classmethod
    def conformance_overrides(cls, tmp_path: Any) -> list[str]:
        """``key=value`` overrides the conformance test adds to run this plugin in seconds.

        A plugin that needs files (a dataset on disk) writes a tiny copy in their real format under
        ``tmp_path`` and points its config there; most plugins need nothing.
        """
        return []


@dataclass
class MaskerConfig(PluginConfig):
    """Keys every masker shares (``masker.*``); a masker's own ``Config`` may add more."""

    granularity: str = doc('unit kind: block or neuron', "block", choices=("block", "neuron"))
    regime: str = doc('forward (materialised subnetworks) or backward (masked gradients, full forward)', "forward",
                      choices=("forward", "backward"))
    coverage: float = doc(
        'C in (0, 1]: each rank keeps max(1, floor(C K_g + 0.5)) of the K_g units of every group',
        0.5, lo=0.0, lo_open=True, hi=1.0, fix="use a coverage such as 0.5 (1 = plain DDP)")
    min_owners: int = doc('a plan with a unit owned by fewer ranks is refused', 1, lo=1)
    group_by: str = doc("auto (the adapter's groups, e.g. a ResNet stage) or model (one group over all units)", "auto",
                        choices=GROUP_BY)
    rescale: Optional[bool] = doc(
        'K/n output scaling of narrowed layers (empty: on for neuron level, off for block level)',
        None)
    units_per_layer: int = doc("neuron level: ranges each layer's hidden dimension is cut into", 8, lo=1,
                               fix="the default is 8")
    refresh_every: int = doc("backward masking: owners' values reach every rank every N steps", 1, lo=1,
                             fix="1 refreshes non-owned copies after every step")
    resample_every: int = doc('re-draw the plan every N steps from a fixed family (0 = never)', 0, lo=0,
                              fix="0 keeps the plan fixed")
    capacity: list = doc('heterogeneous ranks: one coverage per rank (per replica with fsdp.shard_size > 1) overriding masker.coverage; empty: every rank keeps masker.coverage (subnetdp plan --memory fills it)',
                         factory=list, lo=0, lo_open=True, hi=1,
                         fix="give each rank a coverage such as 0.5 (1 = the whole model)")
    nodes: Optional[int] = doc(
        "nodes the ranks span, rank r on node r // (W / nodes) as torchrun numbers them: a unit's owners are "
        "placed on different nodes where the coverage allows (empty: from the launcher, WORLD_SIZE / "
        "LOCAL_WORLD_SIZE under torchrun, else 1)", None, lo=1, fix="give a divisor of the world size, or leave it empty")


@dataclass
class CommConfig(PluginConfig):
    """Keys every communicator shares (``comm.*``)."""

    init_method: str = doc('torch.distributed init method (env:// under torchrun)', "env://")
    # Below a second a world cannot even assemble; beyond a week a hung collective is never reported
    # (and near 1e308 the timedelta torch.distributed takes overflows).
    timeout_s: float = doc('seconds the world has to assemble, and for each collective (1 s to 7 days)', 600.0,
                           lo=1.0, hi=604800.0, fix="600 is the default")


@dataclass
class DataConfig(PluginConfig):
    """Keys every data module shares (``data.*``)."""

    root: str = doc("where the dataset's files are", "")
    image_size: int = doc("resize target (0 = the dataset's own size)", 0)


@dataclass
class ModelConfig(PluginConfig):
    """Keys every model adapter shares (``model.*``).

    ``stochastic_depth`` and ``hidden_dropout`` are drop probabilities (keep rate ``1 - p``) of the
    residual branches and hidden channels that SDP masks; 0 = off. Adapters list the ones they
    support in ``ModelAdapter.regularizers`` and say where they act (``residual_branches``,
    ``hidden_sites``); the framework attaches them after ``build`` (:mod:`subnetdp.sdp.branches`).
    """

    variant: str = doc('the size: resnet18/34/50, swin t/s/b/cifar, llama tiny/134m/500m/1b', "")
    stochastic_depth: float = doc('drop probability of each residual branch per sample (the branches block-level SDP masks; 0 = off)', 0.0,
                                  lo=0, hi=1, hi_open=True,
                                  fix="use e.g. model.stochastic_depth=0.5 for a keep rate of 0.5 (0 turns it off)")
    hidden_dropout: float = doc('drop probability of each hidden channel per sample (the channels neuron-level SDP masks; 0 = off)', 0.0,
                                lo=0, hi=1, hi_open=True,
                                fix="use e.g. model.hidden_dropout=0.5 for a keep rate of 0.5 (0 turns it off)")


class Masker(Plugin, abc.ABC):
    """Chooses which units every rank owns. Must be a pure function of its arguments."""

    Config: ClassVar[type] = MaskerConfig

    @abc.abstractmethod
    def plan(self, partition: Partition, world_size: int, seed: int) -> "MaskPlan":
        """Return the plan: for every rank the sorted ids of the units it owns."""


class Handle(abc.ABC):
    """An in-flight collective."""

    @abc.abstractmethod
    def wait(self) -> None: ...


class DoneHandle(Handle):
    """A collective that completed synchronously."""

    def wait(self) -> None:
        return None


@dataclass
class ByteCounter:
    """Payload bytes handed to collectives, per group (sorted rank tuple) and phase.

    ``by_group`` holds the training step's traffic (phase ``"step"``: the gradient averaging); a
    collective issued inside ``with counter.phase(name):`` (the inf/NaN guard, the refresh, the
    evaluation, the loss shown in the log) is kept apart in ``by_phase[name]``, so no caller has to
    save and restore the step's figures around its own traffic.
    """

    by_group: dict[tuple[int, ...], int] = field(default_factory=dict)
    by_phase: dict[str, dict[tuple[int, ...], int]] = field(default_factory=dict)
    calls: int = 0
    #: Collectives issued per phase (``"step"`` included) and group: a round trip each, whatever its size.
    calls_by_phase: dict[str, dict[tuple[int, ...], int]] = field(default_factory=dict)
    current: str = "step"

    def add(self, group: tuple[int, ...], nbytes: int) -> None:
        into = self.by_group if self.current == "step" else self.by_phase.setdefault(self.current, {})
        into[group] = into.get(group, 0) + nbytes
        self.calls += 1
        counts = self.calls_by_phase.setdefault(self.current, {})
        counts[group] = counts.get(group, 0) + 1

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the collectives issued inside the block under ``name`` instead of the step's."""
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def total(self, phase: str = "step") -> int:
        return sum((self.by_group if phase == "step" else self.by_phase.get(phase, {})).values())

    def ring_estimate(self) -> float:
        """Bytes a ring all-reduce puts on the wire per rank: ``2 (k-1)/k`` times the payload (step phase)."""
        return sum(2 * (len(g) - 1) / len(g) * b for g, b in self.by_group.items() if len(g) > 1)

    def reset(self) -> None:
        self.by_group.clear()
        self.by_phase.clear()
        self.calls_by_phase.clear()
        self.calls = 0


class Communicator(Plugin, abc.ABC):
    """Collectives over the world and over owner groups.

    ``init`` is the only place a process group is created; everything before it (config, plan
    validation) runs without one. Groups are identified by the sorted tuple of their ranks.
    """

    Config: ClassVar[type] = CommConfig
    #: Its groups are ``torch.distributed`` process groups, which FSDP2 shards over (``fsdp.shard_size > 1``).
    supports_fsdp: ClassVar[bool] = False

    def __init__(self, cfg: Any, env: LaunchEnv) -> None:
        super().__init__(cfg)
        self.env = env
        self.bytes = ByteCounter()

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world(self) -> tuple[int, ...]:
        return tuple(range(self.world_size))

    @property
    @abc.abstractmethod
    def device(self) -> "torch.device":
        """The device this rank computes on."""

    @abc.abstractmethod
    def init(self) -> None:
        """Create the world process group. Collective: every rank calls it."""

    def check_environment(self) -> None:
        """Raise :class:`ConfigError` if this backend cannot run here (called before ``init``)."""

    @classmethod
    def check_world_size(cls, world_size: int) -> None:
        """Raise :class:`ConfigError` if this backend cannot run ``world_size`` ranks.

        Called before any worker is started (``subnetdp train`` with ``launch.nproc``, ``subnetdp launch``).
        """

    @classmethod
    def check_machine(cls, name: str) -> None:
        """Raise :class:`ConfigError` if the launching machine lacks what this backend needs (CUDA for
        nccl); called in the launching process before workers start, skipped where they run elsewhere (srun)."""

    @classmethod
    def device_type(cls, cfg: Any) -> str:
        """``cpu`` or ``cuda``: what a rank computes on with the ``comm`` section ``cfg``, known before any
        process exists (``device`` tells the same of an instance). ``train.device`` must agree with it."""
        return "cpu"

    @classmethod
    def check_launcher(cls, launcher: str, nproc: int) -> None:
        """Raise :class:`ConfigError` if ``launcher`` cannot start this backend's ranks; called before it
        starts any. ``launcher``: ``local`` (``subnetdp train launch.nproc=N``), ``torchrun``, ``mpirun``
        or ``srun`` (``subnetdp launch``)."""

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> None:
        """Create the group of ``ranks``. Collective: every rank calls it, in the same order."""

    @abc.abstractmethod
    def all_reduce(self, tensor: "torch.Tensor", group: Sequence[int], async_op: bool = False) -> Handle:
        """Sum ``tensor`` in place over ``group`` (sorted ranks; the caller must be a member)."""

    @abc.abstractmethod
    def broadcast(self, tensor: "torch.Tensor", src: int, group: Sequence[int] | None = None) -> None:
        """Copy ``tensor`` from ``src`` to every member of ``group`` (default: the world)."""

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order. Collective over the world."""

    @abc.abstractmethod
    def barrier(self) -> None: ...

    def shutdown(self) -> None:
        """Destroy the process groups."""


class NullCommunicator(Communicator):
    """Collectives that move nothing and return at once, on the CPU, with no process group.

    The communicator ``local`` is one (world size 1: every collective is the identity, so a
    single-process run takes the distributed path). The plan's dry runs use one as rank ``r`` of W
    in a single process, with ``counts_bytes`` on: each collective then records the payload a real
    backend would have been handed, and the estimate of bytes per step comes from the same calls.
    """

    #: Record each collective's payload in ``bytes`` (off for ``local``, whose runs send nothing).
    counts_bytes: ClassVar[bool] = False

    @property
    def device(self) -> "torch.device":
        import torch  # core does not import torch at load

        return torch.device("cpu")

    def init(self) -> None:
        return None

    def new_group(self, ranks: Sequence[int]) -> None:
        return None

    def all_reduce(self, tensor: "torch.Tensor", group: Sequence[int], async_op: bool = False) -> Handle:
        if self.counts_bytes:
            self.bytes.add(tuple(group), tensor.numel() * tensor.element_size())
        return DoneHandle()

    def broadcast(self, tensor: "torch.Tensor", src: int, group: Sequence[int] | None = None) -> None:
        if self.counts_bytes:
            self.bytes.add(self.world if group is None else tuple(group), tensor.numel() * tensor.element_size())

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.world_size

    def barrier(self) -> None:
        return None


class ModelAdapter(Plugin, abc.ABC):
    """Knows one model family: how to build it, cut it into units and materialise subnetworks."""

    Config: ClassVar[type] = ModelConfig
    granularities: ClassVar[tuple[str, ...]] = ("block",)
    #: The kind of data it trains on; a data module of the same kind pairs with it (``image``, ``tokens``).
    data_kind: ClassVar[str] = "image"
    # Which of model.stochastic_depth / model.hidden_dropout the adapter supports: the framework
    # attaches them after build(), where residual_branches / hidden_sites say.
    regularizers: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def build(self, spec: DataSpec) -> "nn.Module":
        """Build the full model, the plain reference architecture. A run builds it under
        ``torch.device("meta")`` (structure only, no storage) and initialises what a rank holds with
        :meth:`init_module`; on CPU it also gives a plain, initialised model (the caller seeds the RNG
        first). Regularisers are attached by the framework afterwards, not here."""

    def init_module(self, name: str, module: "nn.Module") -> None:
        """Initialise ``module``'s own parameters and buffers (not its children's) in place.

        Called once for every module holding a tensor a rank keeps, on a stand-alone copy at full
        size on CPU whose own tensors are uninitialised (children stay on ``meta``), with torch's
        global RNG seeded from the run's seed and ``name`` (the module's global name): a tensor's
        initial value then depends on the seed and its name alone, whatever the world size,
        coverage or masker. A tensor left uninitialised is an error that names it. The default
        calls ``module.reset_parameters()`` where the module has one (PyTorch's own initialisation
        of Linear, Conv, norms, embeddings); adapters override it to follow their architecture.
        """
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()

    @abc.abstractmethod
    def partition(self, model: "nn.Module", granularity: str, spec: DataSpec) -> Partition:
        """Cut the full model into units and shared tensors.

        Adapters that list ``neuron`` in ``granularities`` also accept ``units_per_layer: int``
        (``masker.units_per_layer``), passed by keyword for neuron level only.
        """

    @abc.abstractmethod
    def materialize(self, model: "nn.Module", owned: Sequence[int], partition: Partition) -> tuple["nn.Module", ParamMap]:
        """Turn the full model into the subnetwork holding only ``owned`` units.

        Takes ownership of ``model``: the returned module may reuse (and the caller must not use)
        its submodules. Tensors of dropped units are freed when the caller drops ``model``.
        Neuron level: owned pieces sit in ascending unit order in each narrowed tensor, and the
        keyword ``rescale: bool`` (passed for neuron level only) asks the adapter to scale each
        narrowed hidden activation by ``K_g / n_g`` in training.
        """

    def blocks(self, submodel: "nn.Module") -> list["nn.Module"]:
        """The materialised blocks, in forward order (for activation checkpointing and FSDP)."""
        return []

    def residual_branches(self, model: "nn.Module") -> dict[str, list["nn.Module"]]:
        """Block name (the block-level unit's name) -> the modules whose outputs are its residual
        branches, for the blocks ``model`` holds. Used by ``model.stochastic_depth`` (a drop-path hook
        on each); empty if the adapter has none."""
        return {}

    def branch_output_layers(self, model: "nn.Module") -> dict[str, list["nn.Module"]]:
        """Block name -> the last affine layer (``weight``, optional ``bias``) of each of its residual
        branches: scaling them scales the branch exactly. Used by ``eval.block_union=rescaled`` (and
        ``subnetdp eval``/``export`` of such a run); empty (the default) leaves every branch at x1."""
        return {}

    def hidden_sites(self, model: "nn.Module") -> list[HiddenSite]:
        """Where the hidden channels of every neuron-level group can be reached, for
        ``model.hidden_dropout``."""
        return []

    @abc.abstractmethod
    def loss(self, output: Any, batch: Any) -> "torch.Tensor": ...

    def training_loss(self, model: "nn.Module", batch: Any) -> "torch.Tensor":
        """The loss of one training micro-batch (what the loop, the dry run and benchmarks call).

        Default: ``loss(model(inputs(batch)), batch)``. An adapter may fuse the two, e.g. a language
        model computing its head and cross entropy in chunks inside the forward.
        """
        return self.loss(model(self.inputs(batch)), batch)

    @abc.abstractmethod
    def metrics(self, outputs: Sequence[Any], batches: Sequence[Any]) -> dict[str, float]:
        """Eval metrics over several batches (e.g. ``accuracy`` and ``loss``)."""

    def inputs(self, batch: Any) -> Any:
        """The part of a batch the model's forward takes."""
        return batch[0]

    # Export (``subnetdp export``): optional. An adapter that can rebuild its reference architecture
    # (the plain torchvision / torch model) returns its options; None means it cannot be exported.
    def reference_options(self, spec: DataSpec) -> Optional[dict[str, Any]]:
        """JSON-ready options that :meth:`reference_model` rebuilds the plain model from (stored in checkpoints)."""
        return None

    @staticmethod
    def reference_model(options: dict[str, Any]) -> "nn.Module":
        """The plain reference model for ``options`` (from :meth:`reference_options`)."""
        raise NotImplementedError("this model plugin does not rebuild a reference architecture")

    def reference_state_dict(self, model: "nn.Module") -> dict[str, "torch.Tensor"]:
        """The union model's state_dict under the reference architecture's names (default: unchanged)."""
        return model.state_dict()

    def hf_export(self, model: "nn.Module", options: dict[str, Any], bos: Optional[int] = None,
                  eos: Optional[int] = None) -> tuple[dict[str, Any], dict[str, "torch.Tensor"]]:
        """The union model as a Hugging Face model: its ``config.json`` and its tensors under HF names
        (``subnetdp export --format hf``). Optional: the default says the plugin has none."""
        raise NotImplementedError(f"{type(self).__name__} has no Hugging Face export")

    @classmethod
    def has_hf_export(cls) -> bool:
        return cls.hf_export is not ModelAdapter.hf_export


class DataModule(Plugin, abc.ABC):
    """A dataset: its spec and deterministic, resumable, rank-sharded loaders."""

    Config: ClassVar[type] = DataConfig
    #: The kind of data it yields (``image``, ``tokens``); a model of the same kind pairs with it.
    data_kind: ClassVar[str] = "image"

    def __init__(self, cfg: Any, seed: int = 0) -> None:
        super().__init__(cfg)
        self.seed = seed

    def check(self) -> None:
        """Raise :class:`ConfigError` if the data is missing (called before any process group)."""

    def tokenizer(self) -> Any:
        """The tokenizer that made the data's tokens (``encode``, ``decode``, ``eot``, ``vocab_size``), or
        None when there is none or it is unknown. Optional: language-model data that knows it returns it
        (downstream evaluation and HF export need it)."""
        return None

    @classmethod
    def has_tokenizer(cls) -> bool:
        return cls.tokenizer is not DataModule.tokenizer

    @classmethod
    def unsafe_to_open(cls, cfg: Any) -> str | None:
        """Why reading the files ``cfg`` names could run code, or None when it cannot.

        ``subnetdp eval`` and ``subnetdp export`` do not trust a checkpoint's ``config.yaml`` to pick
        data that could execute code when read (unverified pickles, ``torch.load`` without
        ``weights_only``): they refuse such a config unless the user names the data on the command
        line. Override this when the module deserialises its files with anything that can run code.
        """
        return None

    @abc.abstractmethod
    def spec(self) -> DataSpec: ...

    def planning_spec(self) -> tuple[DataSpec, str]:
        """The spec for ``subnetdp plan``, with or without the data on disk, and where it came from.

        Returns ``(spec, source)``; ``source`` starts with ``dataset`` when files were read and
        ``config`` otherwise. Default: :meth:`spec` (right for modules whose spec reads no files).
        """
        return self.spec(), "config (the data module's spec reads no files)"

    def example_batch(self, spec: DataSpec, batch_size: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """A batch of the loaders' shapes and dtypes made from the spec alone (for dry runs).

        Default: token windows ``(tokens, targets)`` of ``(batch_size, seq_len)`` for a spec with
        a vocabulary, else images ``(batch_size, C, S, S)`` with integer labels.
        """
        import torch

        if spec.vocab_size or spec.seq_len:
            tokens = torch.zeros(batch_size, spec.seq_len, dtype=torch.int64)
            return tokens, tokens.clone()
        images = torch.zeros(batch_size, spec.in_channels, spec.image_size, spec.image_size)
        return images, torch.zeros(batch_size, dtype=torch.int64)

    @abc.abstractmethod
    def train_loader(self, rank: int, world_size: int, batch_size: int) -> "ResumableLoader": ...

    @abc.abstractmethod
    def eval_loader(self, batch_size: int) -> Iterable[Any]:
        """The held-out split, whole, in a fixed order (every rank evaluates the same batches)."""


class ResumableLoader(abc.ABC):
    """An endless iterator over training batches with a position that can be saved and restored.

    Attributes:
        batches_per_epoch: full batches in one pass over this rank's shard, or None for a stream
            of unknown length (then a resume on another world size restarts the epoch's count and
            ``eval.bn_recalibrate_batches`` is not checked against the data).
    """

    batches_per_epoch: Optional[int] = None

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Any]: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, int]: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, int]) -> None: ...


def config_fields(cfg_cls: type) -> list[str]:
    """The field names of a plugin ``Config`` dataclass."""
    return [f.name for f in dataclasses.fields(cfg_cls)]


# --------------------------------------------------------------------------- what lifecycle hooks receive


@dataclass(frozen=True)
class RunContext:
    """What a run is, fixed at set-up: read by everything after it, changed by nothing.

    Built by ``subnetdp.train.setup.setup`` once the process group exists and the run directory is
    locked; lifecycle hooks receive it as ``context``. Its fields cannot be reassigned and its config is
    read-only (OmegaConf's read-only flag); anything decided lazily (rank 0's timestamped run name) is
    resolved before it is made.

    Attributes:
        cfg: the run's config (read-only).
        env: where this process sits (rank, world size, launcher).
        comm: the communicator (process groups exist).
        plugins: the plugin manager (``plugins.hook`` calls the hooks).
        adapter, data: the model adapter and data module selected by name.
        spec: the data's :class:`DataSpec`.
        run_dir: ``run.dir/run.name``.
        lock: rank 0's hold on ``run_dir`` (one job per run directory), None on other ranks.
        tasks: ``eval.tasks``: the lm-eval tasks, loaded with their data at set-up; else None.
        flop_match: ``train.flop_matched``: the steps asked for, the steps trained (``cfg.train.steps``)
            and the plan's training-FLOP ratio; else None.
        step_flops: training FLOPs of one step summed over all ranks (every micro-batch's forward
            and backward, counted on ``meta``): the x-axis on which runs of any coverage compare.
    """

    cfg: "DictConfig"
    env: LaunchEnv
    comm: Communicator
    plugins: Any
    adapter: ModelAdapter
    data: DataModule
    spec: DataSpec
    run_dir: Path
    lock: Any = None
    tasks: Any = None
    flop_match: Optional[dict] = None
    step_flops: Optional[float] = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size


class TrainStateView(abc.ABC):
    """What lifecycle hooks see of a rank's training state (``subnetdp.train.state.TrainState``): read-only.

    Properties only, so a hook cannot replace a field. ``model`` and ``optimizer`` are the live
    objects the loop trains: reading them is what a hook is for; changing their tensors changes the
    run (and, unless every owner does the same, breaks the invariant that owners hold identical
    values). The plan and model change when the plan is re-drawn (``masker.resample_every``).
    """

    @property
    @abc.abstractmethod
    def step(self) -> int:
        """Steps done so far (0 before the first)."""

    @property
    @abc.abstractmethod
    def partition(self) -> Partition:
        """The full model's partition into units and shared tensors."""

    @property
    @abc.abstractmethod
    def plan(self) -> "MaskPlan":
        """The mask plan the rank trains under now."""

    @property
    @abc.abstractmethod
    def model(self) -> "nn.Module":
        """This rank's model (its subnetwork, or the masked full model), the live module."""

    @property
    @abc.abstractmethod
    def pmap(self) -> ParamMap:
        """Where each of the model's tensors lies in the full model."""

    @property
    @abc.abstractmethod
    def optimizer(self) -> "torch.optim.Optimizer":
        """The rank's optimizer (over the model's trainable parameters)."""

    @property
    @abc.abstractmethod
    def scheduler(self) -> Any:
        """The learning-rate schedule (a ``torch.optim.lr_scheduler.LRScheduler``)."""


@dataclass(frozen=True)
class RunResult:
    """What a finished run produced, returned by the loop; ``subnetdp_on_run_end`` receives it.

    Attributes:
        summary: the run's summary, as written to ``RUN_DIR/summary.json``.
        eval_metrics: the last evaluation's metrics (the union model's; lm-eval scores on rank 0).
        eval_union: how the union model was evaluated (``summary.json``'s ``eval_union``).
        alignment: the gradient-alignment records (``train.grad_alignment_every``), one per probed step.
        step: the last step trained.
    """

    summary: dict[str, Any]
    eval_metrics: dict[str, float] = field(default_factory=dict)
    eval_union: dict[str, Any] = field(default_factory=dict)
    alignment: list[dict[str, float]] = field(default_factory=list)
    step: int = 0
