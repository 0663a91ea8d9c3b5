"""What ``Dataset`` and ``DataIterator`` share: a dataset's schema, rows as dicts, argument checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["Schema", "check_positive_int", "row_dicts", "type_name"]


def type_name(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    if dtype.hasobject:
        return "object"
    if not shape:
        return str(dtype)
    return f"numpy.ndarray(shape={shape}, dtype={dtype})"


class Schema:
    """Column names and types of a dataset (Ray's ``Dataset.schema()``).

    Attributes:
        names: The column names, in order.
        types: One numpy dtype per column (``object`` for Python objects).
        shapes: The shape of one row's value, per column (``()`` for scalars).
    """

    def __init__(self, names: list[str], types: list[np.dtype], shapes: list[tuple[int, ...]]) -> None:
        self.names = names
        self.types = types
        self.shapes = shapes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schema):
            return NotImplemented
        return (self.names, self.types, self.shapes) == (other.names, other.types, other.shapes)

    def __repr__(self) -> str:
        types = [type_name(t, s) for t, s in zip(self.types, self.shapes, strict=True)]
        width = max([len("Column"), *(len(n) for n in self.names)])
        lines = [f"{'Column':<{width}}  Type", f"{'------':<{width}}  ----"]
        lines += [f"{name:<{width}}  {kind}" for name, kind in zip(self.names, types, strict=True)]
        return "\n".join(lines)


def _python_values(chunk: np.ndarray) -> list[Any]:
    """Row values of a column chunk: Python scalars for scalar columns, arrays for tensor columns."""
    if chunk.ndim == 1 and not chunk.dtype.hasobject:
        return chunk.tolist()
    return list(chunk)


def row_dicts(columns: Mapping[str, np.ndarray], start: int, stop: int) -> list[dict[str, Any]]:
    """Rows ``start:stop`` of ``columns`` as dicts."""
    if not columns:
        return [{} for _ in range(start, stop)]
    names = list(columns)
    values = [_python_values(column[start:stop]) for column in columns.values()]
    return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` if it is an int >= ``minimum``; else a ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"`{name}` must be an integer, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
    return int(value)
