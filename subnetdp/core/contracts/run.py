"""The run types lifecycle hooks receive: the run context, a read-only view of the training state, the result."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch
    from torch import nn

    from omegaconf import DictConfig

    from subnetdp.core.config.settings import Settings
    from subnetdp.core.plan import MaskPlan

from subnetdp.core.contracts.types import DataSpec, LaunchEnv, ParamMap, Partition
from subnetdp.core.contracts.communicator import Communicator
from subnetdp.core.contracts.model import ModelAdapter
from subnetdp.core.contracts.data import DataModule


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
        flop_match: ``train.flop_matched``: the steps asked for (``train.steps``), the steps trained
            (:attr:`steps`) and the plan's training-FLOP ratio; else None.
        step_flops: training FLOPs of one step summed over all ranks (every micro-batch's forward
            and backward, counted on ``meta``): the x-axis on which runs of any coverage compare.
        settings: ``cfg`` as typed values (:class:`~subnetdp.core.config.Settings`), made from it when
            the context is made, so the two never disagree (a context copied with another ``cfg``,
            ``dataclasses.replace(ctx, cfg=...)``, gets that config's settings). None for a context
            built by hand around a partial config.

    What the run derives from its config is here, never written back into it: :attr:`steps` (the
    FLOP-matched count) and ``run_dir`` (with the name rank 0 made when ``run.name`` is empty).
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
    settings: Optional["Settings"] = field(init=False, default=None, compare=False)

    def __post_init__(self) -> None:
        from subnetdp.core.config.settings import Settings, is_composed

        typed = Settings.from_config(self.cfg) if is_composed(self.cfg) else None
        object.__setattr__(self, "settings", typed)  # frozen: set once, here

    @property
    def steps(self) -> int:
        """The steps this run trains: ``train.steps``, or with ``train.flop_matched`` the matched count."""
        if self.flop_match:
            return int(self.flop_match["steps"])
        return self.settings.train.steps if self.settings is not None else int(self.cfg.train.steps)

    @property
    def run_name(self) -> str:
        """The run directory's name: ``run.name``, or the one rank 0 made when it was empty."""
        return self.run_dir.name

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
