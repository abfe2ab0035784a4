"""Data ``imagenet``: an ImageFolder tree (ILSVRC-2012 or any dataset laid out the same way).

``data.root`` holds ``train/<class>/<image>`` and ``val/<class>/<image>``, with the same class
folders in both (for ILSVRC-2012: extract ``ILSVRC2012_img_train.tar`` and its per-class tars into
``train/``, and sort ``ILSVRC2012_img_val.tar`` into class folders under ``val/``, e.g. with the
``valprep.sh`` script of the PyTorch ImageNet example). The number of classes is the number of
class folders. Transforms are the usual ones: RandomResizedCrop + horizontal flip for training,
resize to ``image_size / crop_ratio`` + centre crop for evaluation, then ImageNet normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from torchvision import datasets, transforms

from subnetdp import ConfigError, DataModule, DataSpec, hookimpl
from subnetdp.plugins.data._vision import (SeededTransform, ShardedImageLoader, Transformed, VisionDataConfig,
                                           absolute, eval_loader)

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
SPLITS = ("train", "val")
LAYOUT = ("{root}/train/<class>/<image>.JPEG and {root}/val/<class>/<image>.JPEG with the same class folders "
          "in both (ILSVRC-2012 from https://image-net.org/download.php: extract ILSVRC2012_img_train.tar and its "
          "per-class tars into train/, and sort ILSVRC2012_img_val.tar into class folders under val/, e.g. with "
          "valprep.sh from github.com/pytorch/examples/tree/main/imagenet)")


@dataclass
class ImageNetConfig(VisionDataConfig):
    root: str = "data/imagenet"
    image_size: int = 224
    crop_ratio: float = 0.875
    min_scale: float = 0.08
    num_classes: int = 1000  # what `subnetdp plan` assumes without the tree; training counts the class folders


def _classes(folder: Path) -> list[str]:
    return sorted(e.name for e in folder.iterdir() if e.is_dir()) if folder.is_dir() else []


class ImageNetData(DataModule):
    """An ImageFolder tree with ``train`` and ``val`` splits, sharded by rank."""

    Config = ImageNetConfig

    @classmethod
    def validate_config(cls, cfg: Any, root: Any) -> None:
        if cfg.image_size < 1:
            raise ConfigError("data.image_size", cfg.image_size, "must be >= 1 (224 is the usual size)")
        if not 0.0 < cfg.crop_ratio <= 1.0:
            raise ConfigError("data.crop_ratio", cfg.crop_ratio, "must be in (0, 1] (0.875: resize 256, crop 224)")
        if not 0.0 < cfg.min_scale <= 1.0:
            raise ConfigError("data.min_scale", cfg.min_scale, "must be in (0, 1] (RandomResizedCrop's lower scale)")
        if cfg.num_workers < 0:
            raise ConfigError("data.num_workers", cfg.num_workers, "must be >= 0 (0 loads in the training process)")

    @classmethod
    def conformance_overrides(cls, tmp_path: Path) -> list[str]:
        write_tiny_imagefolder(tmp_path / "imagenet", classes=3, per_class=(12, 4), size=40)
        return [f"data.root={tmp_path / 'imagenet'}", "data.image_size=32"]

    def __init__(self, cfg: Any, seed: int = 0) -> None:
        super().__init__(cfg, seed)
        self._splits: dict[str, datasets.ImageFolder] = {}
        self._class_names: list[str] | None = None

    @property
    def root(self) -> Path:
        return absolute(self.cfg.root)

    def check(self) -> None:
        """Require both splits, with class folders, the same in both."""
        found = {split: _classes(self.root / split) for split in SPLITS}
        empty = [s for s in SPLITS if not found[s]]
        if empty:
            raise ConfigError("data.root", self.cfg.root,
                              f"no class folders under {', '.join(str(self.root / s) for s in empty)}",
                              "expected " + LAYOUT.format(root=self.root))
        if found["train"] != found["val"]:
            only_train = sorted(set(found["train"]) - set(found["val"]))[:5]
            only_val = sorted(set(found["val"]) - set(found["train"]))[:5]
            raise ConfigError("data.root", self.cfg.root,
                              f"train/ and val/ have different class folders ({len(found['train'])} vs "
                              f"{len(found['val'])}; only in train: {only_train}, only in val: {only_val})",
                              "give val/ the same class folders as train/ (sort the validation images by class)")
        self._class_names = found["train"]

    def _split(self, split: str) -> datasets.ImageFolder:
        if split not in self._splits:
            if self._class_names is None:
                self.check()
            self._splits[split] = datasets.ImageFolder(str(self.root / split))
        return self._splits[split]

    def spec(self) -> DataSpec:
        if self._class_names is None:
            self.check()
        return DataSpec(in_channels=3, image_size=self.cfg.image_size, num_classes=len(self._class_names or []))

    def planning_spec(self) -> tuple[DataSpec, str]:
        if _classes(self.root / "train"):
            return self.spec(), f"dataset ({self.root}: class folders; data.image_size)"
        return (DataSpec(in_channels=3, image_size=self.cfg.image_size, num_classes=self.cfg.num_classes),
                f"config ({self.root}/train not found: data.num_classes={self.cfg.num_classes}, data.image_size)")

    def train_loader(self, rank: int, world_size: int, batch_size: int) -> ShardedImageLoader:
        size = self.cfg.image_size
        if self.cfg.augment:
            head = [transforms.RandomResizedCrop(size, scale=(self.cfg.min_scale, 1.0), antialias=True),
                    transforms.RandomHorizontalFlip()]
        else:
            head = self._eval_head()
        transform = transforms.Compose(head + [transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        return ShardedImageLoader(SeededTransform(self._split("train"), transform, self.seed), rank, world_size,
                                  batch_size, self.seed, self.cfg.num_workers)

    def _eval_head(self) -> list[Any]:
        size = self.cfg.image_size
        return [transforms.Resize(round(size / self.cfg.crop_ratio), antialias=True), transforms.CenterCrop(size)]

    def eval_loader(self, batch_size: int) -> Any:
        transform = transforms.Compose(self._eval_head() + [transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        return eval_loader(Transformed(self._split("val"), transform), batch_size, self.cfg.num_workers)


def write_tiny_imagefolder(root: Path, classes: int = 3, per_class: tuple[int, int] = (12, 4), size: int = 40,
                           seed: int = 0) -> Path:
    """Write a small ImageFolder tree of random PNG images (``train`` and ``val``) for smoke tests."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for split, n in zip(SPLITS, per_class):
        for c in range(classes):
            folder = Path(root) / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (size, size + 8 * (i % 2), 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{split}_{c}_{i}.png")
    return Path(root)


@hookimpl
def subnetdp_register_datasets(registry) -> None:
    registry.add("imagenet", ImageNetData)
