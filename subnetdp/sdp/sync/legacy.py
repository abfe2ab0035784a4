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
