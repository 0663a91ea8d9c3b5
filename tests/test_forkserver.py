"""Local agents forked from a server that imported torch once (``ddptrain.launch.forkserver``):
the next ``fit()`` and a restarted attempt start without importing torch again; nothing of
theirs outlives the driver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import tagged_processes

import ddptrain as train
from ddptrain.launch import forkserver
from ddptrain.torch import TorchTrainer


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def where_started() -> dict[str, int]:
    agent = os.getppid()
    return {"agent": agent, "started_by": parent_of(agent)}


def fit(func, storage: str, **run) -> train.Result:
    return TorchTrainer(
        func,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage, **run),
    ).fit()


def test_the_next_fit_forks_its_agent_from_the_same_server(storage: str) -> None:
    first = fit(where_started, storage).return_values[0]
    second = fit(where_started, storage).return_values[0]
    assert first["started_by"] == second["started_by"]
    assert first["started_by"] in forkserver.server_pids()
    assert first["agent"] != second["agent"]  # a new agent each time: nothing of a run is kept


def crash_once(marker: str) -> dict[str, int]:
    if train.get_context().get_world_rank() == 0 and not os.path.exists(marker):
        Path(marker).touch()
        raise RuntimeError("the first attempt fails")
    return where_started()


def test_a_restarted_attempt_forks_its_agent_from_the_server(storage: str, tmp_path: Path) -> None:
    marker = str(tmp_path / "crashed")
    result = fit(lambda: crash_once(marker), storage, failure_config=train.FailureConfig(max_failures=1))
    assert os.path.exists(marker)
    assert result.return_values[0]["started_by"] in forkserver.server_pids()


def test_the_server_can_be_turned_off(storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPTRAIN_AGENT_FORKSERVER", "0")
    values = fit(where_started, storage).return_values
    assert values[0]["started_by"] == os.getpid()  # a new process of the driver's


def test_a_killed_server_is_replaced_by_the_next_fit(storage: str) -> None:
    old = fit(where_started, storage).return_values[0]["started_by"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while old in forkserver.server_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert old not in forkserver.server_pids()
    new = fit(where_started, storage).return_values[0]["started_by"]
    assert new != old and new in forkserver.server_pids()


def test_a_server_killed_just_before_a_fit_costs_nothing_but_its_speed(storage: str, caplog) -> None:
    # Killed without waiting: the next fit may reach the server before its death is seen; the
    # agent then starts as a new process.
    old = fit(where_started, storage).return_values[0]["started_by"]
    os.kill(old, signal.SIGKILL)
    values = fit(where_started, storage).return_values
    assert len(values) == 2 and values[0]["started_by"] != old


def env_and_start() -> dict[str, object]:
    return {**where_started(), "knob": os.environ.get("DDPTRAIN_TEST_KNOB"), "omp": os.environ.get("OMP_NUM_THREADS")}


def test_another_environment_gets_its_own_server(storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the server imported was imported under its environment (OMP_NUM_THREADS is read when
    # the OpenMP library loads): an agent for another one must not be forked from it.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first = fit(env_and_start, storage).return_values[0]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    second = fit(env_and_start, storage).return_values[0]
    assert first["started_by"] != second["started_by"]
    assert (first["omp"], second["omp"]) == ("1", "2")


def test_ddptrain_settings_reach_an_agent_forked_from_the_same_server(
    storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ddptrain reads its settings when it uses them: each agent gets its exact environment.
    first = fit(env_and_start, storage).return_values[0]
    monkeypatch.setenv("DDPTRAIN_TEST_KNOB", "on")
    second = fit(env_and_start, storage).return_values[0]
    assert first["started_by"] == second["started_by"]
    assert (first["knob"], second["knob"]) == (None, "on")


def test_a_killed_driver_leaves_neither_its_server_nor_its_agents(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal, time
            import ddptrain as train
            from ddptrain.torch import TorchTrainer

            def func():
                if train.get_context().get_world_rank() == 0:
                    print("WORKING", flush=True)
                time.sleep(60)

            config = dict(
                scaling_config=train.ScalingConfig(num_workers=2),
                run_config=train.RunConfig(storage_path={str(tmp_path / "runs")!r}),
            )
            TorchTrainer(lambda: None, **config).fit()  # the server starts
            TorchTrainer(func, **config).fit()  # an agent forked from it
            """
        )
    )
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert driver.stdout is not None
        deadline = time.monotonic() + 120
        for line in driver.stdout:
            if "WORKING" in line or time.monotonic() > deadline:
                break
        assert driver.poll() is None, "the driver ended before its second fit ran"
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 15
        while tagged_processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tagged_processes() == [], "the driver's fork server or agents outlived it"
    finally:
        driver.kill()
        driver.wait()


def modules_at_start(config: dict[str, object]) -> dict[str, object]:
    """What the worker had imported before the function ran; then imports ``config["import"]``
    and sends the server a hint of its own (a module outside the list it preloads from)."""
    import importlib

    from ddptrain.agent import forkserver as server_side

    loaded = {name: name in sys.modules for name in ("torch._dynamo", "antigravity")}
    for name in config["import"]:  # type: ignore[attr-defined]
        importlib.import_module(name)
    hints = getattr(server_side, "_hints", None)
    if hints is not None:
        hints.send(b"antigravity")
    return {**where_started(), **loaded}


@pytest.mark.slow
def test_what_a_runs_workers_imported_of_torch_the_next_agent_gets_from_the_server(
    storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DistributedDataParallel's first use imports torch._dynamo (seconds of CPU in every worker):
    # once a run's workers did, the server imports it too, and later agents' workers have it.
    monkeypatch.setenv("FORKSERVER_TEST_FRESH", str(time.time()))  # a server of this test's own

    def run(imports: list[str]) -> dict[str, object]:
        return (
            TorchTrainer(
                modules_at_start,
                train_loop_config={"import": imports},
                scaling_config=train.ScalingConfig(num_workers=1),
                run_config=train.RunConfig(storage_path=storage),
            )
            .fit()
            .return_value
        )

    plain = run([])  # workers that never import it: the server does not either
    first = run(["torch._dynamo"])
    later = run([])
    assert plain["started_by"] == first["started_by"] == later["started_by"]
    assert [plain["torch._dynamo"], first["torch._dynamo"], later["torch._dynamo"]] == [False, False, True]
    assert later["antigravity"] is False  # a hint names only what the server may preload
