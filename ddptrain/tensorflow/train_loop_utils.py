"""Helpers called inside the training function."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["prepare_dataset_shard"]


def prepare_dataset_shard(tf_dataset_shard: tf.data.Dataset) -> tf.data.Dataset:
    """Prepare this worker's ``tf.data.Dataset`` for ``MultiWorkerMirroredStrategy``.

    The rows are already split across the workers (``get_dataset_shard``), so TensorFlow's
    auto-sharding is turned off: left on, each worker would keep only ``1/num_workers`` of its
    own shard's batches. Batches are also prefetched (``tf.data.AUTOTUNE``).
    ``DataIterator.to_tf`` already turns auto-sharding off; use this on datasets built
    otherwise (e.g. ``tf.data.Dataset.from_tensor_slices`` of the shard's arrays).

    Args:
        tf_dataset_shard: This worker's part of the data.

    Returns:
        The same data with auto-sharding off and prefetching on.

    Example:
        >>> shard = ddptrain.get_dataset_shard("train").materialize().to_numpy()  # doctest: +SKIP
        >>> data = prepare_dataset_shard(tf.data.Dataset.from_tensor_slices(shard).batch(32))
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return tf_dataset_shard.with_options(options).prefetch(tf.data.AUTOTUNE)
