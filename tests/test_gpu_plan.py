"""GPU planning without a GPU: which GPU each worker is given, how many workers a host's GPUs
hold, and what the driver asks CUDA (never anything that starts it).

These run on every machine: the planning functions are pure, and where the planning asks
torch how many GPUs this machine has, ``torch.cuda.device_count`` is replaced (only here, in
unit tests of the plan; tests/test_gpu.py runs the real thing on a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

import ddptrain as train
from ddptrain.driver.plan import Plan
from ddptrain.errors import ConfigError
from ddptrain.launch.hosts import HostSpec, gpus_needed, slots_for_gpus
from ddptrain.launch.ssh import gpu_slots


def _gpu_scaling(num_workers: int | tuple[int, int], gpus: float, **kwargs: object) -> train.ScalingConfig:
    return train.ScalingConfig(num_workers=num_workers, use_gpu=True, resources_per_worker={"GPU": gpus}, **kwargs)


@pytest.fixture
def two_gpus_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine has 2 GPUs, as far as the plan asks (NVML's count: it starts no CUDA)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_a_fraction_of_a_gpu_never_spans_two_gpus() -> None:
    # As in Ray, a worker's share of a GPU lies on one GPU: at 0.4 each, a GPU holds 2 workers
    # (0.8), and the third goes to the next GPU rather than taking 0.4 more of the first.
    assert slots_for_gpus(2, 0.4) == 4
    assert gpus_needed(5, 0.4) == 3
    assert slots_for_gpus(1, 0.1) == 10 and gpus_needed(10, 0.1) == 1
    assert slots_for_gpus(3, 1 / 3) == 9 and gpus_needed(9, 1 / 3) == 3
    assert slots_for_gpus(4, 2) == 2 and gpus_needed(3, 2) == 6
    plan = Plan(_gpu_scaling(5, 0.4))
    assert [plan.local_devices(local_rank) for local_rank in range(5)] == [(0,), (0,), (1,), (1,), (2,)]
    assert [spec.devices for spec in plan.worker_specs(0, "127.0.0.1", 1)] == [(0,), (0,), (1,), (1,), (2,)]


def test_a_host_list_holds_only_whole_shares_of_its_gpus() -> None:
    assert gpu_slots([HostSpec("box", gpus=(0, 1))], 0.4)[0].slots == 4
    with pytest.raises(ConfigError, match=r"need 3 GPU\(s\), but its `gpus` lists 2"):
        gpu_slots([HostSpec("box", slots=5, gpus=(0, 1))], 0.4)
    with pytest.raises(ConfigError, match=r"`num_workers=5` needs 5 slots, but the hosts have 4 \(box=4\)"):
        Plan(_gpu_scaling(5, 0.4, hosts=["box gpus=0,1"]))


def test_more_fractional_workers_than_this_machine_holds_is_a_clear_error(two_gpus_here: None) -> None:
    Plan(_gpu_scaling(4, 0.4)).check_gpus()  # 2 per GPU
    with pytest.raises(ConfigError, match=r"asks for 3 GPU\(s\) on this machine \(5 workers at 0.4.*torch sees 2"):
        Plan(_gpu_scaling(5, 0.4)).check_gpus()


def test_the_gpus_of_the_runs_cuda_visible_devices_are_counted_not_the_machines(two_gpus_here: None) -> None:
    # CUDA_VISIBLE_DEVICES in the run's env vars is what the workers see: 1 GPU of this machine's 2.
    one = {"CUDA_VISIBLE_DEVICES": "1"}
    with pytest.raises(
        ConfigError, match=r"asks for 2 GPU\(s\) .*but CUDA_VISIBLE_DEVICES='1' of the run's env vars lists 1"
    ):
        Plan(_gpu_scaling(2, 1), env_vars=one).check_gpus()
    assert Plan(_gpu_scaling((1, 4), 1), env_vars=one).world_size == 1  # elastic: 1 GPU, 1 worker
    local = Plan(_gpu_scaling((1, 4), 1, hosts=["localhost"]), env_vars=one)
    assert local.placement is not None and [h.slots for h in local.placement.hosts] == [1]


def test_a_host_without_gpus_has_those_of_the_runs_cuda_visible_devices() -> None:
    # Not a real host: counting its GPUs over SSH (`nvidia-smi -L`, all of them) would fail.
    uuid = "GPU-3f2a9c1e-0000-4000-8000-000000000001"
    plan = Plan(_gpu_scaling((1, 8), 1, hosts=["no-such-host.invalid"]), env_vars={"CUDA_VISIBLE_DEVICES": f"0,{uuid}"})
    assert plan.placement is not None and [h.slots for h in plan.placement.hosts] == [2]
    assert plan.agent_env(remote=True, host=plan.placement.hosts[0])["CUDA_VISIBLE_DEVICES"] == f"0,{uuid}"
    with pytest.raises(
        ConfigError, match=r"need 3 GPU\(s\).*Hosts without `gpus=` have those of CUDA_VISIBLE_DEVICES='0'"
    ):
        Plan(_gpu_scaling(3, 1, hosts=["no-such-host.invalid slots=3"]), env_vars={"CUDA_VISIBLE_DEVICES": "0"})


def test_an_elastic_run_counts_whole_shares_of_this_machines_gpus(two_gpus_here: None) -> None:
    assert Plan(_gpu_scaling((1, 30), 0.1)).world_size == 20  # 10 per GPU (2 // 0.1 is 19.0 in floats)
    assert Plan(_gpu_scaling((1, 30), 0.4)).world_size == 4


def test_a_tune_trial_reserves_the_gpus_its_workers_are_placed_on() -> None:
    from ddptrain.tune.trainable import TrainerTrainable

    trainer = train.DataParallelTrainer(_nothing, scaling_config=_gpu_scaling(5, 0.4), train_loop_config={})
    assert TrainerTrainable(trainer).prepare({}).gpus == 3  # 2 + 2 + 1 workers


def _nothing(config: dict) -> None:
    pass


# ----------------------------------------------------------------- the driver never starts CUDA
# Asking CUDA anything through its runtime (`torch.cuda.is_available()`, ...) starts it in the
# driver (cuInit): processes the driver forks then cannot use CUDA, and `ddptrain run` scripts
# are drivers. Counting GPUs goes through NVML (`torch.cuda.device_count()`), which does not.
_STARTS_CUDA = ("is_available", "init", "_lazy_init", "current_device", "set_device", "synchronize")


@pytest.fixture
def cuda_must_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process (a driver, or a worker function run here), the calls that start CUDA
    fail the test; 2 GPUs counted."""

    def refuse(name: str):  # type: ignore[no-untyped-def]
        def call(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"torch.cuda.{name}() was called, which starts CUDA in this process")

        return call

    for name in _STARTS_CUDA:
        monkeypatch.setattr(torch.cuda, name, refuse(name))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_ray_cluster_resources_count_gpus_without_starting_cuda(cuda_must_not_start: None) -> None:
    from ddptrain import ray_compat

    assert ray_compat._RayModule().cluster_resources()["GPU"] == 2.0


def _visible_gpus() -> str | None:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_gpu_run_starts_no_cuda_in_the_driver(cuda_must_not_start: None, storage: str) -> None:
    # The whole driver side of a GPU run (plan, GPU check, launch, results) on this machine's
    # 2 (counted) GPUs. Its workers touch no CUDA: each says which GPU it was given.
    trainer = train.DataParallelTrainer(
        _visible_gpus,
        scaling_config=train.ScalingConfig(num_workers=2, use_gpu=True),
        run_config=train.RunConfig(storage_path=storage),
    )
    assert trainer.fit().return_values == ["0", "1"]


_GPU_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "XLA_PYTHON_CLIENT_MEM_FRACTION", "TF_FORCE_GPU_ALLOW_GROWTH")


def _gpu_env() -> dict[str, str | None]:
    import os

    return {name: os.environ.get(name) for name in _GPU_ENV}


def _fit_gpu_env(storage: str, gpus: float, env_vars: dict[str, str] | None = None) -> list[dict[str, str | None]]:
    trainer = train.DataParallelTrainer(
        _gpu_env,
        scaling_config=_gpu_scaling(2, gpus),
        run_config=train.RunConfig(storage_path=storage, worker_runtime_env={"env_vars": env_vars or {}}),
    )
    return trainer.fit().return_values


def test_gpu_workers_number_gpus_as_nvidia_smi_does(
    cuda_must_not_start: None, storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `gpus=` ids, a sweep's ids and nvidia-smi count in PCI bus order; CUDA counts fastest first
    # unless told: on a machine with two kinds of GPUs, id 1 would be another GPU in the worker.
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    whole = _fit_gpu_env(storage, 1)
    assert [(v["CUDA_VISIBLE_DEVICES"], v["CUDA_DEVICE_ORDER"]) for v in whole] == [
        ("0", "PCI_BUS_ID"),
        ("1", "PCI_BUS_ID"),
    ]
    assert all(v["XLA_PYTHON_CLIENT_MEM_FRACTION"] is None and v["TF_FORCE_GPU_ALLOW_GROWTH"] is None for v in whole)
    mine = _fit_gpu_env(storage, 1, {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert [v["CUDA_DEVICE_ORDER"] for v in mine] == ["FASTEST_FIRST"] * 2  # the user's own value wins


def test_workers_sharing_a_gpu_keep_jax_and_tensorflow_to_their_share_of_its_memory(
    cuda_must_not_start: None, storage: str
) -> None:
    # JAX takes 75% of a GPU at its first use and TensorFlow nearly all: the second worker on
    # the GPU would fail out of memory. Each gets its share of JAX's default, and TF grows.
    halves = _fit_gpu_env(storage, 0.5)
    assert [v["CUDA_VISIBLE_DEVICES"] for v in halves] == ["0", "0"]  # one GPU, shared
    assert [(v["XLA_PYTHON_CLIENT_MEM_FRACTION"], v["TF_FORCE_GPU_ALLOW_GROWTH"]) for v in halves] == [
        ("0.375", "true")
    ] * 2
    mine = _fit_gpu_env(storage, 0.5, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2", "TF_FORCE_GPU_ALLOW_GROWTH": "false"})
    assert [(v["XLA_PYTHON_CLIENT_MEM_FRACTION"], v["TF_FORCE_GPU_ALLOW_GROWTH"]) for v in mine] == [
        ("0.2", "false")
    ] * 2


def _fsdp_over_gloo() -> list[str]:
    import warnings

    import torch.distributed as dist

    from ddptrain.torch import prepare_model

    dist.init_process_group("gloo")  # what workers sharing a GPU get (env://, the driver's store)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                prepare_model(torch.nn.Linear(2, 2), parallel_strategy="fsdp")
            except RuntimeError:
                pass  # no CUDA in this CPU build's worker: FSDP itself cannot run here
        return [str(w.message) for w in caught]
    finally:
        dist.destroy_process_group()


def test_fsdp_on_workers_sharing_a_gpu_says_it_runs_over_gloo(cuda_must_not_start: None, storage: str) -> None:
    # NCCL refuses two ranks on one GPU, so such workers get gloo, and FSDP over gloo is slow
    # at best: prepare_model says so rather than leave the user to find out.
    trainer = train.DataParallelTrainer(
        _fsdp_over_gloo, scaling_config=_gpu_scaling(2, 0.5), run_config=train.RunConfig(storage_path=storage)
    )
    for caught in trainer.fit().return_values:
        assert any("parallel_strategy='fsdp') on GPU workers whose process group uses 'gloo'" in m for m in caught), (
            caught
        )


def test_a_torch_gpu_run_on_a_host_without_cuda_fails_naming_it(cuda_must_not_start: None, storage: str) -> None:
    # TorchTrainer's driver side (nccl chosen, failure explained) without CUDA here either;
    # the worker, whose torch cannot use CUDA, says so before the function runs.
    from ddptrain.torch import TorchTrainer

    if torch.cuda._is_compiled() and torch.version.cuda is not None:
        pytest.skip("this torch is built for CUDA: its workers would not fail")
    trainer = TorchTrainer(
        _visible_gpus,
        scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True, hosts=["localhost slots=1 gpus=0"]),
        run_config=train.RunConfig(storage_path=storage),
    )
    with pytest.raises(train.TrainingFailedError, match=r"rank 0 was given GPU\(s\) \[0\] on host .*cannot use CUDA"):
        trainer.fit()


# ----------------------------------------------------------------- a worker's own GPUs
@pytest.mark.parametrize(
    ("visible", "own", "seen"),
    [(None, "1", "1"), ("3,5,7", "0,2", "3,7"), ("GPU-aa, GPU-bb", "1", "GPU-bb")],
)
def test_a_worker_of_another_backend_sees_only_its_own_gpus(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, own: str, seen: str
) -> None:
    from ddptrain.worker.main import _see_own_gpus

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("DDPTRAIN_OWN_GPUS", own)
    _see_own_gpus()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == seen


def test_a_worker_given_a_gpu_where_none_is_visible_fails_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA_VISIBLE_DEVICES="" hides every GPU: the worker must not run on none, silently.
    from ddptrain.worker.main import _see_own_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("DDPTRAIN_OWN_GPUS", "0")
    with pytest.raises(ConfigError, match=r"given GPU\(s\) \[0\] .* CUDA_VISIBLE_DEVICES='' lists 0"):
        _see_own_gpus()


def test_a_cpu_workers_teardown_does_not_start_cuda(cuda_must_not_start: None) -> None:
    # Each worker of every torch run ends its process group this way: on a GPU machine, a CPU
    # run's workers must not start CUDA there just to find they have no cache to empty.
    from ddptrain.torch.config import _destroy_process_group

    _destroy_process_group()


# ----------------------------------------------------------------- batches on "cuda"
def test_batches_for_plain_cuda_go_to_the_callers_gpu_not_the_prefetch_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # iter_torch_batches moves batches in its prefetch thread, where plain "cuda" would mean
    # GPU 0 (torch.cuda.set_device is per thread): "cuda" must become the caller's GPU, with
    # its number, when the iterator is made. A numbered device stays as it is.
    from ddptrain.data._torch import resolve_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # the worker's thread is on GPU 1
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


def test_batches_moved_by_the_data_iterator_include_those_in_any_mapping() -> None:
    # A collate_fn of iter_torch_batches may return a transformers BatchEncoding (a UserDict);
    # "meta" stands in for a GPU: a tensor left on the CPU shows.
    import collections

    from ddptrain.data._torch import move

    class Encoding(collections.UserDict):
        pass

    batch = move(Encoding({"input_ids": torch.ones(2, 3), "n": 2}), torch.device("meta"), pin_memory=False)
    assert isinstance(batch, Encoding)
    assert batch["input_ids"].device.type == "meta" and batch["n"] == 2
