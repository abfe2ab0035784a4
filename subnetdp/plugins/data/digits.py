"""Data ``digits``: scikit-learn's 1,797 real 8x8 handwritten digits (no download).

A fixed, seeded split holds out ``test_fraction`` of the images; ``data.image_size`` resizes
(bilinear), e.g. to 32 for models built for CIFAR-sized inputs.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from subnetdp import ConfigError, DataConfig, DataSpec, hookimpl
from subnetdp.plugins.data._sharded import InMemoryData

NUM_IMAGES = 1797  # scikit-learn's digits
LOAD_COPIES = 3  # resized, normalised, and the split's contiguous copies


def _digits() -> tuple[Any, Any]:
    """The images (N, 8, 8) and labels of scikit-learn's ``digits.csv.gz``, read as ``load_digits`` reads it.

    Read directly: importing ``sklearn.datasets`` costs about a second of CPU in every worker.
    """
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        d = load_digits()
        return d.images, d.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


@dataclass
class DigitsConfig(DataConfig):
    image_size: int = 8
    test_fraction: float = 0.2
    split_seed: int = 0


class DigitsData(InMemoryData):
    """scikit-learn's digits as 1-channel images, normalised with the training split's statistics."""

    Config = DigitsConfig
    ignores = {"root": "its images ship with scikit-learn"}

    @classmethod
    def validate_config(cls, cfg: Any, root: Any) -> None:
        if not 0.0 < cfg.test_fraction < 1.0:
            raise ConfigError("data.test_fraction", cfg.test_fraction, "must be in (0, 1)")
        if cfg.image_size < 1:
            raise ConfigError("data.image_size", cfg.image_size, "must be >= 1 (8 is the native size)")
        # Every image is resized and held in memory (three copies while loading): at 4096 pixels that
        # is hundreds of GiB, the allocator's traceback in the launching process otherwise.
        need = LOAD_COPIES * NUM_IMAGES * 4 * cfg.image_size ** 2
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
        if have and need > have:
            raise ConfigError("data.image_size", cfg.image_size, f"the {NUM_IMAGES} digits resized to it need about "
                              f"{need / 2**30:,.0f} GiB of memory while loading, this machine has {have / 2**30:,.0f} GiB",
                              "use a smaller size (8 is the native one, 32 suits the CIFAR stem)")

    def __init__(self, cfg: Any, seed: int = 0) -> None:
        super().__init__(cfg, seed)
        self._splits: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    def _load(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        if self._splits is None:
            images, target = _digits()
            x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
            y = torch.tensor(target, dtype=torch.int64)
            size = self.cfg.image_size
            if size != 8:
                x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.cfg.split_seed))
            n_test = int(round(len(x) * self.cfg.test_fraction))
            test, train = perm[:n_test], perm[n_test:]
            mean, std = x[train].mean(), x[train].std()
            x = (x - mean) / std
            self._splits = ((x[train].contiguous(), y[train]), (x[test].contiguous(), y[test]))
        return self._splits

    def spec(self) -> DataSpec:
        return DataSpec(in_channels=1, image_size=self.cfg.image_size, num_classes=10)

    def split(self, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return self._load()[0 if train else 1]


@hookimpl
def subnetdp_register_datasets(registry) -> None:
    registry.add("digits", DigitsData)
