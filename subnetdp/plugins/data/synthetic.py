"""Data ``synthetic``: seeded random images labelled by a fixed random teacher (learnable, instant)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from subnetdp import ConfigError, DataConfig, DataSpec, hookimpl
from subnetdp.plugins.data._sharded import InMemoryData


@dataclass
class SyntheticConfig(DataConfig):
    image_size: int = 8
    in_channels: int = 3
    num_classes: int = 10
    train_samples: int = 1024
    test_samples: int = 256


class SyntheticData(InMemoryData):
    """Gaussian images; the label is the argmax of a fixed random linear map of the image."""

    Config = SyntheticConfig
    ignores = {"root": "it makes its images from the seed; nothing is read from disk"}

    @classmethod
    def validate_config(cls, cfg: Any, root: Any) -> None:
        for key in ("image_size", "in_channels", "num_classes", "train_samples", "test_samples"):
            if cfg[key] < 1:
                raise ConfigError(f"data.{key}", cfg[key], "must be >= 1")

    def _make(self, n: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        c, s, k = self.cfg.in_channels, self.cfg.image_size, self.cfg.num_classes
        teacher = torch.randn(c * s * s, k, generator=torch.Generator().manual_seed(1234))
        x = torch.randn(n, c, s, s, generator=torch.Generator().manual_seed(offset))
        y = (x.flatten(1) @ teacher).argmax(1)
        return x, y

    def spec(self) -> DataSpec:
        return DataSpec(in_channels=self.cfg.in_channels, image_size=self.cfg.image_size,
                        num_classes=self.cfg.num_classes)

    def split(self, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # Two independent draws (generator seeds 1 and 2); the teacher labelling them is the same.
        return self._make(self.cfg.train_samples, 1) if train else self._make(self.cfg.test_samples, 2)


@hookimpl
def subnetdp_register_datasets(registry) -> None:
    registry.add("synthetic", SyntheticData)
