"""Building datasets: from Python objects, numpy, pandas, torch, and from files (Ray's names)."""

from __future__ import annotations

import builtins
import csv
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ddptrain.data.dataset import Dataset, check_positive_int

if TYPE_CHECKING:
    import pandas

__all__ = ["from_items", "from_numpy", "from_pandas", "from_torch", "range", "read_numpy", "read_csv"]

Paths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def _column(values: list[Any]) -> np.ndarray:
    """One column from row values: a numeric array when numpy can make one of equal-shaped
    values, else an array of the Python objects (strings included)."""
    try:
        array = np.asarray(values)
    except (ValueError, TypeError, RuntimeError):  # ragged, or objects numpy cannot convert
        array = None
    if array is not None and len(array) == len(values) and not array.dtype.hasobject and array.dtype.kind not in "USV":
        return array
    objects = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        objects[i] = value
    return objects


def from_items(items: Iterable[Any]) -> Dataset:
    """A dataset of Python objects.

    Dict items are rows (a key missing from a row is ``None`` there); any other item ``x``
    becomes the row ``{"item": x}``, as in Ray.

    Example:
        >>> from_items([1, 2, 3]).take(1)
        [{'item': 1}]
        >>> from_items([{"x": [0.5, 1.5], "y": 1}]).schema()
        Column  Type
        ------  ----
        x       numpy.ndarray(shape=(2,), dtype=float64)
        y       int64
    """
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
        raise ValueError(
            f"`from_items()` takes a list of items (dicts or values), got {type(items).__name__}. "
            "For a dict of column arrays use `from_numpy({...})`."
        )
    rows = list(items)
    dicts = [isinstance(row, Mapping) for row in rows]
    if not rows:
        return Dataset({}, 0)
    if not any(dicts):
        return Dataset._build({"item": _column(rows)})
    if not all(dicts):
        position = dicts.index(not dicts[0])
        raise ValueError(
            f"`from_items()` got a mix of dicts and other values (item {position} is a "
            f"{type(rows[position]).__name__}); give every item as a dict, or none."
        )
    names: dict[Any, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    bad = [name for name in names if not isinstance(name, str)]
    if bad:
        raise ValueError(f"Row keys are column names and must be strings, got {bad[:5]}.")
    if not names:
        return Dataset({}, len(rows))
    return Dataset._build({name: _column([row.get(name) for row in rows]) for name in names})


def from_numpy(ndarrays: np.ndarray | Sequence[np.ndarray] | Mapping[str, Any]) -> Dataset:
    """A dataset from numpy arrays; the first axis is the rows.

    Args:
        ndarrays: An array (the column ``"data"``, as in Ray), a list of arrays concatenated
            into that column, or a dict of column arrays of the same length.

    Example:
        >>> ds = from_numpy({"x": np.zeros((100, 8), np.float32), "y": np.arange(100)})
        >>> ds.count(), ds.columns()
        (100, ['x', 'y'])
    """
    if isinstance(ndarrays, Mapping):
        columns = {name: np.asarray(values) for name, values in ndarrays.items()}
        if not columns:
            raise ValueError("`from_numpy()` got an empty dict; give at least one column.")
        return Dataset._build(columns)
    if isinstance(ndarrays, np.ndarray):
        return Dataset._build({"data": ndarrays})
    if isinstance(ndarrays, (list, tuple)) and ndarrays and all(isinstance(a, np.ndarray) for a in ndarrays):
        _check_pieces(ndarrays, [f"array {i}" for i in builtins.range(len(ndarrays))])
        return Dataset._build({"data": list(ndarrays)})
    raise ValueError(
        f"`from_numpy()` takes a numpy array, a non-empty list of arrays or a dict of column arrays, "
        f"got {type(ndarrays).__name__}."
    )


def _check_pieces(pieces: Sequence[np.ndarray], labels: list[str]) -> None:
    first = pieces[0]
    for piece, label in zip(pieces, labels, strict=True):
        if piece.ndim == 0:
            raise ValueError(f"{label} is a scalar; give arrays whose first axis is the rows.")
        if piece.dtype != first.dtype or piece.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"{label} has rows of {piece.dtype} {piece.shape[1:]}, but {labels[0]} has "
                f"{first.dtype} {first.shape[1:]}; all parts of a column must match."
            )


def from_pandas(dfs: pandas.DataFrame | Sequence[pandas.DataFrame]) -> Dataset:
    """A dataset from one or more pandas DataFrames with the same columns (the index is dropped).

    Needs pandas (imported only here).
    """
    try:
        import pandas
    except ImportError:
        raise ImportError("`from_pandas()` needs pandas: `pip install pandas`.") from None
    frames = [dfs] if isinstance(dfs, pandas.DataFrame) else list(dfs)
    if not frames or not all(isinstance(f, pandas.DataFrame) for f in frames):
        raise ValueError("`from_pandas()` takes a DataFrame or a non-empty list of DataFrames.")
    names = [str(c) for c in frames[0].columns]
    if len(set(names)) != len(names):
        raise ValueError(f"The DataFrame has duplicate column names: {names}.")
    for i, frame in enumerate(frames[1:], 1):
        if [str(c) for c in frame.columns] != names:
            raise ValueError(f"DataFrame {i} has columns {list(frame.columns)}, but DataFrame 0 has {names}.")
    columns = {}
    for name, key in zip(names, frames[0].columns, strict=True):
        parts = [frame[key].to_numpy() for frame in frames]
        columns[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return Dataset._build(columns)


def from_torch(dataset: Any) -> Dataset:
    """A dataset of the samples of a torch dataset: rows ``{"item": sample}``, as in Ray.

    Samples that are tensors (or arrays, or numbers) of one shape make a numeric column;
    other samples (tuples such as ``(image, label)``, dicts) are kept as Python objects,
    which ``iter_torch_batches`` collates with torch's ``default_collate``.

    Args:
        dataset: A map-style dataset (``__len__`` and ``__getitem__``), or an iterable one.
    """
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        samples = [dataset[i] for i in builtins.range(len(dataset))]
    elif isinstance(dataset, Iterable) and not isinstance(dataset, (str, bytes)):
        samples = list(dataset)
    else:
        raise ValueError(f"`from_torch()` takes a torch Dataset, got {type(dataset).__name__}.")
    import torch

    if samples and all(isinstance(s, torch.Tensor) for s in samples):
        try:
            return Dataset._build({"item": torch.stack(samples).detach().cpu().numpy()})
        except RuntimeError:  # shapes differ
            pass
    return Dataset._build({"item": _column(samples)})


def range(n: int, *, parallelism: int = -1, override_num_blocks: int | None = None) -> Dataset:  # noqa: A001
    """The rows ``{"id": 0}`` to ``{"id": n - 1}`` (int64), as in Ray.

    ``parallelism`` and ``override_num_blocks`` are accepted for compatibility and ignored.
    """
    return Dataset._build({"id": np.arange(check_positive_int("n", n, 0), dtype=np.int64)})


def _files(paths: Paths, suffix: str, reader: str) -> list[Path]:
    given = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not given:
        raise ValueError(f"`{reader}()` got no paths.")
    files: list[Path] = []
    for raw in given:
        path = Path(os.path.expanduser(os.fspath(raw)))
        if path.is_dir():
            found = sorted(p for p in path.rglob(f"*{suffix}") if p.is_file())
            if not found:
                raise ValueError(f"`{reader}()`: the folder {path} holds no {suffix} file.")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"`{reader}()`: {path} does not exist.")
    return files


def read_numpy(paths: Paths) -> Dataset:
    """A dataset from ``.npy`` files (folders are searched for them): column ``"data"``, the
    files' arrays one after another along the first axis, as in Ray.

    The files are read through a memory map and copied once, straight into shared memory.
    """
    files = _files(paths, ".npy", "read_numpy")
    arrays = []
    for file in files:
        try:
            arrays.append(np.load(file, mmap_mode="r", allow_pickle=False))
        except ValueError as exc:
            raise ValueError(f"`read_numpy()`: {file} is not a .npy file of numbers: {exc}") from exc
    _check_pieces(arrays, [str(f) for f in files])
    return Dataset._build({"data": arrays})


def _typed(values: list[str]) -> np.ndarray:
    """A CSV column: int64, float64 (empty fields are NaN), bool, or strings."""
    try:
        return np.array([int(v) for v in values], dtype=np.int64)
    except (ValueError, OverflowError):
        pass
    try:
        return np.array([float(v) if v.strip() else math.nan for v in values], dtype=np.float64)
    except ValueError:
        pass
    lowered = {v.strip().lower() for v in values}
    if lowered and lowered <= {"true", "false"}:
        return np.array([v.strip().lower() == "true" for v in values], dtype=bool)
    return _column(values)


def read_csv(paths: Paths, *, delimiter: str = ",", encoding: str = "utf-8") -> Dataset:
    """A dataset from CSV files with a header row (folders are searched for ``.csv`` files).

    Each column is typed from its values: int64, else float64 (an empty field is NaN), else
    bool (``true``/``false``), else strings. Every file must have the same header.
    """
    header: list[str] | None = None
    values: list[list[str]] = []
    for file in _files(paths, ".csv", "read_csv"):
        with open(file, newline="", encoding=encoding) as f:
            reader = csv.reader(f, delimiter=delimiter)
            names = next(reader, None)
            if names is None:
                raise ValueError(f"`read_csv()`: {file} is empty; it needs a header row.")
            if header is None:
                header, values = names, [[] for _ in names]
                if len(set(names)) != len(names):
                    raise ValueError(f"`read_csv()`: {file} has duplicate column names: {names}.")
            elif names != header:
                raise ValueError(f"`read_csv()`: {file} has the header {names}, but the first file has {header}.")
            for row in reader:
                if not row:
                    continue
                if len(row) != len(header):
                    raise ValueError(
                        f"`read_csv()`: line {reader.line_num} of {file} has {len(row)} fields, "
                        f"the header {len(header)}."
                    )
                for column, value in zip(values, row, strict=True):
                    column.append(value)
    return Dataset._build({name: _typed(column) for name, column in zip(header or [], values, strict=True)})
