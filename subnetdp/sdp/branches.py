"""Residual branches and hidden channels: stochastic depth, structured dropout and branch scaling.

The model options ``model.stochastic_depth`` and ``model.hidden_dropout`` are the DDP baselines of
SDP at the same keep rate, applied to exactly what SDP masks:

- ``model.stochastic_depth = p`` drops each residual branch of every block-level unit (a ResNet
  block's residual branch; a LLaMA or Swin block's attention and MLP branches, each on its own) for
  each sample with probability ``p`` in training, and scales a kept branch by ``1 / (1 - p)``
  (torchvision's ``StochasticDepth`` in ``row`` mode, timm's ``DropPath``).
- ``model.hidden_dropout = p`` drops each hidden channel of every neuron-level group (ResNet inner
  channels, the LLaMA SwiGLU hidden, the Swin MLP hidden) for each sample with probability ``p``,
  the same mask over all positions and tokens of the sample (``nn.Dropout2d`` for images), and
  scales kept channels by ``1 / (1 - p)``.

Both are forward hooks on the model's own modules, attached from outside the model right after the
adapter builds it (:func:`regularize`, where the adapter's ``residual_branches`` and
``hidden_sites`` say), so the model and its ``state_dict`` stay the reference architecture; in
evaluation mode they do nothing, so evaluation is deterministic and at ``p = 0`` no hook is
attached at all. Masks come from torch's default generator, like
``nn.Dropout``'s, so activation checkpointing (which restores the RNG state) recomputes the same
masks. With the inverted scaling, the training-time expectation of a branch (or of a layer fed by
the hidden channels) equals its evaluation-time value exactly.

:func:`fold_branch_scales` is the evaluation rule for a block-level SDP union model
(``eval.block_union=rescaled``): each residual branch multiplied by its training keep rate, the
test-time rule of stochastic depth, folded into the branch's last affine layer so the scaled union
is still the plain reference architecture (``subnetdp eval`` and ``subnetdp export`` apply it too).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from subnetdp.core.contracts import HiddenSite, ModelAdapter

REGULARIZERS = ("stochastic_depth", "hidden_dropout")


def bernoulli_mask(shape: Sequence[int], keep: float, like: torch.Tensor) -> torch.Tensor:
    """A 0/1 tensor of ``shape`` (dtype and device of ``like``), each entry 1 with probability ``keep``."""
    return torch.empty(tuple(shape), dtype=like.dtype, device=like.device).bernoulli_(keep)


class DropPath:
    """Forward hook: per-sample stochastic depth on a module whose output is a residual branch.

    Attributes:
        p: the drop probability; the keep rate is ``1 - p``.
        sample: ``(shape, keep, like) -> mask``; replaceable, so a test can enumerate the masks.
    """

    def __init__(self, p: float) -> None:
        self.p = float(p)
        self.sample: Callable[[Sequence[int], float, torch.Tensor], torch.Tensor] = bernoulli_mask

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not module.training or self.p == 0.0:
            return None
        keep = 1.0 - self.p
        mask = self.sample((out.shape[0],) + (1,) * (out.dim() - 1), keep, out)
        return out * (mask / keep)


class DropChannels:
    """Structured dropout of hidden channels: one mask per sample and channel, shared by all positions.

    Used as a forward pre-hook (on the layer that consumes the channels, ``where="input"``) or a
    forward hook (on the module that produces them, ``where="output"``).

    Attributes:
        p: the drop probability; the keep rate is ``1 - p``.
        dim: the channel dimension of the activation (1 for ``N, C, H, W``; -1 for channels-last).
        sample: as for :class:`DropPath`.
    """

    def __init__(self, p: float, dim: int) -> None:
        self.p = float(p)
        self.dim = dim
        self.sample: Callable[[Sequence[int], float, torch.Tensor], torch.Tensor] = bernoulli_mask

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        keep = 1.0 - self.p
        shape = [1] * x.dim()
        shape[0] = x.shape[0]
        shape[self.dim] = x.shape[self.dim]
        return x * (self.sample(shape, keep, x) / keep)

    def pre_hook(self, module: nn.Module, args: tuple) -> tuple | None:
        if not module.training or self.p == 0.0:
            return None
        return (self.drop(args[0]),) + tuple(args[1:])

    def hook(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not module.training or self.p == 0.0:
            return None
        return self.drop(out)


def regularize(adapter: ModelAdapter, model: nn.Module) -> nn.Module:
    """Attach the adapter's ``model.stochastic_depth`` and ``model.hidden_dropout`` to ``model``, a full
    model it has just built (nothing when both are 0); returns ``model``.

    Config validation has already refused a rate the adapter does not list in ``regularizers``.
    """
    sd = float(getattr(adapter.cfg, "stochastic_depth", 0.0))
    hd = float(getattr(adapter.cfg, "hidden_dropout", 0.0))
    if sd > 0.0 or hd > 0.0:
        attach_regularizers(model, adapter.residual_branches(model) if sd > 0.0 else {},
                            adapter.hidden_sites(model) if hd > 0.0 else [], sd, hd)
    return model


def attach_regularizers(model: nn.Module, branches: Mapping[str, Sequence[nn.Module]],
                        hidden: Sequence[HiddenSite], stochastic_depth: float, hidden_dropout: float) -> list[Any]:
    """Attach stochastic depth to ``branches`` and structured dropout to ``hidden``; returns the hooks.

    Args:
        model: the full model (returned unchanged when both rates are 0).
        branches: block name -> the modules whose outputs are that block's residual branches.
        hidden: the hidden-channel sites of every neuron-level group.
        stochastic_depth: drop probability of a residual branch (``model.stochastic_depth``).
        hidden_dropout: drop probability of a hidden channel (``model.hidden_dropout``).
    """
    hooks: list[Any] = []
    if stochastic_depth > 0.0:
        for modules in branches.values():
            for m in modules:
                h = DropPath(stochastic_depth)
                m.register_forward_hook(h)
                hooks.append(h)
    if hidden_dropout > 0.0:
        for site in hidden:
            h = DropChannels(hidden_dropout, site.dim)
            if site.where == "input":
                site.module.register_forward_pre_hook(h.pre_hook)
            else:
                site.module.register_forward_hook(h.hook)
            hooks.append(h)
    return hooks


@torch.no_grad()
def fold_branch_scales(layers: Mapping[str, Sequence[nn.Module]], scales: Mapping[str, float]) -> int:
    """Scale every residual branch of block ``name`` by ``scales[name]``, in the weights.

    Args:
        layers: block name -> the last affine layers of its branches (``weight`` and optional
            ``bias``; a branch's output is linear in them, so scaling both scales the branch exactly).
        scales: block name -> factor; blocks missing stay at x1.

    Returns:
        the number of layers scaled.
    """
    n = 0
    for name, modules in layers.items():
        s = float(scales.get(name, 1.0))
        if s == 1.0:
            continue
        for m in modules:
            m.weight.mul_(s)
            if getattr(m, "bias", None) is not None:
                m.bias.mul_(s)
            n += 1
    return n


@contextlib.contextmanager
def regularizers_off(model: nn.Module) -> Iterator[None]:
    """Inside the block, the stochastic depth and hidden dropout attached to ``model`` do nothing,
    even in training mode (BatchNorm recalibration: train-mode statistics of the network that is
    evaluated, every branch and channel present)."""
    found = []
    for m in model.modules():
        for h in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]:
            reg = getattr(h, "__self__", h)  # DropChannels registers bound methods
            if isinstance(reg, (DropPath, DropChannels)):
                found.append((reg, reg.p))
    for reg, _ in found:
        reg.p = 0.0
    try:
        yield
    finally:
        for reg, p in found:
            reg.p = p
