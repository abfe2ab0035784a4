"""Model ``swin``: torchvision's Swin Transformer; units are the Swin blocks of each stage.

torchvision lays a Swin Transformer out as ``features`` = [patch embedding, stage 1, patch merging,
stage 2, ..., stage 4], then ``norm``, ``permute``, ``avgpool``, ``flatten``, ``head``. A block is
``x + sd(attn(norm1(x)))`` followed by ``x + sd(mlp(norm2(x)))``: with both residual branches zero
it is the identity, so a dropped block simply disappears from its stage. The patch embedding, the
patch-merging layers, the final norm and the head are shared.

A subnetwork keeps the *original* block modules under their original indices (``features.5.3``
stays ``features.5.3``), so each kept block keeps its own shifted or unshifted window and its own
stochastic-depth probability, and local names equal global names. Blocks are grouped per stage,
so every subnetwork keeps the same number of blocks in every stage and ranks cost the same.

Variants ``t``, ``s``, ``b`` are torchvision's ``swin_t``/``swin_s``/``swin_b``; ``cifar`` is a small
configuration for 32x32 images (patch 2, window 4, embedding 48, depths 2-2-2-2). Every
architecture key (``patch_size``, ``window_size``, ``embed_dim``, ``depths``, ``num_heads``,
``stochastic_depth_prob``) overrides the variant's value when set.

Neuron level (``masker.granularity=neuron``): units are ``masker.units_per_layer`` equal ranges of
each block's MLP hidden dimension, one group ``features.s.b.mlp`` per block; a subnetwork's MLPs are
physically narrower (see :mod:`subnetdp.plugins.models.swin.neurons`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn
from torchvision.models.swin_transformer import ShiftedWindowAttention, SwinTransformer, SwinTransformerBlock

from subnetdp import ConfigError, DataSpec, HiddenSite, ModelConfig, hookimpl
from subnetdp.plugins.models._blocks import ImageClassifierAdapter, check_variant
from subnetdp.plugins.models.swin.model import VARIANTS, build_reference
from subnetdp.plugins.models.swin.neurons import materialize_neurons, neuron_partition

ARCH_KEYS = ("patch_size", "embed_dim", "depths", "num_heads", "window_size", "stochastic_depth_prob")


@dataclass
class SwinConfig(ModelConfig):
    variant: str = "t"
    patch_size: Optional[int] = None
    window_size: Optional[int] = None
    embed_dim: Optional[int] = None
    depths: Optional[list[int]] = None
    num_heads: Optional[list[int]] = None
    stochastic_depth_prob: Optional[float] = None
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    attention_dropout: float = 0.0


def architecture(cfg: Any) -> dict[str, Any]:
    """The variant's architecture with the config's explicit values on top."""
    arch = dict(VARIANTS[cfg.variant])
    for key in ARCH_KEYS:
        value = getattr(cfg, key, None)
        if value is not None:
            arch[key] = list(value) if key in ("depths", "num_heads") else value
    for key in ("mlp_ratio", "dropout", "attention_dropout"):
        arch[key] = float(getattr(cfg, key))
    return arch


def stage_indices(model: SwinTransformer) -> list[int]:
    """Positions of the stages in ``model.features`` (1, 3, 5, 7 in torchvision's layout)."""
    return list(range(1, len(model.features), 2))


class SwinAdapter(ImageClassifierAdapter):
    """torchvision Swin Transformers: block-level units (one group per stage) or MLP hidden ranges."""

    Config = SwinConfig
    default_image_size = 224
    neuron_partition = staticmethod(neuron_partition)
    materialize_neurons = staticmethod(materialize_neurons)

    @classmethod
    def validate_config(cls, cfg: Any, root: Any) -> None:
        check_variant(cfg.variant, VARIANTS)
        arch = architecture(cfg)
        depths, heads = arch["depths"], arch["num_heads"]
        if len(depths) != len(heads):
            raise ConfigError("model.num_heads", heads, f"needs one entry per stage ({len(depths)} stages in "
                              f"model.depths={depths})", "give model.depths and model.num_heads the same length")
        if any(d < 1 for d in depths) or sum(depths) < 2:
            raise ConfigError("model.depths", depths, "every stage needs >= 1 block and the model >= 2 blocks")
        for i, h in enumerate(heads):
            dim = arch["embed_dim"] * 2 ** i
            if h < 1 or dim % h:
                raise ConfigError("model.num_heads", heads, f"stage {i} has width {dim}, not divisible by {h} heads",
                                  "choose head counts that divide embed_dim * 2**stage")
        for key in ("patch_size", "window_size", "embed_dim"):
            if int(arch[key]) < 1:
                raise ConfigError(f"model.{key}", arch[key], "must be >= 1")
        if not 0.0 <= float(arch["stochastic_depth_prob"]) < 1.0:
            raise ConfigError("model.stochastic_depth_prob", arch["stochastic_depth_prob"], "must be in [0, 1)")
        if float(getattr(cfg, "stochastic_depth", 0.0) or 0.0) > 0 and float(arch["stochastic_depth_prob"]) > 0:
            raise ConfigError("model.stochastic_depth", cfg.stochastic_depth,
                              f"would stack on torchvision's own stochastic depth (model.stochastic_depth_prob="
                              f"{arch['stochastic_depth_prob']:g} from variant {cfg.variant})",
                              "set model.stochastic_depth_prob=0 (model.stochastic_depth is the same rate on every block)")

    def init_module(self, name: str, module: nn.Module) -> None:
        """torchvision's Swin initialisation, module by module: every Linear truncated-normal (std 0.02)
        with zero bias, the relative-position bias tables likewise, the position index computed, the
        rest (LayerNorm, the patch-embedding convolution) PyTorch's default."""
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, ShiftedWindowAttention):
            nn.init.trunc_normal_(module.relative_position_bias_table, std=0.02)
            module.define_relative_position_index()
        else:
            super().init_module(name, module)

    def build(self, spec: DataSpec) -> nn.Module:
        return build_reference(spec.num_classes, spec.in_channels or 3, **architecture(self.cfg))

    def residual_branches(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        """A Swin block's two residual branches: ``attn`` and ``mlp`` (before torchvision's own
        stochastic depth)."""
        return {f"features.{si}.{key}": [block.attn, block.mlp] for si in stage_indices(model)
                for key, block in model.features[si].named_children()}

    def branch_output_layers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        """The attention's output projection ``attn.proj`` and the MLP's last linear ``mlp[3]``."""
        return {f"features.{si}.{key}": [block.attn.proj, block.mlp[3]] for si in stage_indices(model)
                for key, block in model.features[si].named_children()}

    def hidden_sites(self, model: nn.Module) -> list[HiddenSite]:
        """The MLP hidden is the output of ``mlp[2]`` (its dropout), channels last."""
        return [HiddenSite(block.mlp[2], -1, "output") for si in stage_indices(model)
                for block in model.features[si].children()]

    def reference_options(self, spec: DataSpec) -> dict[str, Any]:
        return {"num_classes": spec.num_classes, "in_channels": spec.in_channels or 3, **architecture(self.cfg)}

    @staticmethod
    def reference_model(options: dict[str, Any]) -> nn.Module:
        """The plain torchvision model for :meth:`reference_options` (used by ``subnetdp export``)."""
        return build_reference(**options)

    def named_blocks(self, model: nn.Module) -> list[tuple[str, str, nn.Module]]:
        """``(name, stage, block)`` of every Swin block, in forward order (``features.1.0``, ...)."""
        return [(f"features.{si}.{bi}", f"features.{si}", block) for si in stage_indices(model)
                for bi, block in enumerate(model.features[si])]

    def drop_blocks(self, model: nn.Module, keep: set[str]) -> None:
        for si in stage_indices(model):
            # The original block objects under their original indices (their keys, so a subnetwork this
            # made loses more blocks the same way): shift and drop-path stay theirs.
            kept = OrderedDict((key, block) for key, block in model.features[si].named_children()
                               if f"features.{si}.{key}" in keep)
            model.features[si] = nn.Sequential(kept)

    def blocks(self, submodel: nn.Module) -> list[nn.Module]:
        return [b for si in stage_indices(submodel) for b in submodel.features[si]
                if isinstance(b, SwinTransformerBlock)]


@hookimpl
def subnetdp_register_models(registry) -> None:
    registry.add("swin", SwinAdapter)
