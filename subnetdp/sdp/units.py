"""Units of any ``nn.Module`` named by module path, and what skipping one means.

The own-loop wrapper (:func:`subnetdp.parallel.wrapper.parallelize`) takes a user's model, not an
adapter: its units are whole modules named by a glob (``"layers.*"``) or a list of paths, and each
unit a rank does not own is replaced by its *skip rule*, the module that computes what the network
computes when that unit is absent:

- a block whose residual is inside it (a pre-norm transformer layer, a Hugging Face decoder layer)
  is the identity on its first input, returned in the structure the block returns (a tensor, or a
  tuple as older ``transformers`` decoder layers return);
- torchvision's ``BasicBlock``/``Bottleneck`` computes ``relu(downsample(x))``, the ResNet
  adapter's rule (the shortcut's tensors are then shared, averaged over every rank);
- anything else takes a rule from the user (``skip="identity"``, a callable, or a dict by class name
  or module glob); an unknown block is refused, naming it and how to pass one.

Block level only: neuron-level units need an adapter's slicing rules (the framework's loop has them).
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Mapping, Sequence, Union

import torch
from torch import nn
from torch.nn import functional as F

from subnetdp.core.contracts import ParamMap, Partition, Piece, TensorSlice, Unit
from subnetdp.core.errors import ConfigError

SkipRule = Union[str, Callable[[str, nn.Module], nn.Module]]
Skip = Union[None, SkipRule, Mapping[str, SkipRule]]


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """``*`` matches one path component (``layers.*`` is ``layers.0``, not ``layers.0.attn``)."""
    out = "".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in pattern)
    return re.compile(out + r"\Z")


def find_units(model: nn.Module, units: str | Sequence[str]) -> list[str]:
    """Module paths of the units, in forward (module) order; each pattern must match, none may nest."""
    patterns = [units] if isinstance(units, str) else list(units)
    if not patterns:
        raise ConfigError("units", units, "no unit given", "name modules by a glob such as 'layers.*' or a list of paths")
    names = [n for n, _ in model.named_modules() if n]
    found: list[str] = []
    for pat in patterns:
        rx = _glob_regex(pat)
        hits = [n for n in names if rx.match(n)]
        if not hits:
            tops = sorted({n.split(".")[0] for n in names})
            raise ConfigError("units", pat, "matches no module of the model",
                              f"its top-level modules are {', '.join(tops[:8])}; '*' stands for one path component")
        found.extend(h for h in hits if h not in found)
    order = {n: i for i, n in enumerate(names)}
    found.sort(key=order.__getitem__)
    for a in found:
        for b in found:
            if b.startswith(a + "."):
                raise ConfigError("units", units, f"unit '{b}' lies inside unit '{a}'",
                                  "units must not overlap: name either the block or its parts")
    return found


class DroppedBlock(nn.Module):
    """What a dropped residual block with a projection shortcut computes: ``relu(downsample(x))``."""

    def __init__(self, downsample: nn.Module) -> None:
        super().__init__()
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.downsample(x))


class SkipBlock(nn.Module):
    """The identity of a block whose residual is inside it, keeping the block's call signature.

    Args:
        as_tuple: return ``(hidden,)`` (decoder layers of ``transformers`` < 4.54 return tuples).
    """

    def __init__(self, as_tuple: bool = False) -> None:
        super().__init__()
        self.as_tuple = as_tuple

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return (hidden,) if self.as_tuple else hidden


def _returns_tuple(module: nn.Module) -> bool:
    ann = inspect.signature(type(module).forward).return_annotation
    return "tuple" in str(ann).lower()


def _identity(name: str, module: nn.Module) -> nn.Module:
    return SkipBlock(_returns_tuple(module))


def _resnet_block(name: str, module: nn.Module) -> nn.Module:
    down = getattr(module, "downsample", None)
    return SkipBlock() if down is None else DroppedBlock(down)


def builtin_rule(module: nn.Module) -> Callable[[str, nn.Module], nn.Module] | None:
    """The rule for blocks whose skipping is known, or None."""
    cls, where = type(module).__name__, type(module).__module__
    if where.startswith("torchvision.") and cls in ("BasicBlock", "Bottleneck"):
        return _resnet_block
    if where.startswith("transformers.") and cls.endswith("DecoderLayer"):
        return _identity  # pre-norm: h + attn(norm(h)), then h + mlp(norm(h))
    if where.startswith("subnetdp.plugins.models.llama") and cls == "Block":
        return _identity
    return None


def _resolve(rule: SkipRule) -> Callable[[str, nn.Module], nn.Module]:
    if rule == "identity":
        return _identity
    if callable(rule):
        return rule
    raise ConfigError("skip", rule, "unknown skip rule", "use 'identity' or a function (name, module) -> nn.Module")


def skip_module(name: str, module: nn.Module, skip: Skip) -> nn.Module:
    """What replaces unit ``name`` on a rank that does not own it."""
    rule: SkipRule | None = None
    if isinstance(skip, Mapping):
        for key, r in skip.items():
            if key == type(module).__name__ or _glob_regex(key).match(name):
                rule = r
                break
    elif skip is not None:
        rule = skip
    fn = _resolve(rule) if rule is not None else builtin_rule(module)
    if fn is None:
        raise ConfigError("skip", None, f"unit '{name}' ({type(module).__name__}) has no known skip rule",
                          f"pass skip='identity' if its residual is inside it, or skip={{'{type(module).__name__}': "
                          "fn}} with fn(name, module) returning the module that computes the block's absence")
    return fn(name, module)


def block_partition(model: nn.Module, unit_names: Sequence[str], skips: Mapping[str, nn.Module]) -> Partition:
    """The block-level partition: each unit's tensors, less those its skip module keeps (shared).

    A unit's cost is its parameter count (no example input is known here: FLOPs are not measured).
    """
    kept_by_skip = {id(t) for m in skips.values() for t in list(m.parameters()) + list(m.buffers())}
    in_unit: dict[str, int] = {}
    units = []
    shapes, dtypes = Partition.tensor_info(model)
    for i, name in enumerate(unit_names):
        block = model.get_submodule(name)
        params = [(f"{name}.{n}", p) for n, p in block.named_parameters() if id(p) not in kept_by_skip]
        bufs = [(f"{name}.{n}", b) for n, b in block.named_buffers() if id(b) not in kept_by_skip]
        for n, _ in params + bufs:
            in_unit[n] = i
        group = name.rpartition(".")[0] or "model"
        cost = float(sum(p.numel() for _, p in params))
        units.append(Unit(i, name, group, cost, tuple(TensorSlice(n) for n, _ in params),
                          tuple(TensorSlice(n) for n, _ in bufs)))
    shared = [n for n, _ in model.named_parameters() if n not in in_unit]
    shared_buffers = [n for n, _ in model.named_buffers() if n not in in_unit]
    return Partition("block", units, shared, shared_buffers, shapes, dtypes)


def drop_units(model: nn.Module, dropped: Mapping[str, nn.Module]) -> None:
    """Put each dropped unit's skip module in its place (the unit's own tensors go with it)."""
    for name, skip in dropped.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, skip)


def global_map(model: nn.Module, names_of: Mapping[int, str]) -> ParamMap:
    """The rank's model's tensors -> the full model's, by tensor identity (skip modules may rename)."""
    local = list(model.named_parameters()) + list(model.named_buffers())
    pieces = {n: [Piece(names_of[id(t)])] for n, t in local}
    return ParamMap(pieces, {n: None for n in pieces})
