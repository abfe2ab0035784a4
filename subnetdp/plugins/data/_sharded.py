"""A resumable, rank-sharded loader over in-memory tensors, and the base of the small data modules
(``digits``, ``synthetic``) whose two splits are such tensors."""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from subnetdp import DataModule, ResumableLoader


class ShardedTensorLoader(ResumableLoader):
    """Endless batches of this rank's shard; reshuffled every epoch from ``seed + epoch``.

    Every rank gets the same number of full batches per epoch (the remainder is dropped), so ranks
    never disagree on the number of steps. The position (epoch, batch) can be saved and restored.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], rank: int, world_size: int, batch_size: int,
                 seed: int, transform: Callable[[tuple[torch.Tensor, ...], torch.Generator], tuple[torch.Tensor, ...]] | None = None) -> None:
        self.tensors = tuple(tensors)
        self.batch_size = batch_size
        self.sampler = DistributedSampler(TensorDataset(*self.tensors), num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=seed, drop_last=True)
        self.batches_per_epoch = len(self.sampler) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"a rank's shard holds {len(self.sampler)} samples, fewer than one batch of {batch_size}")
        self.transform = transform
        self.seed, self.rank = seed, rank
        self.epoch, self.batch = 0, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        while True:
            self.sampler.set_epoch(self.epoch)
            order = torch.tensor(list(self.sampler))
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 7919 + self.rank)
            while self.batch < self.batches_per_epoch:
                idx = order[self.batch * self.batch_size:(self.batch + 1) * self.batch_size]
                self.batch += 1
                out = tuple(t[idx] for t in self.tensors)
                yield self.transform(out, gen) if self.transform else out
            self.epoch, self.batch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])


def batched(tensors: Sequence[torch.Tensor], batch_size: int) -> list[tuple[Any, ...]]:
    """The whole split in order, in batches (the last may be smaller)."""
    n = len(tensors[0])
    return [tuple(t[i:i + batch_size] for t in tensors) for i in range(0, n, batch_size)]


class InMemoryData(DataModule):
    """A data module whose splits are tensors held whole in memory: each rank trains on its shard of
    the training split (:class:`ShardedTensorLoader`) and evaluates the held-out split in order."""

    @abc.abstractmethod
    def split(self, train: bool) -> tuple[torch.Tensor, ...]:
        """The training split (``train``) or the held-out one: ``(images, labels)``."""

    def train_loader(self, rank: int, world_size: int, batch_size: int) -> ShardedTensorLoader:
        return ShardedTensorLoader(self.split(train=True), rank, world_size, batch_size, self.seed)

    def eval_loader(self, batch_size: int) -> list:
        return batched(self.split(train=False), batch_size)
