"""Rank-sharded, deterministic, resumable loading of image datasets (shared by ``cifar`` and ``imagenet``).

Determinism: the augmentation of a sample is drawn from torch's RNG seeded from
``(seed, epoch, sample index)``, inside :func:`torch.random.fork_rng`. A batch therefore depends only on
the seed, the epoch and its position in the rank's shard: not on ``num_workers``, not on where a run
was resumed, and not on (nor disturbing) the training process's own RNG (dropout, stochastic depth).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from subnetdp import ConfigError, DataConfig, ResumableLoader

_MASK = (1 << 63) - 1


@dataclass
class VisionDataConfig(DataConfig):
    """Keys shared by the image datasets (``data.*``)."""

    root: str = "data"
    num_workers: int = 0
    augment: bool = True


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation in one epoch."""
    return ((seed * 1_000_003 + epoch) * 1_000_033 + index) & _MASK


class SeededTransform(Dataset):
    """A map-style dataset keyed by ``(epoch, index)``: ``base[index]`` transformed under a seeded RNG.

    Args:
        base: returns ``(image, label)`` with the image untransformed (PIL).
        transform: torchvision transform (its random parameters come from torch's global RNG).
        seed: the run's seed.
    """

    def __init__(self, base: Any, transform: Callable[[Any], torch.Tensor], seed: int) -> None:
        self.base, self.transform, self.seed = base, transform, seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key
        image, label = self.base[index]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, epoch, index))
            return self.transform(image), label


class Transformed(Dataset):
    """``base[index]`` through a deterministic transform (evaluation)."""

    def __init__(self, base: Any, transform: Callable[[Any], torch.Tensor]) -> None:
        self.base, self.transform = base, transform

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.base[index]
        return self.transform(image), label


class ShardedImageLoader(ResumableLoader):
    """Endless batches of this rank's shard of an image dataset, reshuffled every epoch.

    The shard is ``DistributedSampler(num_replicas=world_size, rank=rank, seed=seed)``: the ranks'
    shards are disjoint and together cover the dataset (``drop_last``: each epoch drops at most
    ``world_size - 1`` samples so that every rank has as many). Every rank gets the same number of
    full batches per epoch, so ranks never disagree on the number of steps. The position (epoch,
    batch) is saved and restored by :meth:`state_dict` / :meth:`load_state_dict`.
    """

    def __init__(self, dataset: SeededTransform, rank: int, world_size: int, batch_size: int, seed: int,
                 num_workers: int = 0) -> None:
        self.dataset = dataset
        self.batch_size, self.num_workers = batch_size, num_workers
        self.sampler = DistributedSampler(range(len(dataset)), num_replicas=world_size, rank=rank, shuffle=True,
                                          seed=seed, drop_last=True)
        self.batches_per_epoch = len(self.sampler) // batch_size
        if self.batches_per_epoch == 0:
            # Every rank computes the same shard sizes, so every rank stops here with this message.
            raise ConfigError("train.batch_size", batch_size,
                              f"each of the {world_size} ranks' shards holds {len(self.sampler)} of the "
                              f"{len(dataset)} training samples, fewer than one batch",
                              f"use train.batch_size<={max(1, len(self.sampler))}, fewer ranks, or more data")
        self.seed, self.rank = seed, rank
        self.epoch, self.batch = 0, 0

    def shard(self, epoch: int) -> list[int]:
        """The dataset indices this rank reads in ``epoch``, in order (full batches only)."""
        self.sampler.set_epoch(epoch)
        return list(self.sampler)[:self.batches_per_epoch * self.batch_size]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            keys = [(self.epoch, i) for i in self.shard(self.epoch)[self.batch * self.batch_size:]]
            # An explicit generator: DataLoader would otherwise draw its worker seed from the global RNG.
            gen = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, self.rank))
            loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=keys, drop_last=True,
                                num_workers=self.num_workers, generator=gen)
            for x, y in loader:
                self.batch += 1
                yield x, y
            self.epoch, self.batch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])


def eval_loader(dataset: Transformed, batch_size: int, num_workers: int = 0) -> DataLoader:
    """The whole held-out split in its fixed order."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                      generator=torch.Generator().manual_seed(0))


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (so ranks started together download once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def absolute(root: str) -> Path:
    """``data.root`` as an absolute path, for messages that say exactly where data is expected."""
    return Path(os.path.expanduser(root)).absolute()
