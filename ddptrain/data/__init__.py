"""Datasets for training: Ray Data's core API, in memory, shared with local workers.

Build a :class:`Dataset`, pass it to the trainer (``datasets={"train": ds}``), and read each
worker's shard with ``ddptrain.get_dataset_shard("train")``, a :class:`DataIterator`::

    ds = ddptrain.data.from_numpy({"x": features, "y": labels})

    def train_func():
        shard = ddptrain.get_dataset_shard("train")
        for epoch in range(10):
            for batch in shard.iter_torch_batches(batch_size=256):
                loss = loss_fn(model(batch["x"]), batch["y"])

Numeric columns live in shared memory: the driver and its local workers hold one copy of the
data, whatever the number of workers. See docs/datasets.md for splitting,
shuffling and what is released when.
"""

from ddptrain.data._shm import SharedMemoryError
from ddptrain.data.dataset import Dataset, Schema
from ddptrain.data.iterator import DataIterator
from ddptrain.data.read_api import (
    from_items,
    from_numpy,
    from_pandas,
    from_torch,
    range,
    read_csv,
    read_numpy,
)

__all__ = [
    "Dataset",
    "DataIterator",
    "Schema",
    "SharedMemoryError",
    "from_items",
    "from_numpy",
    "from_pandas",
    "from_torch",
    "range",
    "read_csv",
    "read_numpy",
]
