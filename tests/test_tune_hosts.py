"""ddptrain.tune on a host list: trials share the hosts' slots (and GPU ids) and never
oversubscribe a host.

The accounting is tested without processes first (fast); then a real sweep over loopback sshd
hosts (slow, ssh).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

import ddptrain as train
from ddptrain import tune
from ddptrain.errors import ConfigError
from ddptrain.launch.hosts import HostSpec, parse_hosts
from ddptrain.tune._resources import HostPool, Resources
from ddptrain.tune.trainable import TrainerTrainable


def _loop(config: dict[str, Any]) -> None:
    start = time.time()
    time.sleep(config.get("sleep", 0.0))
    ctx = train.get_context()
    record = {
        "trial": ctx.get_experiment_name(),
        "rank": ctx.get_world_rank(),
        "port": os.environ.get("SSH_CONNECTION", "").split()[3:],
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "start": start,
        "end": time.time(),
    }
    out = Path(config["out"])
    (out / f"{record['trial']}_{record['rank']}.json").write_text(json.dumps(record))
    train.report({"loss": config.get("lr", 1.0)})


def _trainable(hosts: Any = None, **scaling: Any) -> TrainerTrainable:
    trainer = train.DataParallelTrainer(
        _loop, scaling_config=train.ScalingConfig(num_workers=2, hosts=hosts, **scaling), train_loop_config={}
    )
    return TrainerTrainable(trainer)


def _given(grant: Any) -> list[tuple[str, int | None]]:
    return [(h.name, h.slots) for h in grant.hosts]


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


# ----------------------------------------------------------------- accounting (no processes)
def test_trials_share_the_slots_of_each_host() -> None:
    resources = Resources(total_cpus=1, total_gpus=0)
    prepared = _trainable(["h0 slots=2", "h1 slots=2"]).prepare({})
    assert prepared.cpus == 0 and prepared.gpus == 0  # the workers reserve no CPU of this machine
    grants = [resources.acquire(prepared) for _ in range(3)]
    assert grants[0] is not None and _given(grants[0]) == [("h0", 2)]
    assert grants[1] is not None and _given(grants[1]) == [("h1", 2)]
    assert grants[2] is None  # every slot is held: the third trial waits
    resources.release(grants[0])
    again = resources.acquire(prepared)
    assert again is not None and _given(again) == [("h0", 2)]


def test_a_trial_is_placed_by_its_strategy_on_what_is_left() -> None:
    pool = HostPool()
    hosts = parse_hosts(["h0 slots=3", "h1 slots=2", "h2"])
    first = pool.take(hosts, 2, "PACK", use_gpu=False)
    assert first is not None and [(h.name, h.slots) for h in first] == [("h0", 2)]
    spread = pool.take(hosts, 3, "SPREAD", use_gpu=False)
    assert spread is not None and [(h.name, h.slots) for h in spread] == [("h0", 1), ("h1", 1), ("h2", 1)]
    assert pool.take(hosts, 2, "PACK", use_gpu=False) is None  # 1 slot left (h1)
    last = pool.take(hosts, 1, "PACK", use_gpu=False)
    assert last is not None and [(h.name, h.slots) for h in last] == [("h1", 1)]
    pool.give_back(spread, use_gpu=False)
    assert [pool.free_slots(h) for h in hosts] == [1, 1, 1]


def test_host_lists_of_different_trials_share_a_host_by_name() -> None:
    resources = Resources(total_cpus=1, total_gpus=0)
    on_h0 = resources.acquire(_trainable(["h0 slots=2"]).prepare({}))
    assert on_h0 is not None
    both = resources.acquire(_trainable(["h0 slots=2", "h1 slots=2"]).prepare({}))
    assert both is not None and _given(both) == [("h1", 2)]


def test_gpu_trials_never_share_a_host() -> None:
    resources = Resources(total_cpus=1, total_gpus=0)
    gpu = _trainable(["h0 slots=4", "h1 slots=4"], use_gpu=True).prepare({"scaling_config": {"num_workers": 1}})
    cpu = _trainable(["h0 slots=4", "h1 slots=4"]).prepare({})
    first = resources.acquire(gpu)
    assert first is not None and _given(first) == [("h0", 1)]
    with_cpu = resources.acquire(cpu)  # CPU workers may use h0's other slots
    assert with_cpu is not None and _given(with_cpu) == [("h0", 2)]
    second = resources.acquire(gpu)  # but not another GPU trial: its workers would use h0's GPU 0 too
    assert second is not None and _given(second) == [("h1", 1)]
    assert resources.acquire(gpu) is None


def _held(grant: Any) -> list[tuple[str, int | None, tuple[int, ...] | None]]:
    return [(h.name, h.slots, h.gpus) for h in grant.hosts]


def test_gpu_trials_share_a_host_with_gpus_gpu_by_gpu() -> None:
    resources = Resources(total_cpus=1, total_gpus=0)
    gpu = _trainable(["h0 gpus=0,1"], use_gpu=True).prepare({"scaling_config": {"num_workers": 1}})
    first, second = resources.acquire(gpu), resources.acquire(gpu)
    assert first is not None and _held(first) == [("h0", 1, (0,))]
    assert second is not None and _held(second) == [("h0", 1, (1,))]
    assert resources.acquire(gpu) is None  # both GPUs are held: a third trial waits
    resources.release(first)
    third = resources.acquire(gpu)
    assert third is not None and _held(third) == [("h0", 1, (0,))]  # GPU 0 came back to the pool
    resources.release(second)
    resources.release(third)
    both = resources.acquire(_trainable(["h0 gpus=0,1"], use_gpu=True).prepare({}))
    assert both is not None and _held(both) == [("h0", 2, (0, 1))]


def test_gpu_trials_on_several_hosts_and_fractions_of_a_gpu() -> None:
    pool = HostPool()
    hosts = parse_hosts(["h0 slots=4 gpus=4,6", "h1 slots=2 gpus=2,3"])
    spread = pool.take(hosts, 2, "SPREAD", use_gpu=True, gpus_per_worker=1)
    assert spread is not None and [(h.name, h.gpus) for h in spread] == [("h0", (4,)), ("h1", (2,))]
    halves = pool.take(hosts, 2, "PACK", use_gpu=True, gpus_per_worker=0.5)  # two workers on one GPU
    assert halves is not None and [(h.name, h.slots, h.gpus) for h in halves] == [("h0", 2, (6,))]
    # h0 has a slot left but no GPU: trials never share one, even at half a GPU per worker.
    last = pool.take(hosts, 1, "PACK", use_gpu=True, gpus_per_worker=0.5)
    assert last is not None and [(h.name, h.gpus) for h in last] == [("h1", (3,))]
    assert pool.take(hosts, 1, "PACK", use_gpu=True, gpus_per_worker=0.5) is None
    pool.give_back(spread, use_gpu=True)
    assert pool.free_gpus(hosts[0]) == [4] and pool.free_gpus(hosts[1]) == [2]


def test_a_host_without_gpus_is_held_whole_by_a_gpu_trial() -> None:
    pool = HostPool()
    whole = pool.take(parse_hosts(["h0 slots=2"]), 1, "PACK", use_gpu=True)
    assert whole is not None  # its GPU ids are unknown: no other GPU trial may use h0
    assert pool.take(parse_hosts(["h0 gpus=0,1"]), 1, "PACK", use_gpu=True) is None
    pool.give_back(whole, use_gpu=True)
    by_id = pool.take(parse_hosts(["h0 gpus=0,1"]), 1, "PACK", use_gpu=True)
    assert by_id is not None and by_id[0].gpus == (0,)
    assert pool.take(parse_hosts(["h0 slots=2"]), 1, "PACK", use_gpu=True) is None  # h0's GPU 0 is in use


def test_a_host_without_slots_lends_the_gpus_it_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")  # this machine's GPUs, as its trials count them
    resources = Resources(total_cpus=1, total_gpus=0)
    gpu = _trainable(["localhost"], use_gpu=True).prepare({"scaling_config": {"num_workers": 1}})
    assert resources.never_fits("t1", gpu) is None
    first, second = resources.acquire(gpu), resources.acquire(gpu)
    assert first is not None and _held(first) == [("localhost", 1, (2,))]
    assert second is not None and _held(second) == [("localhost", 1, (5,))]
    assert resources.acquire(gpu) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    error = Resources(total_cpus=1, total_gpus=0).never_fits("t2", gpu)
    assert isinstance(error, ConfigError) and "host 'localhost' has no GPU that `use_gpu=True` could use" in str(error)


def test_a_host_without_slots_lends_gpus_named_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    # A sweep started with CUDA_VISIBLE_DEVICES=GPU-...,MIG-... (a scheduler's assignment) lends those.
    gpu, mig = "GPU-3f2a9c1e-0000-4000-8000-000000000001", "MIG-77b1c3d4-0000-4000-8000-000000000002"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{gpu},{mig}")
    resources = Resources(total_cpus=1, total_gpus=0)
    prepared = _trainable(["localhost"], use_gpu=True).prepare({"scaling_config": {"num_workers": 1}})
    assert resources.never_fits("t1", prepared) is None
    first, second = resources.acquire(prepared), resources.acquire(prepared)
    assert first is not None and _held(first) == [("localhost", 1, (gpu,))]
    assert second is not None and _held(second) == [("localhost", 1, (mig,))]
    assert resources.acquire(prepared) is None


def test_gpus_fewer_than_a_trials_slots_need_is_an_error_before_it_starts() -> None:
    prepared = _trainable(["h0 slots=2 gpus=0"], use_gpu=True).prepare({})
    error = Resources(total_cpus=1, total_gpus=0).never_fits("t1", prepared)
    assert isinstance(error, ConfigError) and "need 2 GPU(s), but its `gpus` lists 1 (0)" in str(error)


def test_a_trial_larger_than_its_host_list_can_never_run() -> None:
    resources = Resources(total_cpus=1, total_gpus=0)
    prepared = _trainable(["h0 slots=2", "h1 slots=2"]).prepare({"scaling_config": {"num_workers": 5}})
    error = resources.never_fits("t1", prepared)
    assert isinstance(error, ConfigError)
    assert "needs 5 worker slots but its host list has 4 (h0=2, h1=2)" in str(error)
    assert resources.never_fits("t2", _trainable(["h0 slots=2", "h1 slots=2"]).prepare({})) is None


def test_the_hostfile_of_the_environment_is_a_host_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1 slots=1\nh2 slots=1\n")
    monkeypatch.setenv("DDPTRAIN_HOSTFILE", str(hostfile))
    prepared = _trainable().prepare({})
    assert prepared.hosts == [HostSpec("h1", slots=1), HostSpec("h2", slots=1)]
    monkeypatch.delenv("DDPTRAIN_HOSTFILE")
    local = _trainable().prepare({})
    assert local.hosts is None and local.cpus == 2  # no host list: this machine's CPUs, as before


# ----------------------------------------------------------------- a real sweep over SSH
@pytest.mark.slow
@pytest.mark.ssh
@pytest.mark.timeout(120)
def test_trials_on_a_host_list_run_as_its_slots_allow(ssh, storage: str, tmp_path: Path) -> None:
    out = tmp_path / "records"
    out.mkdir()
    trainer = train.DataParallelTrainer(
        _loop,
        train_loop_config={"out": str(out), "sleep": 1.5},
        scaling_config=train.ScalingConfig(num_workers=2, hosts=["h0 slots=2", "h1 slots=2"]),
    )
    sizes = [2, 2, 5, 2, 2]
    tuner = tune.Tuner(
        trainer,
        param_space={"scaling_config": tune.grid_search([{"num_workers": n} for n in sizes])},
        tune_config=tune.TuneConfig(metric="loss", mode="min", total_cpus=1),
        run_config=train.RunConfig(name="hosts", storage_path=storage),
    )
    results = tuner.fit()

    assert len(results) == 5 and results.num_errors == 1
    too_big = next(r for r in results if r.config["scaling_config"]["num_workers"] == 5)
    assert isinstance(too_big.error, ConfigError)
    assert "needs 5 worker slots but its host list has 4 (h0=2, h1=2)" in str(too_big.error)
    assert not (Path(too_big.path) / "run.json").exists()  # it never started a worker

    names = {str(h.port): h.name for h in ssh.hosts}
    records = [json.loads(p.read_text()) for p in out.iterdir()]
    by_trial: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_trial.setdefault(record["trial"], []).append(record)
    assert len(by_trial) == 4 and all(len(r) == 2 for r in by_trial.values())
    for trial, workers in by_trial.items():
        given = json.loads((Path(storage) / "hosts" / trial / "run.json").read_text())["hosts"]
        assert {names[w["port"][0]] for w in workers} == set(given)
        assert given in (["h0"], ["h1"])  # PACK on the free host of 2 slots
    for name in ("h0", "h1"):
        on_host = [(r["start"], r["end"]) for r in records if names[r["port"][0]] == name]
        assert _max_overlap(on_host) <= 2
    spans = [(min(w["start"] for w in ws), max(w["end"] for w in ws)) for ws in by_trial.values()]
    assert _max_overlap(spans) == 2  # 2 trials at a time: 2 x 2 workers on 4 slots


@pytest.mark.slow
@pytest.mark.ssh
@pytest.mark.timeout(120)
def test_gpu_trials_on_one_host_see_disjoint_gpus(ssh, storage: str, tmp_path: Path) -> None:
    # A CPU stand-in for GPU trials: DataParallelTrainer's workers touch no CUDA device, so
    # `use_gpu=True` runs here, and each worker records the GPUs its host let it see.
    out = tmp_path / "records"
    out.mkdir()
    trainer = train.DataParallelTrainer(
        _loop,
        train_loop_config={"out": str(out), "sleep": 1.5},
        scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True, hosts=["h0 gpus=3,5"]),
    )
    tuner = tune.Tuner(
        trainer,
        param_space={"train_loop_config": {"lr": tune.grid_search([1.0, 2.0, 3.0])}},
        tune_config=tune.TuneConfig(metric="loss", mode="min", total_cpus=1),
        # The host's `gpus=` wins over the run's own CUDA_VISIBLE_DEVICES there.
        run_config=train.RunConfig(
            name="gpus", storage_path=storage, worker_runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": "7"}}
        ),
    )
    results = tuner.fit()

    assert len(results) == 3 and results.num_errors == 0
    records = [json.loads(p.read_text()) for p in out.iterdir()]
    assert len(records) == 3 and {r["gpus"] for r in records} <= {"3", "5"}
    for i, one in enumerate(records):
        for other in records[i + 1 :]:
            if one["start"] < other["end"] and other["start"] < one["end"]:
                assert one["gpus"] != other["gpus"]  # trials at once never see the same GPU
    assert _max_overlap([(r["start"], r["end"]) for r in records]) == 2  # 2 GPUs: 2 trials at a time
