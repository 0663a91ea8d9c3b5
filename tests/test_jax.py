"""ddptrain.jax: real multi-process JAX (jax.distributed, CPU collectives over gloo) in real
worker processes.

The training functions import JAX inside: importing it at module level would be fine too, but
this module is imported by pytest's process, which must not depend on JAX's state.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ddptrain as train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs `pip install ddptrain[jax]`")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ROWS = 64


def _psum_of_shards(config: dict[str, Any]) -> dict[str, Any]:
    """Each worker sums its shard's rows (numpy batches); a psum across the workers adds them up."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    try:
        from jax import shard_map
    except ImportError:  # JAX before 0.6
        from jax.experimental.shard_map import shard_map

    rank = train.get_context().get_world_rank()
    batches = list(train.get_dataset_shard("train").iter_batches(batch_size=8, batch_format="numpy"))
    assert all(isinstance(batch["x"], np.ndarray) for batch in batches)
    local = np.concatenate([batch["x"] for batch in batches])
    mesh = Mesh(np.array(jax.devices()), ("workers",))
    mine = jax.make_array_from_process_local_data(NamedSharding(mesh, P("workers")), np.array([local.sum()]))
    psum = jax.jit(shard_map(lambda a: jax.lax.psum(a, "workers"), mesh=mesh, in_specs=P("workers"), out_specs=P()))
    total = float(np.asarray(psum(mine).addressable_data(0))[0])
    if config.get("raise_on") == rank:
        raise ValueError(f"rank {rank} gives up")
    if config.get("kill_on") == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    if config.get("raise_on") is not None or config.get("kill_on") is not None:
        while True:  # the survivor keeps summing until the failure reaches it or the driver stops it
            psum(mine).block_until_ready()
    train.report({"total": total})
    return {
        "pid": os.getpid(),
        "rows": sorted(local.tolist()),
        "total": total,
        "devices": [d.process_index for d in jax.devices()],
        "local_devices": len(jax.local_devices()),
        "collectives": jax.config.jax_cpu_collectives_implementation,
    }


def _trainer(storage: str, **config: Any) -> Any:
    from ddptrain.jax import JaxTrainer

    return JaxTrainer(
        _psum_of_shards,
        train_loop_config=config,
        datasets={"train": train.data.from_numpy({"x": np.arange(ROWS, dtype=np.float64)})},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_workers_form_one_jax_runtime_and_psum_their_numpy_shards(storage: str) -> None:
    started = time.monotonic()
    result = _trainer(storage).fit()
    assert time.monotonic() - started < 90  # the workers left without JAX's shutdown barrier

    first, second = result.return_values
    assert first["devices"] == second["devices"] == [0, 1]  # jax.devices() spans both processes
    assert first["local_devices"] == second["local_devices"] == 1
    assert first["collectives"] == "gloo"
    assert sorted(first["rows"] + second["rows"]) == list(range(ROWS))  # disjoint shards, all rows
    assert first["rows"] and second["rows"]
    expected = float(sum(range(ROWS)))
    assert first["total"] == second["total"] == expected
    assert result.metrics["total"] == expected


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_warm_group_runs_fits_in_a_row(storage: str) -> None:
    """Between warm runs every worker leaves jax.distributed and clears JAX's backends: the next
    run initializes it again (JAX allows one initialize per process otherwise) at once."""
    results, seconds = [], []
    with train.reuse_workers():
        for _ in range(3):
            started = time.monotonic()
            results.append(_trainer(storage).fit())
            seconds.append(time.monotonic() - started)
    pids = [sorted(v["pid"] for v in r.return_values) for r in results]
    assert pids[0] == pids[1] == pids[2]  # the same processes ran all three
    assert [r.return_values[0]["total"] for r in results] == [float(sum(range(ROWS)))] * 3
    assert max(seconds[1:]) < 30


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "rank"), [("raise_on", 0), ("kill_on", 1)])
def test_the_failing_rank_is_the_root_cause_not_the_peer_whose_collective_broke(
    storage: str, how: str, rank: int
) -> None:
    """Rank 0 hosts JAX's coordinator; rank 1 is killed in the middle of the survivor's psums.
    Either way the survivor's gloo error ("Connection closed/reset by peer") comes second."""
    started = time.monotonic()
    with pytest.raises(train.TrainingFailedError) as info:
        _trainer(storage, **{how: rank}).fit()
    assert time.monotonic() - started < 90
    root = str(info.value).splitlines()[1]
    assert root.startswith(f"Root cause (first failure): rank {rank} "), str(info.value)
    if how == "raise_on":
        assert f"ValueError: rank {rank} gives up" in root
        assert isinstance(info.value.__cause__, ValueError)
    else:
        assert "killed by signal SIGKILL" in root


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_example_reports_checkpoints_and_resumes_after_a_worker_is_killed(storage: str) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "jax_mlp.py"), "--epochs", "4", "--crash-at", "2", "--rows", "4096"]
        + ["--storage-path", storage],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 1: simulating a crash in epoch 2" in out.stdout + out.stderr
    assert "last attempt started at epoch 2" in out.stdout  # resumed from epoch 1's checkpoint
    losses = json.loads(out.stdout.split("losses: ", 1)[1].splitlines()[0])
    assert len(losses) == 4 and losses[-1] < losses[0] / 2  # every epoch reported once; it learned
    assert "checkpoint of epoch 3 from" in out.stdout
    (run,) = Path(storage).iterdir()
    errors = json.loads((run / "run.json").read_text())["attempt_errors"]
    assert errors[0]["error"].startswith("rank 1 "), errors  # the killed rank, not its peer's gloo error
    assert "SIGKILL" in errors[0]["error"]


_JAX_AT_IMPORT = """
import jax.numpy as jnp

SCALE = jnp.ones(3) * 2  # computed when the module is imported


def train_func():
    return float(SCALE.sum())
"""

_DRIVER = """
import sys
import ddptrain as train
from ddptrain.jax import JaxTrainer
from jax_at_import import train_func

try:
    JaxTrainer(train_func, scaling_config=train.ScalingConfig(num_workers=2),
               run_config=train.RunConfig(storage_path=sys.argv[1])).fit()
except train.TrainingFailedError as e:
    print("ERROR:", e)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_module_that_computes_with_jax_when_imported_gets_an_error_naming_it(storage: str, tmp_path: Path) -> None:
    (tmp_path / "jax_at_import.py").write_text(_JAX_AT_IMPORT)
    (tmp_path / "driver.py").write_text(_DRIVER)
    out = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), storage],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "ERROR:" in out.stdout, out.stdout + out.stderr
    message = out.stdout.split("ERROR:", 1)[1]
    assert "had already started JAX before ddptrain could call jax.distributed.initialize" in message
    assert "module(s) jax_at_import computed JAX arrays when imported" in message
    assert "into the training function" in message


def _never_runs() -> None:
    raise AssertionError("the training function must not start")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_without_jax_fail_with_the_extra_to_install(storage: str, tmp_path: Path) -> None:
    from ddptrain.jax import JaxTrainer

    # Every Python started with this PYTHONPATH (the workers' agent) cannot import JAX.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['jax'] = None\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    with pytest.raises(train.TrainingFailedError) as info:
        JaxTrainer(
            _never_runs,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage, worker_runtime_env={"env_vars": {"PYTHONPATH": path}}),
        ).fit()
    # The workers' agent fails to load the training function's pickled JaxConfig, on that host.
    assert f"ddptrain.jax needs jax, which this Python ({sys.executable} on host {socket.gethostname()})" in str(
        info.value
    )
    assert "pip install ddptrain[jax]" in str(info.value)


def test_import_ddptrain_jax_imports_no_jax_and_a_missing_one_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import sys
        import ddptrain
        from ddptrain.jax import JaxConfig, JaxTrainer
        JaxTrainer(lambda: None, jax_config=JaxConfig())
        import ddptrain.ray_compat
        ddptrain.ray_compat.install()
        from ray.train.v2.jax import JaxTrainer as RayJaxTrainer
        print("same:", RayJaxTrainer is JaxTrainer)
        print("loaded:", [m for m in ("jax", "jaxlib") if m in sys.modules])
        for name in [n for n in sys.modules if n.startswith("ddptrain.jax")]:
            del sys.modules[name]
        sys.modules["jax"] = None
        try:
            import ddptrain.jax
        except ImportError as e:
            print("error:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "same: True" in out.stdout
    assert "loaded: []" in out.stdout
    assert "error: ddptrain.jax needs jax" in out.stdout
    assert "pip install ddptrain[jax]" in out.stdout


def test_jax_config_arguments_are_checked(storage: str) -> None:
    from ddptrain.jax import JaxConfig, JaxTrainer
    from ddptrain.torch import TorchConfig

    with pytest.raises(train.ConfigError, match=r"use_tpu=True.*not supported"):
        JaxConfig(use_tpu=True)
    with pytest.raises(train.ConfigError, match="`use_gpu` must be True or False, got 'yes'"):
        JaxConfig(use_gpu="yes")  # type: ignore[arg-type]
    with pytest.raises(train.ConfigError, match="`jax_config` must be a ddptrain.jax.JaxConfig"):
        JaxTrainer(_never_runs, jax_config=TorchConfig())  # type: ignore[arg-type]
    with pytest.raises(train.ConfigError, match=r"JaxConfig\(use_gpu=True\)` but the workers have no GPUs"):
        JaxTrainer(
            _never_runs,
            jax_config=JaxConfig(use_gpu=True),
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hosts_whose_names_do_not_resolve_fail_at_once_saying_what_gloo_needs(netns, storage: str) -> None:
    """Two hosts with their own network stacks and names that resolve nowhere: JAX's gloo could
    not even open its device there ("rv == 0. -3 vs 0" in the first JAX call)."""
    from ddptrain.jax import JaxTrainer

    started = time.monotonic()
    with pytest.raises(train.TrainingFailedError) as info:
        JaxTrainer(
            _never_runs,
            scaling_config=train.ScalingConfig(num_workers=2, hosts=["n0 slots=1", "n1 slots=1"]),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert time.monotonic() - started < 60
    message = str(info.value)
    root = message.splitlines()[1]
    assert "JaxTrainer: the name of host n" in root and "does not resolve to an address" in root
    assert "listens on the address the host name resolves to" in root
    assert f"({netns.hosts[0].addr})" in message or f"({netns.hosts[1].addr})" in message
