"""The ResNet reference model: torchvision's ResNets as subnetdp trains them, no SDP code.

``build_reference`` is also how an exported model is rebuilt (``subnetdp export``).
"""

from __future__ import annotations

import torchvision
from torch import nn

VARIANTS = ("resnet18", "resnet34", "resnet50")


def build_reference(variant: str, num_classes: int, in_channels: int = 3, cifar_stem: bool = False,
                    zero_init_residual: bool = False) -> nn.Module:
    """The plain torchvision model subnetdp trains (also how to rebuild an exported one).

    ``cifar_stem`` replaces the 7x7/2 stem convolution and max-pool with a 3x3/1 convolution, the
    usual choice for 32x32 (or smaller) images.
    """
    model = torchvision.models.get_model(variant, weights=None, num_classes=num_classes,
                                         zero_init_residual=zero_init_residual)
    if cifar_stem or in_channels != 3:
        k, s, p = (3, 1, 1) if cifar_stem else (7, 2, 3)
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=k, stride=s, padding=p, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    if cifar_stem:
        model.maxpool = nn.Identity()
    return model
