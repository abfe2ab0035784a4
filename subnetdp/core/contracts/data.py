"""The data module contract: sharded, resumable loaders."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator, Optional

if TYPE_CHECKING:
    import torch

from subnetdp.core.contracts.types import DataSpec
from subnetdp.core.contracts.plugin import DataConfig, Plugin


class DataModule(Plugin, abc.ABC):
    """A dataset: its spec and deterministic, resumable, rank-sharded loaders."""

    Config: ClassVar[type] = DataConfig
    #: The kind of data it yields (``image``, ``tokens``); a model of the same kind pairs with it.
    data_kind: ClassVar[str] = "image"

    def __init__(self, cfg: Any, seed: int = 0) -> None:
        super().__init__(cfg)
        self.seed = seed

    def check(self) -> None:
        """Raise :class:`ConfigError` if the data is missing (called before any process group)."""

    def tokenizer(self) -> Any:
        """The tokenizer that made the data's tokens (``encode``, ``decode``, ``eot``, ``vocab_size``), or
        None when there is none or it is unknown. Optional: language-model data that knows it returns it
        (downstream evaluation and HF export need it)."""
        return None

    @classmethod
    def has_tokenizer(cls) -> bool:
        return cls.tokenizer is not DataModule.tokenizer

    @classmethod
    def unsafe_to_open(cls, cfg: Any) -> str | None:
        """Why reading the files ``cfg`` names could run code, or None when it cannot.

        ``subnetdp eval`` and ``subnetdp export`` do not trust a checkpoint's ``config.yaml`` to pick
        data that could execute code when read (unverified pickles, ``torch.load`` without
        ``weights_only``): they refuse such a config unless the user names the data on the command
        line. Override this when the module deserialises its files with anything that can run code.
        """
        return None

    @abc.abstractmethod
    def spec(self) -> DataSpec: ...

    def planning_spec(self) -> tuple[DataSpec, str]:
        """The spec for ``subnetdp plan``, with or without the data on disk, and where it came from.

        Returns ``(spec, source)``; ``source`` starts with ``dataset`` when files were read and
        ``config`` otherwise. Default: :meth:`spec` (right for modules whose spec reads no files).
        """
        return self.spec(), "config (the data module's spec reads no files)"

    def example_batch(self, spec: DataSpec, batch_size: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """A batch of the loaders' shapes and dtypes made from the spec alone (for dry runs).

        Default: token windows ``(tokens, targets)`` of ``(batch_size, seq_len)`` for a spec with
        a vocabulary, else images ``(batch_size, C, S, S)`` with integer labels.
        """
        import torch

        if spec.vocab_size or spec.seq_len:
            tokens = torch.zeros(batch_size, spec.seq_len, dtype=torch.int64)
            return tokens, tokens.clone()
        images = torch.zeros(batch_size, spec.in_channels, spec.image_size, spec.image_size)
        return images, torch.zeros(batch_size, dtype=torch.int64)

    @abc.abstractmethod
    def train_loader(self, rank: int, world_size: int, batch_size: int) -> "ResumableLoader": ...

    @abc.abstractmethod
    def eval_loader(self, batch_size: int) -> Iterable[Any]:
        """The held-out split, whole, in a fixed order (every rank evaluates the same batches)."""


class ResumableLoader(abc.ABC):
    """An endless iterator over training batches with a position that can be saved and restored.

    Attributes:
        batches_per_epoch: full batches in one pass over this rank's shard, or None for a stream
            of unknown length (then a resume on another world size restarts the epoch's count and
            ``eval.bn_recalibrate_batches`` is not checked against the data).
    """

    batches_per_epoch: Optional[int] = None

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Any]: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, int]: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, int]) -> None: ...
