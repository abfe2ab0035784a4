"""Config fields that carry their own documentation, range and choices, and the one check of them.

A schema declares what a field may hold where the field is defined::

    coverage: float = doc("C", 0.5, lo=0.0, lo_open=True, hi=1.0, fix="use a coverage such as 0.5")
    regime: str = doc("forward or backward", "forward", choices=("forward", "backward"))

:func:`check_declared` enforces every declaration of a schema (nested sections included) on a composed
config, with one :class:`~subnetdp.core.errors.ConfigError` line naming the key, the value, the valid
range or choices and the fix; :meth:`Bounds.text` is what the README's key table shows. A list field
with a range holds numbers, each of which must lie in it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from subnetdp.core.errors import ConfigError, suggest


class _NoDefault:
    """A field without a default (``dataclasses.MISSING``), shown by name in ``doc``'s signature."""

    def __repr__(self) -> str:
        return "MISSING"


_NO_DEFAULT: Any = _NoDefault()
WRITES = "writes"  # field metadata: the field chooses where (or whether) files are written


@dataclass(frozen=True)
class Bounds:
    """What a field may hold: a range ``lo``..``hi`` (either end open or absent) or a set of choices."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] = ()
    fix: str = ""

    def text(self) -> str:
        """The valid values in words: ``(0.0, 1.0]``, ``>= 1``, ``<= 4``, or ``block, neuron``."""
        if self.choices:
            return ", ".join(self.choices)
        if self.lo is not None and self.hi is not None:
            return f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return f"{'<' if self.hi_open else '<='} {self.hi}"

    def must(self) -> str:
        """``must be in [0, 1)`` or ``must be >= 1``."""
        return f"must be in {self.text()}" if self.lo is not None and self.hi is not None else f"must be {self.text()}"

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is refused (None when it is valid)."""
        if self.choices:
            if value in self.choices:
                return None
            return f"valid choices: {', '.join(self.choices)}" + suggest(str(value), self.choices)
        return self.must() if self.outside(value) else None

    def outside(self, value: Any) -> bool:
        """A number beyond an end (NaN is left to the finiteness check, which names it as such)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True
        low = self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo))
        high = self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi))
        return bool(low or high)


def doc(text: str, default: Any = _NO_DEFAULT, *, factory: Any = _NO_DEFAULT, lo: float | None = None,
        hi: float | None = None, lo_open: bool = False, hi_open: bool = False, choices: Sequence[str] = (),
        fix: str = "", writes: bool = False) -> Any:
    """A config field with its one-line documentation (shown in the README's key table) and, optionally,
    the values it may hold.

    ``key: int = doc("what it means", 3)``; mutable defaults use ``factory=``. ``lo``/``hi`` bound a
    number (``lo_open``/``hi_open`` exclude the end itself; a list field's every entry), ``choices``
    lists the strings allowed, and ``fix`` is the advice printed when a value is refused. Composition
    enforces them before any process group exists. ``writes=True`` declares that the field chooses
    where (or whether) files are written, e.g. a cache folder or a download switch: ``subnetdp eval``
    and ``subnetdp export`` never take such a value from a checkpoint's stored config, but from their
    own invocation (the default, or ``data.KEY=...`` on their command line). A plugin without ``doc``
    declares it with ``dataclasses.field(default=..., metadata={"writes": True})``.
    """
    metadata: dict[str, Any] = {"doc": text, **({WRITES: True} if writes else {})}
    if lo is not None or hi is not None or choices:
        metadata["bounds"] = Bounds(lo, hi, lo_open, hi_open, tuple(choices), fix)
    if factory is not _NO_DEFAULT:
        return field(default_factory=factory, metadata=metadata)
    return field(default=dataclasses.MISSING if default is _NO_DEFAULT else default, metadata=metadata)


def writing_keys(schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of ``schema``'s fields (nested config dataclasses included) declared with ``writes``."""
    keys = []
    for f in dataclasses.fields(schema):
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            keys += writing_keys(nested, f"{prefix}{f.name}.")
        elif f.metadata.get(WRITES):
            keys.append(prefix + f.name)
    return keys


def bounds_of(f: dataclasses.Field) -> Bounds | None:
    """The declared range or choices of a schema field (None when it declares none)."""
    return f.metadata.get("bounds")


def _section(f: dataclasses.Field, sections: dict[str, type]) -> type | None:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    if isinstance(f.type, type) and dataclasses.is_dataclass(f.type):
        return f.type
    return sections.get(kind)


def declared(schema: type, prefix: str = "", sections: dict[str, type] | None = None) -> Iterator[tuple[str, Bounds]]:
    """Every ``(key, bounds)`` a schema declares, nested sections included (``sections`` resolves the
    section types that ``from __future__ import annotations`` leaves as names)."""
    for f in dataclasses.fields(schema):
        sub = _section(f, sections or {})
        if sub is not None:
            yield from declared(sub, f"{prefix}{f.name}.", sections)
        elif bounds_of(f) is not None:
            yield f"{prefix}{f.name}", bounds_of(f)  # type: ignore[misc]


def check_declared(node: Any, schema: type, prefix: str = "", sections: dict[str, type] | None = None) -> None:
    """Refuse the first value of ``node`` (a composed config section) outside its field's declaration."""
    for f in dataclasses.fields(schema):
        if f.name not in node:
            continue
        value = node[f.name]
        sub = _section(f, sections or {})
        if sub is not None:
            check_declared(value, sub, f"{prefix}{f.name}.", sections)
            continue
        bounds = bounds_of(f)
        if bounds is None or value is None:  # an optional field left empty means "the default behaviour"
            continue
        key = f"{prefix}{f.name}"
        if isinstance(value, Sequence) and not isinstance(value, str):
            entries = list(value)
            for entry in entries:
                if bounds.problem(entry):
                    raise ConfigError(key, entries, f"holds {entry}: every entry {bounds.must()}", bounds.fix)
            continue
        problem = bounds.problem(value)
        if problem:
            raise ConfigError(key, value, problem, bounds.fix)
