"""The Swin reference model: torchvision's Swin Transformers as subnetdp trains them, no SDP code.

``build_reference`` is also how an exported model is rebuilt (``subnetdp export``); ``VARIANTS``
holds the architectures subnetdp ships.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torchvision.models.swin_transformer import SwinTransformer

# torchvision's swin_t / swin_s / swin_b, plus a small configuration for 32x32 inputs.
VARIANTS: dict[str, dict[str, Any]] = {
    "t": {"patch_size": 4, "embed_dim": 96, "depths": [2, 2, 6, 2], "num_heads": [3, 6, 12, 24],
          "window_size": 7, "stochastic_depth_prob": 0.2},
    "s": {"patch_size": 4, "embed_dim": 96, "depths": [2, 2, 18, 2], "num_heads": [3, 6, 12, 24],
          "window_size": 7, "stochastic_depth_prob": 0.3},
    "b": {"patch_size": 4, "embed_dim": 128, "depths": [2, 2, 18, 2], "num_heads": [4, 8, 16, 32],
          "window_size": 7, "stochastic_depth_prob": 0.5},
    "cifar": {"patch_size": 2, "embed_dim": 48, "depths": [2, 2, 2, 2], "num_heads": [3, 6, 12, 24],
              "window_size": 4, "stochastic_depth_prob": 0.1},
}


def build_reference(num_classes: int, in_channels: int = 3, **arch: Any) -> SwinTransformer:
    """The plain torchvision ``SwinTransformer`` subnetdp trains (also how to rebuild an exported one).

    Args:
        num_classes: classifier outputs.
        in_channels: image channels; the patch-embedding convolution is rebuilt for them if not 3.
        **arch: ``patch_size``, ``embed_dim``, ``depths``, ``num_heads``, ``window_size``,
            ``stochastic_depth_prob``, ``mlp_ratio``, ``dropout``, ``attention_dropout``
            (see :data:`VARIANTS`; ``swin_t`` is ``build_reference(1000, **VARIANTS["t"])``).
    """
    p, w = int(arch["patch_size"]), int(arch["window_size"])
    model = SwinTransformer(patch_size=[p, p], embed_dim=int(arch["embed_dim"]), depths=list(arch["depths"]),
                            num_heads=list(arch["num_heads"]), window_size=[w, w],
                            mlp_ratio=float(arch.get("mlp_ratio", 4.0)), dropout=float(arch.get("dropout", 0.0)),
                            attention_dropout=float(arch.get("attention_dropout", 0.0)),
                            stochastic_depth_prob=float(arch["stochastic_depth_prob"]), num_classes=num_classes)
    if in_channels != 3:
        # torchvision leaves this convolution at PyTorch's default initialisation: so do we.
        model.features[0][0] = nn.Conv2d(in_channels, int(arch["embed_dim"]), kernel_size=(p, p), stride=(p, p))
    return model
