"""``ddptrain.torch`` helpers (prepare_model, prepare_data_loader, devices, reproducibility)
in real worker processes joined over gloo.

Every training function returns what its rank saw; ``result.return_values`` holds those by
rank, and the assertions run in the test process.
"""

from __future__ import annotations

import collections
import copy
import pickle
import random
import warnings
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
)
from torch.utils.data.distributed import DistributedSampler

import ddptrain as train
from ddptrain.torch import (
    TorchTrainer,
    enable_reproducibility,
    get_device,
    get_devices,
    prepare_data_loader,
    prepare_model,
)

N_ITEMS = 10
LR = 0.1

Pair = namedtuple("Pair", ["x", "tag"])


def fit(fn, storage: str, num_workers: int = 2, config: dict | None = None, name: str = "run"):
    trainer = TorchTrainer(
        fn,
        train_loop_config=config,
        scaling_config=train.ScalingConfig(num_workers=num_workers),
        run_config=train.RunConfig(name=name, storage_path=storage),
    )
    result = trainer.fit()
    assert len(result.return_values) == max(num_workers, 1)
    return result.return_values


def values_of(loader) -> list[int]:
    """Every item of a loader over ``TensorDataset(arange)``, in order, as ints."""
    seen = []
    for batch in loader:
        (x,) = batch
        seen.extend(int(v) for v in x.reshape(-1))
    return seen


def make_dataset() -> TensorDataset:
    return TensorDataset(torch.arange(N_ITEMS))


def collate_pairs(items: list) -> Pair:
    """A custom collate_fn: a namedtuple of a stacked tensor and a plain string."""
    return Pair(torch.stack([item[0] for item in items]), "custom")


class Counting(IterableDataset):
    def __iter__(self):
        return iter(range(6))


def record_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = fn()
    return value, [(w.category.__name__, str(w.message)) for w in caught]


# --------------------------------------------------------------------------- prepare_model


def model_train_func() -> dict:
    """Wrapping, strategies, and one DDP step on rank-specific data."""
    rank = train.get_context().get_world_rank()
    out: dict = {"device": str(get_device()), "devices": [str(d) for d in get_devices()]}

    out["ddp_type"] = type(prepare_model(torch.nn.Linear(2, 1))).__name__
    plain = prepare_model(torch.nn.Linear(2, 1), parallel_strategy=None)
    out["none_type"] = type(plain).__name__
    kw = prepare_model(
        torch.nn.Linear(2, 1),
        move_to_device=torch.device("cpu"),
        parallel_strategy_kwargs={"find_unused_parameters": True},
    )
    out["kwargs_type"] = type(kw).__name__
    out["find_unused_parameters"] = kw.find_unused_parameters
    out["inner_type"] = type(kw.module).__name__
    try:
        prepare_model(torch.nn.Linear(2, 1), parallel_strategy="horovod")
        out["invalid"] = None
    except ValueError as exc:
        out["invalid"] = str(exc)

    # Each rank starts from different weights; DDP must broadcast rank 0's.
    torch.manual_seed(100 + rank)
    model = prepare_model(torch.nn.Linear(2, 1))
    out["init"] = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.tensor([[rank + 1.0, 2.0 * rank - 1.0]])
    y = torch.tensor([[3.0 * rank]])
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    out["grads"] = [p.grad.detach().clone() for p in model.parameters()]
    optimizer.step()
    out["after"] = [p.detach().clone() for p in model.parameters()]
    out["param_devices"] = sorted({str(p.device) for p in model.parameters()})
    return out


def local_grads(init: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    """The gradients rank ``rank``'s data alone gives, computed in the test process."""
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(init[0])
        model.bias.copy_(init[1])
    x = torch.tensor([[rank + 1.0, 2.0 * rank - 1.0]])
    y = torch.tensor([[3.0 * rank]])
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [model.weight.grad, model.bias.grad]


def test_prepare_model_with_two_workers(storage: str) -> None:
    values = fit(model_train_func, storage)
    for rank, out in enumerate(values):
        assert out["device"] == "cpu", rank
        assert out["devices"] == ["cpu"], rank
        assert out["ddp_type"] == "DistributedDataParallel"
        assert out["none_type"] == "Linear"
        assert out["kwargs_type"] == "DistributedDataParallel"
        assert out["find_unused_parameters"] is True
        assert out["inner_type"] == "Linear"
        assert out["invalid"] is not None
        assert "horovod" in out["invalid"]
        assert out["param_devices"] == ["cpu"]

    r0, r1 = values
    # Rank 0's initial weights were broadcast to rank 1 although rank 1 seeded differently.
    for a, b in zip(r0["init"], r1["init"]):
        assert torch.equal(a, b)
    # Gradients are the average of both ranks' own gradients, on both ranks...
    own = [local_grads(r0["init"], rank) for rank in range(2)]
    for i in range(2):
        expected = (own[0][i] + own[1][i]) / 2
        assert not torch.allclose(own[0][i], own[1][i])
        assert torch.allclose(r0["grads"][i], expected, atol=1e-6)
        assert torch.allclose(r1["grads"][i], expected, atol=1e-6)
    # ...so after one step the parameters are still identical, and moved by -lr * average.
    for i in range(2):
        assert torch.equal(r0["after"][i], r1["after"][i])
        expected = r0["init"][i] - LR * (own[0][i] + own[1][i]) / 2
        assert torch.allclose(r0["after"][i], expected, atol=1e-6)
        assert not torch.allclose(r0["after"][i], r0["init"][i])


def single_worker_func() -> dict:
    loader = prepare_data_loader(DataLoader(make_dataset(), batch_size=4))
    return {
        "model_type": type(prepare_model(torch.nn.Linear(2, 1))).__name__,
        "sampler": type(loader.sampler).__name__,
        "values": values_of(loader),
        "len": len(loader),
        "device": str(get_device()),
    }


def test_one_worker_is_not_wrapped_or_sharded(storage: str) -> None:
    (out,) = fit(single_worker_func, storage, num_workers=1)
    assert out == {
        "model_type": "Linear",
        "sampler": "SequentialSampler",
        "values": list(range(N_ITEMS)),
        "len": 3,
        "device": "cpu",
    }


def test_local_mode_leaves_model_and_loader_alone(storage: str) -> None:
    (out,) = fit(single_worker_func, storage, num_workers=0)
    assert out["model_type"] == "Linear"
    assert out["sampler"] == "SequentialSampler"
    assert out["values"] == list(range(N_ITEMS))
    assert out["device"] == "cpu"


def test_outside_a_trainer() -> None:
    model = torch.nn.Linear(2, 1)
    assert prepare_model(model) is model
    assert get_device() == torch.device("cpu")
    assert get_devices() == [torch.device("cpu")]
    loader = prepare_data_loader(DataLoader(make_dataset(), batch_size=5))
    assert values_of(loader) == list(range(N_ITEMS))


@pytest.mark.parametrize("strategy", ["horovod", "DDP", ""])
def test_invalid_parallel_strategy_raises(strategy: str) -> None:
    with pytest.raises(ValueError, match="parallel_strategy"):
        prepare_model(torch.nn.Linear(2, 1), parallel_strategy=strategy)


# --------------------------------------------------------------------- prepare_data_loader


def data_train_func() -> dict:
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    device = get_device()
    out: dict = {}

    # A sequential loader: each rank gets its own half, in order, not shuffled.
    seq = prepare_data_loader(DataLoader(make_dataset(), batch_size=2))
    out["seq_sampler"] = type(seq.sampler).__name__
    out["seq_sampler_shuffle"] = seq.sampler.shuffle
    out["seq_sampler_ranks"] = (seq.sampler.num_replicas, seq.sampler.rank)
    out["seq_values"] = values_of(seq)
    out["seq_len"] = len(seq)
    out["seq_batch_size"] = seq.batch_size
    batches = list(seq)
    out["batch_kinds"] = sorted({type(b).__name__ for b in batches})
    out["batch_items"] = sorted({type(t).__name__ for b in batches for t in b})
    out["batch_devices_ok"] = all(t.device == device for b in batches for t in b)

    # A shuffled loader: a shuffling DistributedSampler, reshuffled by set_epoch.
    shuf = prepare_data_loader(DataLoader(make_dataset(), batch_size=2, shuffle=True))
    out["shuf_sampler_shuffle"] = shuf.sampler.shuffle
    epochs = []
    for epoch in range(2):
        shuf.sampler.set_epoch(epoch)
        epochs.append(values_of(shuf))
    out["shuf_epochs"] = epochs

    # batch_size, drop_last and collate_fn are kept (5 items per rank, batches of 3).
    kept = prepare_data_loader(DataLoader(make_dataset(), batch_size=3, drop_last=True, collate_fn=collate_pairs))
    out["kept"] = (kept.batch_size, kept.drop_last, kept.collate_fn is collate_pairs, len(kept))
    pairs = list(kept)
    out["kept_batches"] = [(type(p).__name__, p.x.tolist(), p.tag, p.x.device == device) for p in pairs]
    loose = prepare_data_loader(DataLoader(make_dataset(), batch_size=3, drop_last=False))
    out["loose_len"] = len(loose)
    out["loose_sizes"] = [len(b[0]) for b in loose]

    # DataLoader workers: their settings survive the rebuild.
    with_workers = prepare_data_loader(
        DataLoader(
            make_dataset(),
            batch_size=2,
            num_workers=1,
            prefetch_factor=3,
            persistent_workers=True,
            in_order=False,
        )
    )
    out["workers"] = (
        with_workers.num_workers,
        with_workers.prefetch_factor,
        with_workers.persistent_workers,
        with_workers.in_order,
        type(with_workers.sampler).__name__,
    )
    out["workers_values"] = values_of(with_workers)
    del with_workers

    # No auto-batching (batch_size=None): still one item at a time, still sharded.
    unbatched, out["unbatched_warnings"] = record_warnings(
        lambda: prepare_data_loader(DataLoader(make_dataset(), batch_size=None))
    )
    out["unbatched_values"] = [int(item[0]) for item in unbatched]

    # An IterableDataset cannot be sharded: warned about on rank 0, every rank sees all of it.
    iterable, out["iterable_warnings"] = record_warnings(
        lambda: prepare_data_loader(DataLoader(Counting(), batch_size=2))
    )
    out["iterable_values"] = [int(v) for b in iterable for v in b]

    # An existing DistributedSampler is kept as it is.
    mine = DistributedSampler(make_dataset(), num_replicas=2, rank=1 - rank, shuffle=False)
    existing, out["existing_warnings"] = record_warnings(
        lambda: prepare_data_loader(DataLoader(make_dataset(), batch_size=5, sampler=mine))
    )
    out["existing_same"] = existing.sampler is mine
    out["existing_values"] = values_of(existing)

    # A custom batch_sampler is kept (with a warning): no sharding.
    batch_sampler = BatchSampler(SequentialSampler(range(N_ITEMS)), batch_size=4, drop_last=False)
    custom_batches, out["batch_sampler_warnings"] = record_warnings(
        lambda: prepare_data_loader(DataLoader(make_dataset(), batch_sampler=batch_sampler))
    )
    out["batch_sampler_same"] = custom_batches.batch_sampler is batch_sampler
    out["batch_sampler_values"] = values_of(custom_batches)

    # A custom sampler is replaced by a DistributedSampler (with a warning).
    subset = SubsetRandomSampler(list(range(N_ITEMS)))
    replaced, out["custom_sampler_warnings"] = record_warnings(
        lambda: prepare_data_loader(DataLoader(make_dataset(), batch_size=5, sampler=subset))
    )
    out["custom_sampler"] = (type(replaced.sampler).__name__, replaced.sampler.shuffle)
    out["custom_sampler_values"] = values_of(replaced)

    # Opting out of either step.
    no_sampler = prepare_data_loader(DataLoader(make_dataset(), batch_size=5), add_dist_sampler=False)
    out["no_sampler_values"] = values_of(no_sampler)
    no_move = prepare_data_loader(DataLoader(make_dataset(), batch_size=5), move_to_device=False)
    out["no_move_type"] = type(no_move).__name__
    out["no_move_values"] = values_of(no_move)
    return out


def expected_shuffle(epoch: int, rank: int) -> list[int]:
    """DistributedSampler's order: a permutation seeded with ``seed + epoch``, every 2nd item."""
    g = torch.Generator()
    g.manual_seed(epoch)
    return torch.randperm(N_ITEMS, generator=g).tolist()[rank::2]


def test_prepare_data_loader_with_two_workers(storage: str) -> None:
    values = fit(data_train_func, storage)
    halves = [list(range(N_ITEMS))[rank::2] for rank in range(2)]
    for rank, out in enumerate(values):
        # Sequential: disjoint halves, together everything, in order.
        assert out["seq_sampler"] == "DistributedSampler"
        assert out["seq_sampler_shuffle"] is False
        assert out["seq_sampler_ranks"] == (2, rank)
        assert out["seq_values"] == halves[rank]
        assert out["seq_len"] == 3  # 5 items, batches of 2
        assert out["seq_batch_size"] == 2
        assert out["batch_kinds"] == ["list"]
        assert out["batch_items"] == ["Tensor"]
        assert out["batch_devices_ok"] is True

        # Shuffled: each epoch a new permutation, split between the ranks.
        assert out["shuf_sampler_shuffle"] is True
        assert out["shuf_epochs"] == [expected_shuffle(0, rank), expected_shuffle(1, rank)]

        # batch_size / drop_last / collate_fn.
        assert out["kept"] == (3, True, True, 1)
        assert out["kept_batches"] == [("Pair", halves[rank][:3], "custom", True)]
        assert out["loose_len"] == 2
        assert out["loose_sizes"] == [3, 2]

        assert out["workers"] == (1, 3, True, False, "DistributedSampler")
        assert sorted(out["workers_values"]) == halves[rank]

        assert out["unbatched_warnings"] == []
        assert out["unbatched_values"] == halves[rank]

        # IterableDataset: every rank sees everything; only rank 0 warns.
        assert out["iterable_values"] == list(range(6))
        categories = [category for category, _ in out["iterable_warnings"]]
        if rank == 0:
            assert categories == ["UserWarning"]
            assert "IterableDataset" in out["iterable_warnings"][0][1]
        else:
            assert categories == []

        assert out["existing_same"] is True
        assert out["existing_warnings"] == []
        assert out["existing_values"] == halves[1 - rank]

        assert out["batch_sampler_same"] is True
        assert [c for c, _ in out["batch_sampler_warnings"]] == ["UserWarning"]
        assert out["batch_sampler_values"] == list(range(N_ITEMS))

        assert [c for c, _ in out["custom_sampler_warnings"]] == ["UserWarning"]
        assert "SubsetRandomSampler" in out["custom_sampler_warnings"][0][1]
        assert out["custom_sampler"] == ("DistributedSampler", True)
        assert len(out["custom_sampler_values"]) == N_ITEMS // 2

        assert out["no_sampler_values"] == list(range(N_ITEMS))
        assert out["no_move_type"] == "DataLoader"
        assert out["no_move_values"] == halves[rank]

    # The shuffled halves of one epoch are disjoint and cover the dataset.
    for epoch in range(2):
        first, second = (out["shuf_epochs"][epoch] for out in values)
        assert sorted(first + second) == list(range(N_ITEMS))
    assert values[0]["shuf_epochs"][0] != values[0]["shuf_epochs"][1]
    custom = values[0]["custom_sampler_values"] + values[1]["custom_sampler_values"]
    assert sorted(custom) == list(range(N_ITEMS))


def test_device_loader_moves_nested_batches_and_exposes_loader() -> None:
    """Outside a trainer the wrapper still moves nested batches and forwards attributes."""
    dataset = [{"a": torch.tensor([i]), "b": (torch.tensor(float(i)), "s")} for i in range(4)]
    loader = prepare_data_loader(DataLoader(dataset, batch_size=2))
    batches = list(loader)
    assert len(loader) == 2
    assert loader.batch_size == 2
    assert isinstance(batches[0], dict)
    assert batches[0]["a"].tolist() == [[0], [1]]
    assert isinstance(batches[0]["b"], list)
    assert list(batches[0]["b"][1]) == ["s", "s"]
    assert batches[1]["b"][0].tolist() == [2.0, 3.0]
    # The wrapper survives copy and pickle (which build it without __init__).
    assert [b["a"].tolist() for b in copy.copy(loader)] == [[[0], [1]], [[2], [3]]]
    assert len(pickle.loads(pickle.dumps(loader))) == 2


class _Encoding(collections.UserDict):
    """A batch as transformers' tokenizers and collators give it (``BatchEncoding`` is a ``UserDict``)."""


def test_device_loader_moves_every_mapping_a_collate_function_returns() -> None:
    # The "meta" device stands in for a GPU: a tensor left on the CPU shows.
    from ddptrain.torch.train_loop_utils import _DeviceLoader

    def collate(rows: list) -> _Encoding:
        return _Encoding({"input_ids": torch.stack(rows), "lengths": [len(r) for r in rows]})

    loader = _DeviceLoader(DataLoader([torch.ones(3)] * 4, batch_size=2, collate_fn=collate), torch.device("meta"))
    batch = next(iter(loader))
    assert isinstance(batch, _Encoding)  # the collator's type is kept where it can be rebuilt
    assert batch["input_ids"].device.type == "meta"
    assert batch["lengths"] == [3, 3]
    ordered = _DeviceLoader(
        DataLoader([torch.ones(3)] * 2, batch_size=2, collate_fn=lambda r: OrderedDict(x=r[0])), torch.device("meta")
    )
    assert next(iter(ordered))["x"].device.type == "meta"


# ---------------------------------------------------------------------- reproducibility


def seeded_func(config: dict) -> dict:
    import numpy as np

    enable_reproducibility(config["seed"])
    out = {
        "torch": torch.rand(4).tolist(),
        "random": [random.random() for _ in range(3)],
        "numpy": np.random.rand(3).tolist(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    # The same model initialisation and the same order of a plain shuffled loader on every run.
    out["weights"] = torch.nn.Linear(3, 2).weight.tolist()
    out["order"] = values_of(DataLoader(make_dataset(), batch_size=2, shuffle=True))
    return out


def test_enable_reproducibility_repeats_runs(storage: str) -> None:
    first = fit(seeded_func, storage, config={"seed": 7}, name="first")
    second = fit(seeded_func, storage, config={"seed": 7}, name="second")
    assert first == second
    for out in first:
        assert out["deterministic"] is True
    # Both ranks were seeded the same way.
    assert first[0]["torch"] == first[1]["torch"]
    # And the seed matters: it is torch.manual_seed(seed) underneath.
    torch_state = torch.get_rng_state()
    try:
        torch.manual_seed(7)
        assert first[0]["torch"] == torch.rand(4).tolist()
        torch.manual_seed(8)
        assert first[0]["torch"] != torch.rand(4).tolist()
    finally:
        torch.set_rng_state(torch_state)
