"""What every record shares: one dict mechanism, the registry of kinds, and the table they print as.

Owns `to_dict` (nested records become nested dicts, each tagged
with its `kind`) and `from_dict` (nested records are rebuilt from
the declared field types, so a StepRecord's MemoryRecord comes back a MemoryRecord). Ranks
build records and ship the objects themselves (ipyparallel pickles them); the client keeps
them, viz/ draws them; dicts are for JSON files and reports. Knows nothing of torch,
ipyparallel or plotly.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, ClassVar, Iterable, Sequence, TypeVar

R = TypeVar("R", bound="Record")
RECORD_TYPES: dict[str, type["Record"]] = {}
"""kind -> record class, filled as each record class is defined."""


class Record:
    """Mixin of every record: the dict round trip (unknown keys are ignored: older clients, newer ranks)."""

    kind: ClassVar[str] = "record"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        RECORD_TYPES[cls.kind] = cls  # from_dict finds a record's class by the kind its dict carries

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        d["kind"] = self.kind
        return d

    @classmethod
    def from_dict(cls: type[R], d: dict[str, Any]) -> R:
        nested = _nested_fields(cls)
        values = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in d:
                continue
            v = d[f.name]
            shape, rtype = nested.get(f.name, (None, None))
            if shape == "one" and isinstance(v, dict):
                v = rtype.from_dict(v)
            elif shape == "list" and isinstance(v, list):
                v = [rtype.from_dict(x) if isinstance(x, dict) else x for x in v]
            values[f.name] = v
        return cls(**values)


def _plain(v: Any) -> Any:
    if isinstance(v, Record):
        return v.to_dict()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


@functools.cache
def _nested_fields(cls: type) -> dict[str, tuple[str, type]]:
    """Field name -> ('one' | 'list', Record subclass) for the fields declared to hold records."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str, type]] = {}
    for f in dataclasses.fields(cls):
        t = hints.get(f.name)
        origin, args = typing.get_origin(t), typing.get_args(t)
        if origin in (typing.Union, types.UnionType):
            inner = [a for a in args if a is not type(None)]
            t, origin, args = inner[0], typing.get_origin(inner[0]), typing.get_args(inner[0])
        if isinstance(t, type) and issubclass(t, Record):
            out[f.name] = ("one", t)
        elif origin is list and args and isinstance(args[0], type) and issubclass(args[0], Record):
            out[f.name] = ("list", args[0])
    return out


def from_dict(d: dict[str, Any]) -> Record:
    """Any record from its dict, by its 'kind'."""
    return RECORD_TYPES[d["kind"]].from_dict(d)


def table(records: Sequence[Record], columns: Iterable[str] | None = None) -> str:
    """A fixed-width text table, for printing records in a terminal or notebook."""
    if not records:
        return "(no records)"
    cols = list(columns or [f.name for f in dataclasses.fields(records[0])  # type: ignore[arg-type]
                            if not isinstance(getattr(records[0], f.name), (list, Record))])

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    rows = [[fmt(getattr(r, c, "")) for c in cols] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, rows)])


class RecordList(list):
    """A list of records that prints as a table (doctor(), train() results)."""

    columns: tuple[str, ...] | None = None

    def __init__(self, items: Iterable[Record] = (), columns: Iterable[str] | None = None):
        super().__init__(items)
        self.columns = tuple(columns) if columns else None

    def __str__(self) -> str:
        return table(self, self.columns)

    def _repr_pretty_(self, p, cycle):  # IPython display
        p.text(str(self))
