"""`ddptrain run`: Ray Train scripts run unmodified, `import ray...` resolving to ddptrain."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "ray_scripts"
# The subprocesses import the ddptrain these tests import (cwd is the scripts' folder).
ROOT = str(Path(__file__).resolve().parent.parent)


def python_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (extra.pop("PYTHONPATH", ""), ROOT) if p)
    return {**os.environ, **extra, "PYTHONPATH": path}


def ddptrain_run(
    script: str, storage: str, *args: str, timeout_s: float = 240, **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddptrain", "run", str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=SCRIPTS,
        env=python_env(DDPTRAIN_STORAGE_PATH=storage, **env),
    )


@pytest.mark.timeout(300)
def test_the_ray_torch_quickstart_runs_unmodified(storage: str) -> None:
    proc = ddptrain_run("quickstart_torch.py", storage)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank0] {'loss':" in proc.stdout and "'epoch': 1}" in proc.stdout
    assert "loaded the trained model from" in proc.stdout
    [run] = Path(storage).iterdir()
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_000001", "checkpoint_000002"]


@pytest.mark.timeout(300)
def test_the_data_parallel_trainer_examples_run_unmodified(storage: str) -> None:
    proc = ddptrain_run("data_parallel_trainer.py", storage)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    batches = "[[{'item': array([1])}], [{'item': array([2])}], [{'item': array([3])}]]"
    assert f"each worker's batches: {batches}" in proc.stdout
    assert "MY_ENV_VAR on the workers: ['default_value', 'default_value'] initialized: True" in proc.stdout


@pytest.mark.timeout(300)
def test_workers_resolve_ray_in_the_users_own_modules_and_an_installed_ray_is_not_used(
    storage: str, tmp_path: Path
) -> None:
    fake = tmp_path / "site" / "ray"  # a `ray` package that must never be imported
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('the real ray was imported')\n")
    (fake / "train.py").write_text("raise ImportError('the real ray.train was imported')\n")
    proc = ddptrain_run("uses_helper.py", storage, PYTHONPATH=str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "returned: ['ray', 'ray'] metrics: {'rank': 0}" in proc.stdout


@pytest.mark.timeout(300)
def test_processes_multiprocessing_spawns_get_the_ray_names(storage: str) -> None:
    # A spawn Pool, a DataLoader's spawned workers and a forkserver Process, from the script
    # and from a worker: each imports the script's code again, `import ray.train` included.
    proc = ddptrain_run("spawns_processes.py", storage)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "spawn pool: ['ddptrain', 'ddptrain']" in proc.stdout
    assert "spawn loader: [['ddptrain', 0], ['ddptrain', 1], ['ddptrain', 4], ['ddptrain', 9]]" in proc.stdout
    assert "forkserver process: ddptrain" in proc.stdout
    assert "a worker's spawn loader: [['ddptrain', 0], ['ddptrain', 1]]" in proc.stdout


def test_a_pool_whose_workers_cannot_import_the_script_fails_instead_of_hanging(storage: str) -> None:
    proc = ddptrain_run("pool_workers_fail.py", storage, timeout_s=60)
    assert proc.returncode != 0
    assert "No module named 'module_only_the_children_miss'" in proc.stderr
    assert "could not start (see above); the Pool would replace it" in proc.stderr
    assert "KeyboardInterrupt" in proc.stderr  # where the script was: in pool.map


@pytest.mark.timeout(300)
def test_programs_the_script_starts_do_not_get_the_ray_names(storage: str, tmp_path: Path) -> None:
    real = tmp_path / "site" / "ray"  # stands for an installed Ray, which other programs want
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("WHICH = 'the installed ray'\n")
    proc = ddptrain_run("starts_programs.py", storage, PYTHONPATH=str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "script's ray.train: ddptrain" in proc.stdout
    assert "other program's ray: the installed ray" in proc.stdout
    assert "other program's workers' ray: the installed ray" in proc.stdout, proc.stdout


@pytest.mark.timeout(120)
def test_the_hosts_of_ddptrain_run_are_the_scripts_not_its_programs(storage: str, tmp_path: Path) -> None:
    """`--hosts FILE` is for the script's trainers (and its multiprocessing children's); a program
    it starts gets the host list the user gave in the environment, if any."""
    run_hosts, user_hosts = tmp_path / "run_hosts", tmp_path / "user_hosts"
    run_hosts.write_text("runhost0 slots=2\nrunhost1 slots=2\n")
    user_hosts.write_text("userhost slots=4\n")
    env = python_env(DDPTRAIN_STORAGE_PATH=storage)
    env.pop("DDPTRAIN_HOSTFILE", None)
    for user_setting, programs in ((None, "this machine"), (str(user_hosts), "['userhost']")):
        proc = subprocess.run(
            [sys.executable, "-m", "ddptrain", "run", "--hosts", str(run_hosts), str(SCRIPTS / "host_lists.py")],
            capture_output=True,
            text=True,
            timeout=100,
            cwd=SCRIPTS,
            env=env if user_setting is None else {**env, "DDPTRAIN_HOSTFILE": user_setting},
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "script's trainers: ['runhost0', 'runhost1']" in proc.stdout, proc.stdout
        assert "spawn child's trainers: ['runhost0', 'runhost1']" in proc.stdout, proc.stdout
        assert f"other program's trainers: {programs}" in proc.stdout, (user_setting, proc.stdout)


@pytest.mark.timeout(300)
def test_a_ray_tune_sweep_of_a_trainer_runs_unmodified(storage: str) -> None:
    proc = ddptrain_run("tune_trainer.py", storage)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trials: 2 errors: 0" in proc.stdout
    assert "best lr: 0.01 loss: 0.01" in proc.stdout


@pytest.mark.timeout(300)
def test_the_raysgd_guide_runs_with_its_example_helpers(storage: str) -> None:
    proc = ddptrain_run("raysgd_guide.py", storage)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "guide operator batches: [16]" in proc.stdout  # LinearDataset(2, 5): 1000 points, batches of 64
    assert "creators: Linear 0.5 4 8" in proc.stdout and "scheduler: StepLR" in proc.stdout
    assert proc.stdout.endswith("epoch: 1\nprofile:\n  mean_fwd_s: 0.5\n")  # ray.tune.logger.pretty_print


def test_ray_core_apis_fail_with_a_clear_error(storage: str) -> None:
    proc = ddptrain_run("uses_ray_core.py", storage)
    assert proc.returncode == 1
    assert "`ray.remote` is not available under ddptrain" in proc.stderr
    assert "run the work inside the training function" in proc.stderr


def test_script_arguments_exit_codes_and_bad_input(storage: str, tmp_path: Path) -> None:
    script = tmp_path / "args.py"
    script.write_text("import sys, ray.train\nprint(sys.argv[1:], ray.train.__name__)\nsys.exit(int(sys.argv[1]))\n")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ddptrain", *args], capture_output=True, text=True, env=python_env()
        )

    proc = cli("run", str(script), "3", "--flag")
    assert proc.returncode == 3 and "['3', '--flag'] ddptrain" in proc.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "ddptrain", "run", str(tmp_path / "nope.py")], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "no such script" in missing.stderr
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("ddptrain ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["python", "train.py", "--lr", "1"], "without 'python': `ddptrain run train.py --lr 1`"),
        (["."], ". is a folder, not a script: give the Python file to run"),
    ],
    ids=["python-first", "a-folder"],
)
def test_ddptrain_run_on_what_is_not_a_script_says_what_to_type(args: list[str], message: str) -> None:
    """``ddptrain run python train.py`` (as one types ``torchrun``'s) and a folder both said
    "no such script", though the file or folder is there."""
    proc = subprocess.run(
        [sys.executable, "-m", "ddptrain", "run", *args], capture_output=True, text=True, env=python_env(), cwd=ROOT
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("ddptrain run: ") and message in proc.stderr, proc.stderr


def test_the_mapping_aliases_modules_without_renaming_them() -> None:
    code = (
        "from ddptrain import ray_compat; ray_compat.install()\n"
        "import ray, ray.train, ray.train.torch, ray.data, ddptrain, ddptrain.torch\n"
        "from ray.air.config import ScalingConfig\n"
        "assert ray.train is ddptrain and ray.train.torch is ddptrain.torch and ray.data is ddptrain.data\n"
        "assert ddptrain.torch.__spec__.name == 'ddptrain.torch' and ScalingConfig is ddptrain.ScalingConfig\n"
        "assert ray.cluster_resources()['CPU'] >= 1\n"
        "try:\n    import ray.serve\nexcept ModuleNotFoundError as e:\n    print('serve:', e)\n"
        "try:\n    ray.util.state\nexcept AttributeError as e:\n    print('util:', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env())
    assert proc.returncode == 0, proc.stderr
    assert "serve: No module named 'ray.serve'" in proc.stdout
    assert "util: `ray.util.state` is not available" in proc.stdout
