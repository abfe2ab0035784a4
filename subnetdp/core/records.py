"""Declarative checks of JSON records read from disk (a checkpoint's manifest, a run's summary).

A file read from disk is data: before any code uses a record, its shape is checked against a
description (field -> expected kind), and the first mismatch becomes one line naming the file, the
field, what was found and what was expected, so damaged metadata never surfaces as an
``AttributeError`` deep inside a reader::

    SUMMARY = Record({"steps": Int(0)}, optional={"eval": Nullable(MapOf(Str(), Number()))})
    check(SUMMARY, json.loads(text), "runs/x/summary.json")
    # CheckpointError: runs/x/summary.json: steps is 'abc' (a string), expected an integer >= 0

:func:`plain_name_problem` is the one test of a file name a record carries: a plain name inside the
record's own directory, never a path that leads elsewhere.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from subnetdp.core.errors import CheckpointError


class BadJSON(ValueError):
    """A file that is not JSON this project can read; ``str()`` says why in a few words."""


def read_json(path: Path) -> Any:
    """The JSON value in the file ``path``: the one reader of the project's own JSON files (manifests,
    plans, summaries, lineage and survivors' records).

    Whatever a damaged or crafted file holds ends in :class:`BadJSON` (a ``ValueError``) with a short
    reason, which the caller puts on its one line: invalid UTF-8 or JSON, nesting too deep for the
    parser (``RecursionError``), or an integer beyond Python's digit limit. ``OSError`` (a missing
    file among them) passes through.
    """
    return parse_json(Path(path).read_bytes())


def parse_json(data: bytes) -> Any:
    """:func:`read_json` for bytes already read (e.g. a safetensors header)."""
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise BadJSON("nested deeper than the JSON parser can follow") from None
    except UnicodeDecodeError as e:
        raise BadJSON(f"not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise BadJSON(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # an integer of thousands of digits: "Exceeds the limit (4300 digits)"
        raise BadJSON(f"holds a number too long to read ({str(e).splitlines()[0][:80]})") from None


class Mismatch(Exception):
    """A value that is not of the kind described (internal: :func:`check` turns it into one line)."""

    def __init__(self, where: str, value: Any, expected: str, what: str | None = None) -> None:
        super().__init__(where)
        self.where, self.value, self.expected = where, value, expected
        self.what = what or f"{where or 'the file'} is {shown(value)}"


def plain_name_problem(name: Any) -> str | None:
    """Why ``name`` is not a plain file name inside its directory, or None when it is one."""
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if "\0" in name:
        return "holds a NUL byte"
    if "/" in name or "\\" in name:
        return "is a path, not a plain name (it holds a / or \\)"
    if name in (".", ".."):
        return "names a directory, not a file in this one"
    return None


def _kind_of(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "a mapping", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def shown(value: Any, width: int = 60) -> str:
    """A value as one short line for a message: its repr cut to ``width``, then its kind."""
    text = repr(value)
    return f"{text[:width]}{'...' if len(text) > width else ''} ({_kind_of(value)})"


class Kind:
    """What a value must be; :meth:`check` raises :class:`Mismatch` naming where it is not."""

    expected = "a value"

    def accepts(self, value: Any) -> bool:
        return True

    def check(self, value: Any, where: str) -> None:
        if not self.accepts(value):
            raise Mismatch(where, value, self.expected)


@dataclass(frozen=True)
class Leaf(Kind):
    """A scalar: one of ``types`` (never a bool, unless asked for), and ``ok(value)`` when given."""

    types: tuple[type, ...]
    expected: str
    ok: Callable[[Any], bool] | None = None

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) and bool not in self.types:
            return False
        return isinstance(value, self.types) and (self.ok is None or self.ok(value))


def Int(lo: int | None = None) -> Leaf:
    """An integer, at least ``lo`` when given."""
    return Leaf((int,), "an integer" + (f" >= {lo}" if lo is not None else ""),
                None if lo is None else (lambda v: v >= lo))


def Anything() -> Kind:
    """Any JSON value (a field that is only passed on, or compared as a whole)."""
    return Kind()


def Number() -> Leaf:
    return Leaf((int, float), "a number")


def Str(pattern: str | None = None, expected: str = "a string") -> Leaf:
    """A string; with ``pattern``, one that matches it whole."""
    return Leaf((str,), expected, None if pattern is None else (lambda v: re.fullmatch(pattern, v) is not None))


def FileName() -> Leaf:
    """A plain file name inside the record's own directory (:func:`plain_name_problem`)."""
    return Leaf((str,), "a plain file name inside the checkpoint's directory (no /, \\, '.', '..' or NUL)",
                lambda v: plain_name_problem(v) is None)


@dataclass(frozen=True)
class Nullable(Kind):
    kind: Kind

    @property
    def expected(self) -> str:  # type: ignore[override]
        return f"null or {self.kind.expected}"

    def check(self, value: Any, where: str) -> None:
        if value is None:
            return
        try:
            self.kind.check(value, where)
        except Mismatch as m:
            if m.where == where and m.value is value:  # the value itself, not something inside it
                raise Mismatch(where, value, self.expected) from None
            raise


@dataclass(frozen=True)
class ListOf(Kind):
    item: Kind

    @property
    def expected(self) -> str:  # type: ignore[override]
        return f"a list of {self.item.expected}"

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, list):
            raise Mismatch(where, value, self.expected)
        for i, v in enumerate(value):
            self.item.check(v, f"{where}[{i}]")


@dataclass(frozen=True)
class MapOf(Kind):
    """A mapping whose keys are of ``key`` and values of ``value``."""

    key: Kind
    value: Kind

    @property
    def expected(self) -> str:  # type: ignore[override]
        return f"a mapping of {self.key.expected} -> {self.value.expected}"

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise Mismatch(where, value, self.expected)
        for k, v in value.items():
            if not self.key.accepts(k):
                raise Mismatch(where, k, f"every key to be {self.key.expected}", what=f"{where} has the key {k!r}")
            self.value.check(v, f"{where}[{k!r}]")


@dataclass(frozen=True)
class Record(Kind):
    """A mapping with named fields: ``fields`` required, ``optional`` checked when present.

    ``closed``: no other field is allowed (for records every field of which a reader passes on, as
    keyword arguments for instance); otherwise other fields are left alone (nothing reads them).
    """

    fields: dict[str, Kind]
    optional: dict[str, Kind] = field(default_factory=dict)
    closed: bool = False

    @property
    def expected(self) -> str:  # type: ignore[override]
        return "a mapping with " + ", ".join([*self.fields, *(f"{k} (optional)" for k in self.optional)])

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise Mismatch(where, value, self.expected)
        inside = f"{where}." if where else ""
        for name, kind in self.fields.items():
            if name not in value:
                raise Mismatch(f"{inside}{name}", None, kind.expected, what=f"lacks the field {inside}{name}")
            kind.check(value[name], f"{inside}{name}")
        for name, kind in self.optional.items():
            if name in value:
                kind.check(value[name], f"{inside}{name}")
        if self.closed:
            known = set(self.fields) | set(self.optional)
            for name in value:
                if name not in known:
                    raise Mismatch(where, value, f"only the fields {', '.join(sorted(known))}",
                                   what=f"{where or 'the file'} has the field {name!r}")


def check(kind: Kind, value: Any, file: Any, consequence: str = "") -> None:
    """Raise :class:`CheckpointError`, one line naming ``file`` and the field, unless ``value`` is
    of ``kind``; ``consequence`` (e.g. "the manifest is damaged") ends the line."""
    try:
        kind.check(value, "")
    except Mismatch as m:
        raise CheckpointError(f"{file}: {m.what}, expected {m.expected}"
                              + (f": {consequence}" if consequence else "")) from None
