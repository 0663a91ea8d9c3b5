"""How agents start workers: what is loaded before the fork, threads at fork time, and where
ddptrain itself is imported from. CPU proxies of the GPU start path (``DDPTRAIN_WORKER_START``
forces it on a machine without CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain import _env
from ddptrain.torch import TorchTrainer

# A user module of the kind real code has: a CUDA query at its top level, and a record of
# which process imported it and how many threads that process had then.
USER_MODULE = """
import os
import threading
import time

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IMPORTED_IN = os.getpid()
if os.environ.get("START_A_THREAD") == "1":
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()


def train_func():
    import ddptrain as train

    parent = os.getppid()
    return {
        "imported_in": IMPORTED_IN,
        "worker": os.getpid(),
        "agent": parent,
        "agent_threads": len(os.listdir(f"/proc/{parent}/task")),
        "rank": train.get_context().get_world_rank(),
    }
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path / "user_code"
    folder.mkdir()
    name = f"start_probe_{os.getpid()}_{len(os.listdir(tmp_path))}"
    (folder / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    module = __import__(name)
    yield module
    sys.modules.pop(name, None)


def fit(module, storage: str, num_workers: int = 2) -> list[dict]:
    result = TorchTrainer(
        module.train_func,
        scaling_config=train.ScalingConfig(num_workers=num_workers),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    return result.return_values


def test_clean_start_loads_the_users_module_in_each_worker(user_module, storage: str, monkeypatch) -> None:
    monkeypatch.setenv("DDPTRAIN_WORKER_START", "clean")  # what GPU runs use
    values = fit(user_module, storage)
    for out in values:
        assert out["imported_in"] == out["worker"], "the user's module was imported before the fork"
        assert out["agent_threads"] == 1
    assert len({out["worker"] for out in values}) == 2


def test_cpu_runs_share_the_users_imports_across_workers(user_module, storage: str) -> None:
    values = fit(user_module, storage)
    for out in values:
        assert out["imported_in"] == out["agent"]  # loaded once in the agent, before the fork
        assert out["agent_threads"] == 1


def test_a_module_that_starts_a_thread_is_not_loaded_before_a_fork(
    user_module, storage: str, monkeypatch, capfd
) -> None:
    monkeypatch.setenv("START_A_THREAD", "1")
    values = fit(user_module, storage)
    for out in values:
        # The agent found a thread after loading the module, so it replaced itself with a
        # fresh agent and forked from that one: every worker imported the module itself.
        assert out["imported_in"] == out["worker"]
        assert out["agent_threads"] == 1
    assert "started 1 thread(s)" in capfd.readouterr().err


def test_gpu_runs_start_workers_the_clean_way(monkeypatch) -> None:
    monkeypatch.delenv("DDPTRAIN_WORKER_START", raising=False)
    assert _env.worker_start(use_gpu=True) == "clean"
    assert _env.worker_start(use_gpu=False) == "shared"
    monkeypatch.setenv("DDPTRAIN_WORKER_START", "fork please")
    with pytest.raises(ValueError, match="DDPTRAIN_WORKER_START"):
        _env.worker_start(use_gpu=True)


def blas_threads() -> int:
    import ctypes

    import numpy  # noqa: F401  (loads OpenBLAS)

    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "openblas" in line.rsplit("/", 1)[-1]}
    for path in paths:
        library = ctypes.CDLL(path)
        for symbol in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
            getter = getattr(library, symbol, None)
            if getter is not None:
                return int(getter())
    return -1


def test_workers_get_the_blas_threads_their_environment_asks_for(storage: str, monkeypatch) -> None:
    # The agent loads OpenBLAS with one thread (its pool would make the fork unsafe); each
    # worker then gets what OMP_NUM_THREADS says.
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    result = TorchTrainer(
        blas_threads,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_values == [3, 3]


def test_a_ddptrain_planted_in_the_working_directory_is_never_imported(tmp_path: Path, storage: str) -> None:
    # Another user writes packages into a shared directory (think /tmp); the victim runs their
    # own script from there. The agent must not import them.
    shared = tmp_path / "shared"
    marker = tmp_path / "hijacked"
    for package in ("ddptrain", "torch", "numpy", "cloudpickle"):
        (shared / package).mkdir(parents=True)
        (shared / package / "__init__.py").write_text(
            f"open({str(marker)!r}, 'a').write({package!r} + '\\n')\nraise ImportError('planted')\n"
        )
    os.chmod(shared, 0o1777)
    home = tmp_path / "home"
    home.mkdir()
    script = home / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os
            import ddptrain as train
            from ddptrain.torch import TorchTrainer

            def train_func():
                return os.getcwd()

            if __name__ == "__main__":
                result = TorchTrainer(
                    train_func,
                    scaling_config=train.ScalingConfig(num_workers=2),
                    run_config=train.RunConfig(storage_path={storage!r}),
                ).fit()
                print("RESULT", result.return_values)
            """
        )
    )
    proc = subprocess.run([sys.executable, str(script)], cwd=shared, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"RESULT {[str(shared)] * 2}" in proc.stdout  # the workers still run in the driver's directory
    assert not marker.exists(), marker.read_text()


SHADOWS = """
import os
import ddptrain as train
from ddptrain.torch import TorchTrainer

def where():
    import filelock, typing_extensions
    return [getattr(m, "SHADOW", m.__file__) for m in (typing_extensions, filelock)]

if __name__ == "__main__":
    print("DRIVER", where())
    result = TorchTrainer(
        where,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=os.environ["STORAGE"]),
    ).fit()
    print("WORKERS", result.return_values)
"""


def test_workers_import_the_packages_a_pythonpath_folder_shadows_as_the_driver_does(
    tmp_path: Path, storage: str
) -> None:
    # Patched copies of two installed packages, first on PYTHONPATH: typing_extensions (torch
    # imports it, so the agent loads it before the bootstrap arrives) and filelock (imported by
    # the training function). The workers must import the copies, as the driver does.
    import shutil

    import filelock
    import typing_extensions

    shadow = tmp_path / "patched"
    shutil.copytree(os.path.dirname(filelock.__file__), shadow / "filelock")
    shutil.copy(typing_extensions.__file__, shadow / "typing_extensions.py")
    for path in (shadow / "filelock" / "__init__.py", shadow / "typing_extensions.py"):
        path.write_text(path.read_text() + "\nSHADOW = 'patched'\n")
    script = tmp_path / "train.py"
    script.write_text(SHADOWS)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), root]), "STORAGE": storage}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DRIVER ['patched', 'patched']" in proc.stdout, proc.stdout
    assert f"WORKERS {[['patched', 'patched']] * 2}" in proc.stdout, proc.stdout


def test_the_workers_path_is_the_drivers_with_their_own_entries_where_python_put_them() -> None:
    from ddptrain.wire.boot import worker_sys_path

    driver = ["", "/shadow", "/usr/lib/python3", "/venv/site"]
    # The agent's own path: a PYTHONPATH of the workers' environment first, then Python's order.
    own = ["/runtime-env", "/shadow", "/usr/lib/python3", "/venv/site", "/host/extra"]
    assert worker_sys_path(driver, "/work", own) == [
        "/work",
        "/runtime-env",
        "/shadow",
        "/usr/lib/python3",
        "/venv/site",
        "/host/extra",
    ]
    # An agent that found the installation first (before this fix) still gets the driver's order.
    assert worker_sys_path(driver, "/work", ["/venv/site", "/shadow", "/usr/lib/python3"]) == [
        "/work",
        "/shadow",
        "/usr/lib/python3",
        "/venv/site",
    ]


def test_the_fork_probe_reads_a_forked_childs_cuda_state() -> None:
    # CUDA's mark on a process (after `torch.cuda.is_available()`) shows only in its children; a
    # CPU build of torch has none, so a stand-in module answers for the child here.
    from types import SimpleNamespace

    from ddptrain.agent.process import children_cannot_use_cuda

    def built_for_cuda(marked: bool) -> SimpleNamespace:
        parent = os.getpid()
        # True only in a forked child: the parent's own answer would not tell the fork happened.
        return SimpleNamespace(
            version=SimpleNamespace(cuda="12.8"),
            cuda=SimpleNamespace(_is_in_bad_fork=lambda: marked and os.getpid() != parent),
        )

    assert children_cannot_use_cuda(built_for_cuda(True)) is True
    assert children_cannot_use_cuda(built_for_cuda(False)) is False
    import torch

    assert torch.version.cuda is None and children_cannot_use_cuda(torch) is False  # no fork on CPU builds


def test_workers_sharing_a_gpu_get_gloo_and_an_explicit_nccl_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from ddptrain.driver.plan import Plan
    from ddptrain.errors import ConfigError
    from ddptrain.torch.config import _backend_for

    def group(gpus: float, hosts: list[str], workers: int = 2) -> SimpleNamespace:
        scaling = train.ScalingConfig(
            num_workers=workers, use_gpu=True, resources_per_worker={"GPU": gpus}, hosts=hosts
        )
        return SimpleNamespace(plan=Plan(scaling), get_resources_per_worker=lambda: {"GPU": gpus})

    halves = group(0.5, ["localhost slots=2 gpus=0"])
    assert halves.plan.ranks_share_a_gpu
    assert _backend_for(None, halves) == "gloo"
    assert "workers share GPUs" in caplog.text and "NCCL" in caplog.text
    with pytest.raises(ConfigError, match="NCCL refuses two ranks on one GPU"):
        _backend_for("nccl", halves)
    assert _backend_for("gloo", halves) == "gloo"
    whole = group(1, ["localhost slots=2 gpus=0,1"])
    assert not whole.plan.ranks_share_a_gpu and _backend_for(None, whole) == "nccl"
    one_per_host = group(0.5, ["localhost slots=1 gpus=0"], workers=1)  # a half GPU alone on its host
    assert not one_per_host.plan.ranks_share_a_gpu and _backend_for(None, one_per_host) == "nccl"


def _never_runs() -> None:
    raise AssertionError("the training function must not start on a worker that cannot use its GPU")


def test_a_gpu_worker_on_a_host_without_cuda_fails_before_training_naming_the_host(storage: str) -> None:
    # `gpus=` lets `use_gpu=True` start on this CPU-only machine; torch's process group setup
    # then finds no CUDA for the worker's GPU and says so, instead of training on the CPU.
    with pytest.raises(train.TrainingFailedError) as failed:
        TorchTrainer(
            _never_runs,
            scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True, hosts=["localhost gpus=0"]),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    message = str(failed.value)
    assert "was given GPU(s) [0] on host" in message and "CUDA_VISIBLE_DEVICES='0'" in message
    assert "cannot use CUDA there" in message and "use_gpu=False" in message
