"""A synchroniser with the protocol's old state methods, seen through ``state_dict``/``load_state_dict``.

:func:`stateful` lets one written before this release still load, with a :class:`DeprecationWarning`.

Until this release a :class:`~subnetdp.sdp.sync.protocol.GradSynchronizer` handed its own state to
checkpoints through five methods: ``extra_tensors`` (per-parameter tensors), ``rank_state`` /
``load_rank_state`` (per-rank values), ``resume_at`` (the phase of a checkpoint's step, before its
pieces were loaded) and ``restore_extra`` (after them). They fold into ``state_dict()`` and
``load_state_dict(state)``; a third-party synchroniser that defines only the old five is seen through
:class:`LegacyState` for one release, so its checkpoints stay as they were.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

OLD_METHODS = ("extra_tensors", "rank_state", "load_rank_state", "resume_at", "restore_extra")


def stateful(sync: Any) -> Any:
    """``sync`` itself when it has ``state_dict``/``load_state_dict``; one that defines only the old
    state methods is wrapped in :class:`LegacyState` (with a DeprecationWarning naming its class)."""
    if callable(getattr(sync, "state_dict", None)) and callable(getattr(sync, "load_state_dict", None)):
        return sync
    if not all(callable(getattr(sync, name, None)) for name in OLD_METHODS):
        return sync  # neither shape: the protocol check (or the first checkpoint) names what it lacks
    warnings.warn(f"{type(sync).__name__} defines {', '.join(OLD_METHODS)} instead of state_dict() / "
                  "load_state_dict(state): the old methods are used for this release and dropped in the next; "
                  "see docs/architecture.md, 'What the synchroniser answers'", DeprecationWarning, stacklevel=3)
    return LegacyState(sync)


class LegacyState:
    """A synchroniser with the old state methods, seen with ``state_dict``/``load_state_dict``;
    every other attribute is the synchroniser's own (read and written through)."""

    def __init__(self, sync: Any) -> None:
        object.__setattr__(self, "inner", sync)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)

    def _live(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for prefix, name, t in self.inner.extra_tensors():
            out.setdefault(prefix, {})[name] = t
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"pieces": self._live(), "rank": dict(self.inner.rank_state())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        inner = self.inner
        if "step" in state:
            inner.resume_at(int(state["step"]))  # the phase first: it may allocate what is filled next
        live, found = self._live(), set()
        for prefix, tensors in dict(state.get("pieces", {})).items():
            for name, t in tensors.items():
                if name in live.get(prefix, {}):
                    live[prefix][name].copy_(t)
                    found.add(prefix)
        inner.restore_extra(found)
        inner.load_rank_state(dict(state.get("rank", {})))


def _deprecated(name: str, instead: str) -> None:
    warnings.warn(f"GradSynchronizer.{name} is deprecated and goes in the next release: use {instead}",
                  DeprecationWarning, stacklevel=3)


class OldStateMethods:
    """The five old state methods on a synchroniser that has ``state_dict``/``load_state_dict``, for
    callers written before them (one release, each with a DeprecationWarning): each is said in
    terms of the new two, in the order a checkpoint used them (``resume_at``, the per-piece tensors
    filled in place, ``restore_extra``, ``load_rank_state``)."""

    def extra_tensors(self) -> list[tuple[str, str, Any]]:
        _deprecated("extra_tensors()", "state_dict()['pieces']")
        pieces = self.state_dict().get("pieces") or {}  # type: ignore[attr-defined]
        return [(prefix, name, t) for prefix, tensors in pieces.items() for name, t in tensors.items()]

    def resume_at(self, step: int) -> None:
        _deprecated("resume_at(step)", "load_state_dict({'step': step, ...})")
        # The live per-piece state handed back as it is: only the phase of ``step`` changes.
        self.load_state_dict({"step": step, "pieces": self.state_dict().get("pieces") or {}})  # type: ignore[attr-defined]

    def restore_extra(self, found: set[str]) -> None:
        _deprecated("restore_extra(found)", "load_state_dict({'pieces': ...})")
        pieces = self.state_dict().get("pieces") or {}  # type: ignore[attr-defined]
        self.load_state_dict({"pieces": {p: t for p, t in pieces.items() if p in found}})  # type: ignore[attr-defined]

    def rank_state(self) -> dict[str, Any]:
        _deprecated("rank_state()", "state_dict()['rank']")
        return dict(self.state_dict().get("rank") or {})  # type: ignore[attr-defined]

    def load_rank_state(self, state: Mapping[str, Any]) -> None:
        _deprecated("load_rank_state(state)", "load_state_dict({'rank': state, ...})")
        pieces = self.state_dict().get("pieces") or {}  # type: ignore[attr-defined]
        self.load_state_dict({"pieces": pieces, "rank": dict(state)})  # type: ignore[attr-defined]
