"""``DataIterator.to_tf``'s conversion: a shard's batches as a ``tf.data.Dataset`` (TensorFlow
is imported by the caller, only when ``to_tf`` is used)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ddptrain.data._rows import Schema

__all__ = ["tf_dataset"]

Columns = str | list[str]


def tf_dataset(
    tf: Any,
    schema: Schema,
    data: dict[str, np.ndarray],
    batches: Iterable[dict[str, np.ndarray]],
    groups: list[tuple[Columns, Any]],
) -> Any:
    """A ``tf.data.Dataset`` yielding one element per batch: a tuple with, per group of
    ``groups`` (``(columns, type_spec or None)``), one tensor for a column name or a dict of
    tensors for a list of names. Auto-sharding is off (the rows are already a shard).

    Raises:
        ValueError: A column does not exist, or holds Python objects other than strings and
            no type spec was given for it.
    """
    kinds = {name: (dtype, shape) for name, dtype, shape in zip(schema.names, schema.types, schema.shapes, strict=True)}

    def spec_of(name: str) -> Any:
        if name not in kinds:
            raise ValueError(
                f"`to_tf` was given the column {name!r}, which the dataset does not have; "
                f"its columns are {schema.names}."
            )
        dtype, shape = kinds[name]
        if dtype.kind in "OSU":
            values = data[name][:1]
            if dtype.kind == "O" and not all(isinstance(v, (str, bytes)) for v in values):
                raise ValueError(
                    f"`to_tf`: column {name!r} holds {type(values[0]).__name__} objects, which have "
                    "no TensorFlow dtype; pass a `tf.TypeSpec` for it (e.g. `feature_type_spec=`)."
                )
            return tf.TensorSpec(shape=(None, *shape), dtype=tf.string)
        return tf.TensorSpec(shape=(None, *shape), dtype=tf.as_dtype(dtype))

    def specs(names: Columns, given: Any) -> Any:
        for name in [names] if isinstance(names, str) else names:
            spec_of(name)  # every column must exist, even with a given spec
        if given is not None:
            return given
        return spec_of(names) if isinstance(names, str) else {name: spec_of(name) for name in names}

    signature = tuple(specs(names, given) for names, given in groups)

    def values(batch: dict[str, np.ndarray], name: str) -> np.ndarray:
        column = batch[name]
        if column.dtype.kind in "OU":  # str to UTF-8 bytes, which tf.string holds
            encoded = [v.encode() if isinstance(v, str) else v for v in column.ravel().tolist()]
            return np.array(encoded, dtype=object).reshape(column.shape)
        return column

    def generate() -> Iterator[tuple[Any, ...]]:
        for batch in batches:
            yield tuple(
                values(batch, names) if isinstance(names, str) else {n: values(batch, n) for n in names}
                for names, _ in groups
            )

    dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options)
