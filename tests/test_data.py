"""ddptrain.data: building datasets, reading shards, and the shared memory behind them.

In-process tests cover the Dataset and DataIterator API; the tests with workers show that
shards are equal and disjoint, that functions given as datasets run again after a restart,
that workers map one copy of the data (smaps figures) and that the memory is gone after a
normal run, a crashed run and a SIGKILLed driver.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ddptrain as train
from ddptrain.data._shm import attach_columns
from ddptrain.data.ingest import DatasetIngest, open_shards

# --- helpers ------------------------------------------------------------------------------


def memfd_name(pid: int) -> str:
    return f"memfd:ddptrain-data-{pid}"


def memfd_holders(pid: int) -> set[int]:
    """Processes that map, or hold a descriptor of, dataset memory made by process ``pid``."""
    name = memfd_name(pid)
    holders = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if name in (entry / "maps").read_text():
                holders.add(int(entry.name))
                continue
            for fd in (entry / "fd").iterdir():
                if name in os.readlink(fd):
                    holders.add(int(entry.name))
                    break
        except OSError:
            continue
    return holders


def own_memfds() -> int:
    """Descriptors of this process that hold dataset memory."""
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            count += memfd_name(os.getpid()) in os.readlink(fd)
        except OSError:
            pass
    return count


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def mapping_figures(marker: str) -> dict[str, int]:
    """kB figures (Rss, Pss, Private_Dirty, Anonymous...) of this process's mappings of ``marker``."""
    totals: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):  # a mapping's header line
            inside = marker in line
        elif inside and head.endswith(":") and line.rstrip().endswith("kB"):
            totals[head[:-1]] = totals.get(head[:-1], 0) + int(line.split()[1])
    return totals


def fit(fn, datasets, num_workers: int, storage: str, **kwargs):
    return train.DataParallelTrainer(
        fn,
        datasets=datasets,
        scaling_config=train.ScalingConfig(num_workers=num_workers),
        run_config=train.RunConfig(storage_path=storage, **kwargs.pop("run", {})),
        **kwargs,
    ).fit()


# --- building datasets --------------------------------------------------------------------


def test_from_items_follows_rays_row_model() -> None:
    ds = train.data.from_items([1, 2, 3])
    assert ds.count() == 3
    assert ds.columns() == ["item"]
    assert ds.take(2) == [{"item": 1}, {"item": 2}]
    assert repr(ds) == "Dataset(num_rows=3, schema={item: int64})"

    rows = train.data.from_items([{"x": [1.0, 2.0], "name": "a"}, {"x": [3.0, 4.0], "extra": 5}])
    assert rows.columns() == ["x", "name", "extra"]
    first, second = rows.take_all()
    assert first["x"].tolist() == [1.0, 2.0] and first["name"] == "a" and first["extra"] is None
    assert second["name"] is None and second["extra"] == 5
    schema = rows.schema()
    assert schema.names == ["x", "name", "extra"]
    assert schema.types[0] == np.float64 and schema.shapes[0] == (2,)
    assert str(schema).splitlines() == [
        "Column  Type",
        "------  ----",
        "x       numpy.ndarray(shape=(2,), dtype=float64)",
        "name    object",
        "extra   object",
    ]
    ragged = train.data.from_items([{"seq": [1, 2]}, {"seq": [3]}])
    assert ragged.schema().types == [np.dtype(object)] and ragged.take(2)[1] == {"seq": [3]}
    assert train.data.from_items([]).count() == 0
    assert train.data.from_items([{}, {}]).take() == [{}, {}]


def test_range_and_from_numpy() -> None:
    assert train.data.range(4).take() == [{"id": i} for i in range(4)]
    assert train.data.range(4).schema().types == [np.dtype(np.int64)]

    data = np.arange(12, dtype=np.float32).reshape(6, 2)
    ds = train.data.from_numpy(data)
    assert ds.columns() == ["data"] and ds.count() == 6
    data[0, 0] = 100  # the dataset holds its own copy
    assert ds.take(1)[0]["data"].tolist() == [0.0, 1.0]
    parts = train.data.from_numpy([np.zeros((2, 3)), np.ones((4, 3))])
    assert parts.count() == 6 and parts.take_batch(6)["data"].sum() == 12
    columns = train.data.from_numpy(
        {"x": np.zeros((5, 3), np.float32), "y": np.arange(5), "s": np.array(list("abcde"))}
    )
    assert columns.columns() == ["x", "y", "s"]
    assert columns.take(1) == [{"x": pytest.approx(np.zeros(3)), "y": 0, "s": "a"}]


def test_from_pandas_and_from_torch() -> None:
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"a": [1, 2, 3], "b": [0.5, 1.5, 2.5], "c": ["x", "y", "z"]}, index=[7, 8, 9])
    ds = train.data.from_pandas([frame, frame])
    assert ds.count() == 6 and ds.columns() == ["a", "b", "c"]
    assert ds.take(1) == [{"a": 1, "b": 0.5, "c": "x"}]
    back = ds.to_pandas()
    assert list(back["c"]) == ["x", "y", "z"] * 2 and list(back.index) == list(range(6))

    samples = torch.utils.data.TensorDataset(torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 0]))
    pairs = train.data.from_torch(samples)
    assert pairs.columns() == ["item"] and pairs.schema().types == [np.dtype(object)]
    batch = next(iter(pairs.iter_torch_batches(batch_size=3)))
    features, labels = batch["item"]  # tuples are collated as torch's DataLoader would
    assert features.shape == (3, 2) and labels.tolist() == [0, 1, 0]
    tensors = train.data.from_torch([torch.full((2,), float(i)) for i in range(4)])
    assert tensors.schema().types == [np.dtype(np.float32)] and tensors.schema().shapes == [(2,)]


def test_read_numpy_and_read_csv(tmp_path: Path) -> None:
    folder = tmp_path / "arrays"
    folder.mkdir()
    np.save(folder / "a.npy", np.arange(6, dtype=np.int32).reshape(3, 2))
    np.save(folder / "b.npy", np.arange(6, 10, dtype=np.int32).reshape(2, 2))
    ds = train.data.read_numpy(folder)
    assert ds.count() == 5 and ds.take_batch(5)["data"].ravel().tolist() == list(range(10))
    np.save(tmp_path / "other.npy", np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="all parts of a column must match"):
        train.data.read_numpy([folder / "a.npy", tmp_path / "other.npy"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train.data.read_numpy(tmp_path / "missing.npy")

    (tmp_path / "a.csv").write_text("id,score,label,ok\n1,0.5,cat,true\n2,,dog,false\n")
    (tmp_path / "b.csv").write_text("id,score,label,ok\n3,2.5,,True\n")
    table = train.data.read_csv([tmp_path / "a.csv", tmp_path / "b.csv"])
    assert [str(t) for t in table.schema().types] == ["int64", "float64", "object", "bool"]
    rows = table.take_all()
    assert rows[0] == {"id": 1, "score": 0.5, "label": "cat", "ok": True}
    assert np.isnan(rows[1]["score"]) and rows[2]["label"] == ""
    (tmp_path / "bad.csv").write_text("id,score\n1,2,3\n")
    with pytest.raises(ValueError, match="line 2 of .*bad.csv has 3 fields, the header 2"):
        train.data.read_csv(tmp_path / "bad.csv")
    (tmp_path / "other.csv").write_text("id,value\n1,2\n")
    with pytest.raises(ValueError, match="has the header"):
        train.data.read_csv([tmp_path / "a.csv", tmp_path / "other.csv"])


def test_dataset_transformations() -> None:
    ds = train.data.range(10)
    shuffled = ds.random_shuffle(seed=3)
    ids = [r["id"] for r in shuffled.take_all()]
    assert sorted(ids) == list(range(10)) and ids != list(range(10))
    assert ids == [r["id"] for r in ds.random_shuffle(seed=3).take_all()]
    assert [s.count() for s in ds.split(3)] == [4, 3, 3]
    assert [s.take_all() for s in ds.split(3, equal=True)] == [
        [{"id": 0}, {"id": 1}, {"id": 2}],
        [{"id": 3}, {"id": 4}, {"id": 5}],
        [{"id": 6}, {"id": 7}, {"id": 8}],
    ]
    assert [s.count() for s in ds.split_at_indices([2, 5])] == [2, 3, 5]
    train_part, test_part = ds.train_test_split(0.3)
    assert (train_part.count(), test_part.take(1)) == (7, [{"id": 7}])
    assert ds.limit(2).take_all() == [{"id": 0}, {"id": 1}]
    both = train.data.from_numpy({"a": np.arange(3), "b": np.arange(3) * 2})
    assert both.select_columns(["b"]).take(1) == [{"b": 0}]
    assert ds.materialize() is ds and ds.size_bytes() == 80
    copy = pickle.loads(pickle.dumps(shuffled))
    assert copy.take_all() == shuffled.take_all()
    with pytest.raises(ValueError, match="more than `limit=5`"):
        ds.take_all(limit=5)


def test_bad_input_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="takes a list of items"):
        train.data.from_items("abc")
    with pytest.raises(ValueError, match="mix of dicts and other values"):
        train.data.from_items([{"a": 1}, 2])
    with pytest.raises(ValueError, match="same number of rows"):
        train.data.from_numpy({"x": np.zeros(3), "y": np.zeros(4)})
    with pytest.raises(ValueError, match="takes a numpy array"):
        train.data.from_numpy(5)
    with pytest.raises(ValueError, match="scalar"):
        train.data.from_numpy({"x": np.float32(1)})
    with pytest.raises(ValueError, match="`n` must be >= 0, got -1"):
        train.data.range(-1)
    with pytest.raises(ValueError, match="`n` must be >= 1"):
        train.data.range(3).split(0)
    with pytest.raises(ValueError, match="Unknown column"):
        train.data.range(3).select_columns(["nope"])
    it = train.data.range(10).iterator()
    with pytest.raises(ValueError, match="`batch_size` must be >= 1, got 0"):
        it.iter_batches(batch_size=0)
    with pytest.raises(ValueError, match="`batch_size` must be an integer"):
        it.iter_batches(batch_size="8")
    with pytest.raises(ValueError, match="needs a `batch_size`"):
        it.iter_batches(batch_size=None, local_shuffle_buffer_size=4)
    with pytest.raises(ValueError, match="`prefetch_batches` must be >= 0"):
        it.iter_batches(prefetch_batches=-1)
    with pytest.raises(ValueError, match="`batch_format` must be one of"):
        it.iter_batches(batch_format="arrow")
    with pytest.raises(ValueError, match="cannot be combined with `dtypes`"):
        it.iter_torch_batches(collate_fn=lambda b: b, dtypes=torch.float32)
    with pytest.raises(ValueError, match=r"`dtypes` names unknown column\(s\) \['x'\]"):
        it.iter_torch_batches(dtypes={"x": torch.float32})
    with pytest.raises(ValueError, match="`device` must be"):
        it.iter_torch_batches(device=object())
    with pytest.raises(ValueError, match="`label_column` 'y' is not a column"):
        it.to_torch(label_column="y")


def test_trainer_refuses_bad_datasets_before_starting(storage: str) -> None:
    with pytest.raises(train.ConfigError, match=r"`datasets\['train'\]` must be a ddptrain.data.Dataset"):
        train.DataParallelTrainer(lambda: None, datasets={"train": 42})
    with pytest.raises(train.ConfigError, match=r"names \['valid'\], which the trainer was not given"):
        train.DataParallelTrainer(
            lambda: None,
            datasets={"train": train.data.range(3)},
            dataset_config=train.DataConfig(datasets_to_split=["valid"]),
        )
    with pytest.raises(train.ConfigError, match="must be a ddptrain.data.Dataset .* got int"):
        fit(lambda: None, {"train": lambda: 42}, 1, storage)


# --- iterating ----------------------------------------------------------------------------


def test_iter_batches_options() -> None:
    it = train.data.range(10).iterator()
    assert [b["id"].tolist() for b in it.iter_batches(batch_size=4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [len(b["id"]) for b in it.iter_batches(batch_size=4, drop_last=True)] == [4, 4]
    assert [len(b["id"]) for b in it.iter_batches(batch_size=None)] == [10]
    assert isinstance(next(iter(it.iter_batches(batch_format="numpy")))["id"], np.ndarray)
    frame = next(iter(it.iter_batches(batch_size=3, batch_format="pandas")))
    assert list(frame["id"]) == [0, 1, 2]
    batches = it.iter_batches(batch_size=5)
    assert [len(list(batches)) for _ in range(3)] == [2, 2, 2]  # a new pass per epoch
    assert [r["id"] for r in it.iter_rows()] == list(range(10))
    assert it.count() == 10 and it.materialize().count() == 10 and it.schema().names == ["id"]


def test_local_shuffle_per_epoch() -> None:
    it = train.data.range(1000).iterator()

    def order(**kwargs) -> list[int]:
        return [i for b in it.iter_batches(batch_size=10, local_shuffle_buffer_size=50, **kwargs) for i in b["id"]]

    first, again = order(local_shuffle_seed=1), order(local_shuffle_seed=1)
    assert sorted(first) == list(range(1000)) and first != list(range(1000))
    assert first == again  # a fixed seed gives the same order every pass, as in Ray
    assert order(local_shuffle_seed=2) != first  # seed + epoch: a new, reproducible order
    assert order() != order()  # no seed: a new order every pass
    assert max(first[:10]) < 60  # batches come from a local buffer of about 50 rows
    assert order(local_shuffle_seed=1, prefetch_batches=0) == first
    drop = [len(b["id"]) for b in it.iter_batches(batch_size=300, local_shuffle_buffer_size=50, drop_last=True)]
    assert drop == [300, 300, 300]
    whole = [i for b in it.iter_batches(batch_size=100, local_shuffle_buffer_size=1000) for i in b["id"]]
    assert sorted(whole) == list(range(1000)) and max(whole[:100]) > 900  # a buffer as big as the shard


def test_prefetch_thread_stops_when_the_loop_ends_early() -> None:
    it = train.data.range(100_000).iterator()
    before = threading.active_count()
    for i, _ in enumerate(it.iter_batches(batch_size=10, local_shuffle_buffer_size=100, prefetch_batches=4)):
        if i == 3:
            break
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before

    def broken(batch):
        raise KeyError("bad batch")

    with pytest.raises(KeyError, match="bad batch"):  # raised in the thread, seen in the loop
        list(it.iter_torch_batches(batch_size=10, collate_fn=broken, prefetch_batches=2))


def test_iter_torch_batches_options() -> None:
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    ds = train.data.from_numpy({"x": x, "y": np.arange(10), "name": np.array([f"n{i}" for i in range(10)])})
    batch = next(iter(ds.iter_torch_batches(batch_size=4)))
    assert batch["x"].dtype == torch.float32 and batch["x"].shape == (4, 2) and batch["x"].device.type == "cpu"
    assert batch["y"].tolist() == [0, 1, 2, 3] and batch["name"] == ["n0", "n1", "n2", "n3"]
    numeric = ds.select_columns(["x", "y"])
    views = next(iter(numeric.iter_torch_batches(batch_size=4)))
    assert views["x"].data_ptr() == numeric._columns["x"].__array_interface__["data"][0]  # zero-copy
    cast = next(iter(ds.iter_torch_batches(batch_size=4, dtypes={"y": torch.float16})))
    assert cast["y"].dtype == torch.float16 and cast["x"].dtype == torch.float32
    every = next(iter(numeric.iter_torch_batches(batch_size=4, dtypes=torch.float64)))
    assert every["x"].dtype == every["y"].dtype == torch.float64
    pairs = list(numeric.iter_torch_batches(batch_size=4, collate_fn=lambda b: (torch.as_tensor(b["x"]), b["y"])))
    assert len(pairs) == 3 and pairs[0][0].shape == (4, 2) and isinstance(pairs[0][1], np.ndarray)
    assert [len(b["y"]) for b in ds.iter_torch_batches(batch_size=4, drop_last=True)] == [4, 4]
    on_cpu = next(iter(ds.iter_torch_batches(batch_size=4, device="cpu", pin_memory=True)))
    assert on_cpu["x"].device.type == "cpu"
    shuffled = [i for b in ds.iter_torch_batches(batch_size=3, local_shuffle_buffer_size=10) for i in b["y"].tolist()]
    assert sorted(shuffled) == list(range(10))
    ragged = train.data.from_items([{"seq": [1, 2]}, {"seq": [3]}])
    with pytest.raises(ValueError, match="Column 'seq' cannot be made into a tensor batch"):
        next(iter(ragged.iter_torch_batches()))


def test_to_torch_and_stats() -> None:
    ds = train.data.from_numpy({"a": np.arange(6.0), "b": np.ones(6), "label": np.arange(6) % 2})
    it = ds.iterator()
    features, label = next(iter(it.to_torch(label_column="label", batch_size=4)))
    assert features.shape == (4, 2) and label.shape == (4, 1)
    grouped, flat = next(
        iter(
            it.to_torch(
                label_column="label",
                feature_columns={"f": ["a"]},
                batch_size=2,
                unsqueeze_label_tensor=False,
                feature_column_dtypes=torch.float32,
            )
        )
    )
    assert grouped["f"].shape == (2, 1) and grouped["f"].dtype == torch.float32 and flat.shape == (2,)
    only, none = next(iter(it.to_torch(feature_columns=[["a"], ["b"]], batch_size=3)))
    assert [t.shape for t in only] == [(3, 1), (3, 1)] and none is None
    loader = torch.utils.data.DataLoader(it.to_torch(label_column="label", batch_size=3), batch_size=None)
    assert len(list(loader)) == 2
    report = it.stats()
    assert "6 rows" in report and "passes started: 4" in report and "time waiting for batches" in report
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:  # to_tf itself is tested in test_tensorflow.py
        with pytest.raises(ImportError, match=r"ddptrain\[tensorflow\]"):
            it.to_tf("a", "label")


# --- shards for workers -------------------------------------------------------------------


def test_shard_specs_carry_references_not_data() -> None:
    big = train.data.from_numpy({"x": np.ones((1 << 18, 8), np.float32), "tag": np.array(["t"] * (1 << 18), object)})
    ingest = DatasetIngest({"train": big, "valid": train.data.range(1 << 16)}, train.DataConfig(["train"]), 4)
    specs = ingest.shards()
    assert [specs[r]["train"].num_rows for r in range(4)] == [1 << 16] * 4
    assert specs[0]["valid"] is specs[3]["valid"]  # not split: one spec for every rank
    assert set(specs[1]["train"].shared) == {"x"}  # the number column is a reference...
    sizes = [len(pickle.dumps(specs[r])) for r in range(4)]
    assert max(sizes) < 200_000  # ...while 8 MB of numbers are behind it; the strings are pickled
    assert len(pickle.loads(specs[2]["train"].inline)["tag"]) == 1 << 16  # this rank's rows only
    opened = open_shards(pickle.loads(pickle.dumps(specs[1])))  # as a worker on this host does
    assert opened["train"].count() == 1 << 16 and opened["valid"].count() == 1 << 16
    assert "shard 1 of 4" in repr(opened["train"]) and "not split" in repr(opened["valid"])
    # A worker on another host gets the values themselves: it cannot map the driver's memory.
    remote = ingest.shards(remote_ranks={3})[3]["train"]
    assert remote.shared == {} and pickle.loads(remote.inline)["x"].shape == (1 << 16, 8)
    elsewhere = dataclasses.replace(specs[0]["train"].shared["x"].buffer, host="another-host")
    with pytest.raises(train.data.SharedMemoryError, match="only workers on the driver's host"):
        attach_columns({"x": dataclasses.replace(specs[0]["train"].shared["x"], buffer=elsewhere)})
    ingest.release()
    # The payload every worker receives holds the function, not the data.
    assert len(train.DataParallelTrainer(lambda: None, datasets={"train": big})._payload()) < 10_000


def test_trainer_converts_plain_values_to_datasets() -> None:
    pairs = torch.utils.data.TensorDataset(torch.zeros(3, 2), torch.ones(3))
    values = {"items": [1, 2], "array": np.zeros((4, 2)), "torch": pairs, "made": lambda: [{"a": 1}]}
    ingest = DatasetIngest(values, train.DataConfig(), 1)
    opened = ingest.local_iterators()
    assert {name: it.count() for name, it in opened.items()} == {"items": 2, "array": 4, "torch": 3, "made": 1}
    assert opened["made"].schema().names == ["a"] and opened["array"].schema().names == ["data"]
    ingest.release()


def local_mode_loop() -> list[int]:
    shard = train.get_dataset_shard("train")
    assert shard.count() == 5
    return [int(i) for b in shard.iter_torch_batches(batch_size=2) for i in b["id"]]


def test_local_mode_gets_the_whole_dataset(storage: str) -> None:
    result = fit(local_mode_loop, {"train": lambda: train.data.range(5)}, 0, storage)
    assert result.return_value == [0, 1, 2, 3, 4]


def read_my_shard(config: dict) -> dict:
    ctx = train.get_context()
    shard = train.get_dataset_shard("train")
    epochs = [
        [int(i) for b in shard.iter_torch_batches(batch_size=2, local_shuffle_buffer_size=4) for i in b["id"]]
        for _ in range(2)
    ]
    first = next(iter(shard.iter_torch_batches(batch_size=2)))
    valid = train.get_dataset_shard("valid")
    return {
        "rank": ctx.get_world_rank(),
        "epochs": epochs,
        "valid": [r["id"] for r in valid.iter_rows()],
        "device": str(first["id"].device),
        "stats": shard.stats(),
        "pid": os.getpid(),
    }


@pytest.mark.timeout(120)
def test_split_shards_are_equal_and_disjoint(storage: str) -> None:
    before_shm, before_fds = shm_entries(), own_memfds()
    result = fit(
        read_my_shard,
        {"train": train.data.range(11), "valid": lambda: train.data.range(4)},
        3,
        storage,
        dataset_config=train.DataConfig(datasets_to_split=["train"]),
    )
    shards = [sorted(r["epochs"][0]) for r in result.return_values]
    assert shards == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # equal shards; rows 9 and 10 are left out
    for r in result.return_values:
        assert sorted(r["epochs"][1]) == sorted(r["epochs"][0])  # every epoch reads the same shard
        assert r["valid"] == [0, 1, 2, 3]  # not split: every worker reads all of it
        assert r["device"] == "cpu"  # device="auto" on a CPU worker
        assert f"shard {r['rank']} of 3" in r["stats"] and "passes started: 3" in r["stats"]
    # Nothing in /dev/shm, no worker left holding the memory, and the dataset built by the
    # function was released in the driver.
    gc.collect()
    assert shm_entries() == before_shm
    assert memfd_holders(os.getpid()) <= {os.getpid()}
    assert own_memfds() <= before_fds + 1  # the "train" dataset is still alive here


def restart_once(config: dict) -> list[int]:
    shard = train.get_dataset_shard("train")
    ids = [int(i) for b in shard.iter_batches(batch_size=100) for i in b["id"]]
    marker = Path(config["dir"], "crashed")
    if train.get_context().get_world_rank() == 1 and not marker.exists():
        marker.write_text("once")
        os.kill(os.getpid(), signal.SIGKILL)
    train.collective.barrier()
    return ids


class CountingBuilder:
    """A dataset function that builds a bigger dataset each time it is called."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self) -> train.data.Dataset:
        calls = int(self.path.read_text()) + 1 if self.path.exists() else 1
        self.path.write_text(str(calls))
        return train.data.range(10 * calls)


@pytest.mark.timeout(120)
def test_dataset_function_runs_again_at_each_restart(storage: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    before_shm, before_fds = shm_entries(), own_memfds()
    result = fit(
        restart_once,
        {"train": CountingBuilder(calls)},
        2,
        storage,
        train_loop_config={"dir": str(tmp_path)},
        run={"failure_config": train.FailureConfig(max_failures=1)},
    )
    assert calls.read_text() == "2"  # once per start of the group
    assert result.return_values == [list(range(0, 10)), list(range(10, 20))]  # the second build: 20 rows
    gc.collect()
    assert shm_entries() == before_shm
    assert memfd_holders(os.getpid()) <= {os.getpid()}
    assert own_memfds() <= before_fds  # both builds were released


def crash_after_reading() -> None:
    for _ in train.get_dataset_shard("train").iter_batches():
        pass
    raise RuntimeError("crashed after reading")


@pytest.mark.timeout(120)
def test_memory_is_released_after_a_crashed_run(storage: str) -> None:
    before_shm, before_fds = shm_entries(), own_memfds()
    with pytest.raises(train.TrainingFailedError, match="crashed after reading"):
        fit(crash_after_reading, {"train": lambda: train.data.range(1000)}, 2, storage)
    gc.collect()
    assert shm_entries() == before_shm
    assert memfd_holders(os.getpid()) <= {os.getpid()}
    assert own_memfds() <= before_fds


def measure_sharing(config: dict) -> dict:
    rank = train.get_context().get_world_rank()
    shard = train.get_dataset_shard("train")
    total = sum(float(b["data"].sum()) for b in shard.iter_torch_batches(batch_size=4096))
    train.collective.barrier()  # every worker has read every page
    figures = mapping_figures("memfd:ddptrain-data")
    train.collective.barrier()
    # An in-place change to a batch is this worker's own (copy-on-write) ...
    if rank == 0:
        next(iter(shard.iter_torch_batches(batch_size=4)))["data"].add_(1)
    train.collective.barrier()
    first = next(iter(shard.iter_batches(batch_size=1)))["data"][0, 0]
    return {"figures": figures, "total": total, "first": float(first), "shm": sorted(os.listdir("/dev/shm"))}


@pytest.mark.timeout(120)
def test_workers_map_one_copy_of_the_data(storage: str) -> None:
    rows = 1 << 20
    ds = train.data.from_numpy(np.ones((rows, 8), np.float32))  # 32 MiB
    size_kb = ds.size_bytes() // 1024
    before_shm = shm_entries()
    result = fit(measure_sharing, {"train": ds}, 2, storage, dataset_config=train.DataConfig(datasets_to_split=[]))
    for value in result.return_values:
        figures = value["figures"]
        assert value["total"] == rows * 8
        assert figures["Rss"] >= 0.95 * size_kb  # each worker has all 32 MiB mapped and read...
        assert figures["Pss"] <= 0.55 * size_kb  # ...but holds half of one copy (two sharers)
        assert figures.get("Anonymous", 0) == 0 and figures.get("Private_Dirty", 0) == 0
        assert set(value["shm"]) == before_shm  # nothing was created in /dev/shm
    assert [v["first"] for v in result.return_values] == [2.0, 1.0]  # rank 0's change stayed its own
    assert ds.take(1)[0]["data"][0] == 1.0  # and the driver's dataset never changed


DRIVER_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import ddptrain as train

    def hold(config):
        for _ in train.get_dataset_shard("train").iter_batches(batch_size=None):
            pass
        print("worker up", flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        ds = train.data.from_numpy(np.ones((1 << 20, 4), np.float32))
        train.DataParallelTrainer(
            hold,
            datasets={"train": ds},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="killed", storage_path=sys.argv[1]),
        ).fit()
    """
)


def sum_train(config: dict) -> float:
    return float(sum(b["id"].sum() for b in train.get_dataset_shard("train").iter_batches()))


@pytest.mark.timeout(120)
def test_memory_is_released_when_the_driver_is_killed(tmp_path: Path, storage: str) -> None:
    before_shm = shm_entries()
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), storage], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        seen = 0
        for line in proc.stdout:
            seen += "worker up" in line
            if seen == 2:
                break
        holders = memfd_holders(proc.pid)
        assert len(holders - {proc.pid}) >= 2  # both workers map the driver's dataset memory
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    while memfd_holders(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert memfd_holders(proc.pid) == set()  # no process holds it: the kernel has freed it
    assert shm_entries() == before_shm  # and nothing was ever left in /dev/shm
    # The next run starts with nothing to clean up.
    result = fit(sum_train, {"train": train.data.range(100)}, 2, storage)
    assert sum(result.return_values) == sum(range(100))


def batches_on_the_gpu() -> dict:
    shard = train.get_dataset_shard("train")
    auto = next(iter(shard.iter_torch_batches(batch_size=4)))
    pinned = next(iter(shard.iter_torch_batches(batch_size=4, pin_memory=True, local_shuffle_buffer_size=8)))
    collated = next(iter(shard.iter_torch_batches(batch_size=4, collate_fn=lambda b: torch.as_tensor(b["x"]))))
    return {"auto": str(auto["x"].device), "pinned": str(pinned["x"].device), "collated": str(collated.device)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batches_go_to_the_workers_gpu(storage: str) -> None:
    from ddptrain.torch import TorchTrainer

    result = TorchTrainer(
        batches_on_the_gpu,
        datasets={"train": train.data.from_numpy({"x": np.ones((16, 3), np.float32)})},
        scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    # device="auto" is the worker's GPU; with a collate_fn, "auto" leaves the batch where it is.
    assert result.return_value == {"auto": "cuda:0", "pinned": "cuda:0", "collated": "cpu"}


def batches_on_plain_cuda() -> dict:
    from ddptrain.torch import get_device

    shard = train.get_dataset_shard("train")
    # A shuffle buffer: the batches are made, and moved, in the prefetch thread.
    batch = next(iter(shard.iter_torch_batches(batch_size=2, device="cuda", local_shuffle_buffer_size=4)))
    return {"batch": str(batch["x"].device), "worker": str(get_device())}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_batches_for_plain_cuda_go_to_each_workers_own_gpu(storage: str) -> None:
    from ddptrain.torch import TorchTrainer

    result = TorchTrainer(
        batches_on_plain_cuda,
        datasets={"train": train.data.from_numpy({"x": np.ones((16, 3), np.float32)})},
        scaling_config=train.ScalingConfig(num_workers=2, use_gpu=True),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_values == [{"batch": "cuda:0", "worker": "cuda:0"}, {"batch": "cuda:1", "worker": "cuda:1"}]


# --- zip (Ray's ingest examples zip features and labels) ---------------------------------------
def test_zip_puts_columns_side_by_side_like_ray() -> None:
    ids = train.data.range(4)
    zipped = ids.zip(train.data.range(4), train.data.from_items([{"id": str(i), "y": i * 10} for i in range(4)]))
    # Ray's names for duplicates: the first free suffix _1, _2, ...
    assert zipped.columns() == ["id", "id_1", "id_2", "y"]
    assert zipped.take(2) == [{"id": 0, "id_1": 0, "id_2": "0", "y": 0}, {"id": 1, "id_1": 1, "id_2": "1", "y": 10}]
    assert ids.columns() == ["id"]  # the inputs are unchanged
    assert ids.zip(ids).zip(ids).columns() == ["id", "id_1", "id_2"]
    with pytest.raises(ValueError, match="different numbers of rows: 4 and 3"):
        ids.zip(train.data.range(3))


def read_zipped_shard() -> list:
    shard = train.get_dataset_shard("train")
    return [(int(b["x"][0, 0]), int(b["label"][0])) for b in shard.iter_batches(batch_size=1)]


def test_zipped_features_and_labels_reach_the_workers(storage: str) -> None:
    features = train.data.from_numpy({"x": np.arange(8, dtype=np.float32).reshape(4, 2)})
    labels = train.data.from_numpy({"label": np.array([10, 11, 12, 13])})
    result = fit(read_zipped_shard, {"train": features.zip(labels)}, 2, storage)
    assert result.return_values == [[(0, 10), (2, 11)], [(4, 12), (6, 13)]]
