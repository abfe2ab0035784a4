"""Every implementation of a core protocol declares every member with the protocol's parameters:
the synchronisers (every step, FSDP-sharded, local steps) implement ``GradSynchronizer``, and the
training state's parallelism implements ``Parallelism``. A method renamed or re-parameterised on one side
fails here, not in the middle of a run."""

from __future__ import annotations

import inspect
import typing

import pytest

from subnetdp.parallel.apply import Parallelism, RankParallelism
from subnetdp.parallel.fsdp import ShardedOwnerAverager
from subnetdp.sdp.local_steps import LocalStepsSynchronizer
from subnetdp.sdp.sync import GradSynchronizer, OwnerGroupAverager

IMPLEMENTATIONS = [(GradSynchronizer, OwnerGroupAverager), (GradSynchronizer, ShardedOwnerAverager),
                   (GradSynchronizer, LocalStepsSynchronizer), (Parallelism, RankParallelism)]


def _members(protocol: type) -> dict[str, object]:
    out = {}
    for klass in protocol.__mro__:
        if klass in (typing.Protocol, typing.Generic, object):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_"):
                out.setdefault(name, value)
        for name in getattr(klass, "__annotations__", {}):
            if not name.startswith("_"):
                out.setdefault(name, None)  # a data attribute: set in __init__
    return out


def _params(fn: object) -> list[tuple[str, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.default) for p in sig.parameters.values() if p.name != "self"]


@pytest.mark.parametrize("protocol,impl", IMPLEMENTATIONS, ids=lambda x: x.__name__)
def test_implementation_declares_every_protocol_member(protocol, impl):
    members = _members(protocol)
    assert members, protocol
    for name, spec in members.items():
        if spec is None:  # a data attribute: the implementation sets it on every instance
            src = inspect.getsource(impl)
            assert f"self.{name}" in src or hasattr(impl, name), f"{impl.__name__} never sets {name!r}"
            continue
        assert hasattr(impl, name), f"{impl.__name__} lacks {protocol.__name__}.{name}"
        got = inspect.getattr_static(impl, name)
        if isinstance(spec, property):
            assert isinstance(got, property) or not callable(got), f"{impl.__name__}.{name} should be a property"
            continue
        assert callable(got), f"{impl.__name__}.{name} is not a method"
        assert _params(got) == _params(spec), f"{impl.__name__}.{name}{inspect.signature(got)} != protocol {inspect.signature(spec)}"


def test_a_missing_member_is_caught():
    class Broken:  # an implementation that forgot one method
        dense = replicated = False

    with pytest.raises(AssertionError, match="lacks GradSynchronizer.prepare|never sets"):
        test_implementation_declares_every_protocol_member(GradSynchronizer, Broken)
