"""Errors that reach the user as a message, never as a traceback."""

from __future__ import annotations

import difflib
from typing import Iterable


class SubnetdpError(Exception):
    """Base class of every error the CLI prints without a traceback."""


class ConfigError(SubnetdpError):
    """A config key holds a bad value.

    Args:
        key: dotted config key, e.g. ``masker.coverage``.
        value: the offending value.
        problem: what is wrong with it.
        fix: what the user should do instead.
    """

    def __init__(self, key: str, value: object, problem: str, fix: str = "") -> None:
        self.key, self.value, self.problem, self.fix = key, value, problem, fix
        msg = f"{key}={value!r}: {problem}"
        if fix:
            msg += f" — {fix}"
        super().__init__(msg)


class PlanError(SubnetdpError):
    """A mask plan is invalid (an unowned unit, ranks that disagree)."""


class RankMismatchError(SubnetdpError):
    """Ranks started with different plans, configs or plugin versions."""


class CheckpointError(SubnetdpError):
    """A checkpoint is missing, incomplete, corrupted, foreign or incompatible with this run."""


class PeerLost(SubnetdpError):
    """A collective failed because a peer died or stopped answering (``lost``: their ranks, when known).

    The training loop answers it by writing this rank's units as of its last finished step (recovery
    from the surviving owners) before it exits.
    """

    def __init__(self, message: str, lost: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.lost = sorted(lost)


class NonFiniteError(SubnetdpError):
    """The loss or the gradients became inf or NaN (``train.on_nonfinite=stop``)."""


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return ``" — did you mean 'x'?"`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f" — did you mean '{close[0]}'?" if close else ""
