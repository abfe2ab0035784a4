"""Data ``cifar10`` and ``cifar100``: torchvision's CIFAR datasets in their standard on-disk format.

``data.root`` holds ``cifar-10-batches-py/`` (``data_batch_1`` .. ``data_batch_5``, ``test_batch``,
``batches.meta``) or ``cifar-100-python/`` (``train``, ``test``, ``meta``): the folders the official
archives extract to. ``data.download=true`` fetches and extracts the archive (once, under a file lock,
before any process group exists); it is off by default because training machines often have no
internet. Training images get the standard augmentation (random 32x32 crop of the image padded by 4,
horizontal flip), then an optional resize to ``data.image_size`` and per-channel normalisation.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from torchvision import datasets, transforms
from torchvision.datasets.utils import check_integrity

from subnetdp import ConfigError, DataModule, DataSpec, doc, hookimpl
from subnetdp.plugins.data._vision import (SeededTransform, ShardedImageLoader, Transformed, VisionDataConfig,
                                           absolute, eval_loader, exclusive)


@dataclass
class CifarConfig(VisionDataConfig):
    image_size: int = 32
    download: bool = doc("fetch the archive into data.root first (eval and export take their own, never a "
                         "checkpoint's)", False, writes=True)
    verify_checksums: bool = True


def _unverified(cls: type) -> type:
    """``cls`` reading its files without torchvision's MD5 check (done once by ``check`` instead)."""
    return type(cls.__name__, (cls,), {
        "train_list": [[name, None] for name, _ in cls.train_list],
        "test_list": [[name, None] for name, _ in cls.test_list],
        "meta": {**cls.meta, "md5": None},
    })


class CifarData(DataModule):
    """CIFAR-10 or CIFAR-100 (the subclass says which), sharded by rank."""

    Config = CifarConfig
    dataset: ClassVar[type] = datasets.CIFAR10
    title: ClassVar[str] = "CIFAR-10"
    num_classes: ClassVar[int] = 10
    mean: ClassVar[tuple[float, float, float]] = (0.4914, 0.4822, 0.4465)
    std: ClassVar[tuple[float, float, float]] = (0.2470, 0.2435, 0.2616)

    @classmethod
    def validate_config(cls, cfg: Any, root: Any) -> None:
        if cfg.image_size < 1:
            raise ConfigError("data.image_size", cfg.image_size, "must be >= 1 (32 is the native size)")
        if cfg.num_workers < 0:
            raise ConfigError("data.num_workers", cfg.num_workers, "must be >= 0 (0 loads in the training process)")

    @classmethod
    def unsafe_to_open(cls, cfg: Any) -> str | None:
        # CIFAR's batches are pickles: only the published files (MD5-checked) are safe to read.
        if cfg.verify_checksums:
            return None
        return (f"{cls.title}'s files are pickles, and data.verify_checksums=false "
                "would unpickle whatever data.root holds without checking them against the published MD5s")

    @classmethod
    def conformance_overrides(cls, tmp_path: Path) -> list[str]:
        write_tiny_cifar(tmp_path / "cifar", cls.dataset, n_train=64, n_test=32)
        return [f"data.root={tmp_path / 'cifar'}", "data.verify_checksums=false"]

    def __init__(self, cfg: Any, seed: int = 0) -> None:
        super().__init__(cfg, seed)
        self._checked = False
        self._splits: dict[bool, Any] = {}

    @property
    def folder(self) -> Path:
        return absolute(self.cfg.root) / self.dataset.base_folder

    def files(self) -> list[tuple[str, str]]:
        """(file name, MD5) of every file the dataset needs."""
        d = self.dataset
        return [(n, m) for n, m in d.train_list + d.test_list] + [(d.meta["filename"], d.meta["md5"])]

    def check(self) -> None:
        """Download if asked, then require every file (and, unless disabled, its published MD5)."""
        root = absolute(self.cfg.root)
        if self.cfg.download:
            self._download(root)
        missing = [n for n, _ in self.files() if not (self.folder / n).is_file()]
        if missing:
            d = self.dataset
            raise ConfigError(
                "data.root", self.cfg.root,
                f"{self.title} not found: expected {self.folder}/ holding "
                f"{', '.join(n for n, _ in self.files())} (missing: {', '.join(missing)})",
                f"set data.download=true to fetch {d.url} into {root} (needs internet), or download that "
                f"archive yourself and extract it there (tar -xzf {d.filename} -C {root}), or point data.root at "
                f"the folder that holds {d.base_folder}/")
        if self.cfg.verify_checksums and not self._checked:
            for name, md5 in self.files():
                if not check_integrity(str(self.folder / name), md5):
                    raise ConfigError("data.root", self.cfg.root,
                                      f"{self.folder / name} does not match the published {self.title} file "
                                      "(MD5 differs)", "delete the folder and download it again, or set "
                                      "data.verify_checksums=false to read a modified copy")
        self._checked = True

    def _download(self, root: Path) -> None:
        # Every rank may call this at once (torchrun): the lock makes one download, the others wait.
        with exclusive(root / f".{self.dataset.base_folder}.lock"):
            try:
                self.dataset(str(root), train=True, download=True)
            except Exception as e:  # no network, a proxy, a truncated archive
                raise ConfigError("data.download", True, f"fetching {self.dataset.url} failed: {e}",
                                  f"download the archive where the internet is reachable and extract it into {root}") from None

    def _split(self, train: bool) -> Any:
        if train not in self._splits:
            if not self._checked:
                self.check()
            self._splits[train] = _unverified(self.dataset)(str(absolute(self.cfg.root)), train=train)
        return self._splits[train]

    def _tail(self) -> list[Any]:
        size = self.cfg.image_size
        resize = [transforms.Resize((size, size), antialias=True)] if size != 32 else []
        return resize + [transforms.ToTensor(), transforms.Normalize(self.mean, self.std)]

    def spec(self) -> DataSpec:
        return DataSpec(in_channels=3, image_size=self.cfg.image_size, num_classes=self.num_classes)

    def planning_spec(self) -> tuple[DataSpec, str]:
        where = "dataset" if self.folder.is_dir() else "config"
        return self.spec(), f"{where} ({self.title}: {self.num_classes} classes; data.image_size)"

    def train_loader(self, rank: int, world_size: int, batch_size: int) -> ShardedImageLoader:
        augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if self.cfg.augment else []
        dataset = SeededTransform(self._split(True), transforms.Compose(augment + self._tail()), self.seed)
        return ShardedImageLoader(dataset, rank, world_size, batch_size, self.seed, self.cfg.num_workers)

    def eval_loader(self, batch_size: int) -> Any:
        return eval_loader(Transformed(self._split(False), transforms.Compose(self._tail())), batch_size,
                           self.cfg.num_workers)


class Cifar100Data(CifarData):
    """CIFAR-100 (fine labels)."""

    dataset = datasets.CIFAR100
    title = "CIFAR-100"
    num_classes = 100
    mean = (0.5071, 0.4865, 0.4409)
    std = (0.2673, 0.2564, 0.2762)


def write_tiny_cifar(root: Path, dataset: type = datasets.CIFAR10, n_train: int = 64, n_test: int = 32,
                     seed: int = 0) -> Path:
    """Write a small random dataset in the real CIFAR on-disk format under ``root`` (for smoke tests).

    Returns the dataset folder. Reading it needs ``data.verify_checksums=false``.
    """
    rng = np.random.default_rng(seed)
    folder = Path(root) / dataset.base_folder
    folder.mkdir(parents=True, exist_ok=True)
    hundred = issubclass(dataset, datasets.CIFAR100)
    classes = 100 if hundred else 10
    files = [n for n, _ in dataset.train_list]
    for name, n in [(f, n_train // len(files)) for f in files] + [(dataset.test_list[0][0], n_test)]:
        labels = rng.integers(0, classes, n).tolist()
        batch = {"batch_label": name, "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 "filenames": [f"img_{i}.png" for i in range(n)]}
        batch.update({"fine_labels": labels, "coarse_labels": [c // 5 for c in labels]} if hundred else {"labels": labels})
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    meta = ({"fine_label_names": [f"class_{i}" for i in range(100)], "coarse_label_names": [f"super_{i}" for i in range(20)]}
            if hundred else {"label_names": [f"class_{i}" for i in range(10)], "num_cases_per_batch": n_train // 5})
    with open(folder / dataset.meta["filename"], "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return folder


@hookimpl
def subnetdp_register_datasets(registry) -> None:
    registry.add("cifar10", CifarData)
    registry.add("cifar100", Cifar100Data)
