"""The model adapter contract: how a model is built, partitioned into units and trained."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Sequence

if TYPE_CHECKING:
    import torch
    from torch import nn

from subnetdp.core.contracts.types import DataSpec, HiddenSite, ParamMap, Partition
from subnetdp.core.contracts.plugin import ModelConfig, Plugin


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

    def drop_units(self, submodel: "nn.Module", owned: Sequence[int], partition: Partition) -> Optional[ParamMap]:
        """Optional: remove from ``submodel`` (a subnetwork :meth:`materialize` made), in place, every unit
        not in ``owned`` (a subset of the units it holds), and return its new map. Every tensor it keeps
        must stay the same object with the same pieces (its values and optimizer state go on as they
        are; the framework checks, and builds anew when they do not). Used when a member of a world
        that grows back at a join only loses units (docs/inprocess.md). None, the default: the adapter
        cannot, and the framework builds the smaller subnetwork anew (on ``meta``, filled from the old)."""
        return None

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
