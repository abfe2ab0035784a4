"""The plugin base and the config schemas every plugin kind mounts (``masker``, ``comm``, ``data``, ``model``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional

from subnetdp.core.fields import doc

if TYPE_CHECKING:
    import torch

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


def config_fields(cfg_cls: type) -> list[str]:
    """The field names of a plugin ``Config`` dataclass."""
    return [f.name for f in dataclasses.fields(cfg_cls)]
