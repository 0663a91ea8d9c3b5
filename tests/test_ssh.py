"""Multi-host runs over real SSH (loopback sshd servers standing in for hosts)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain.hosts import HostSpec
from ddptrain.torch import TorchTrainer

pytestmark = pytest.mark.ssh


def allreduce_on_hosts() -> dict:
    import torch
    import torch.distributed as dist

    ctx = train.get_context()
    total = torch.tensor([float(ctx.get_world_rank() + 1)])
    dist.all_reduce(total)
    print(f"hello from rank {ctx.get_world_rank()}", flush=True)
    train.report({"sum": total.item(), "rank": ctx.get_world_rank()})
    return {
        "ssh": os.environ.get("SSH_CONNECTION", "").split()[2:],
        "node": ctx.get_node_rank(),
        "local": (ctx.get_local_rank(), ctx.get_local_world_size()),
        "env": (os.environ["NODE_RANK"], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"]),
    }


@pytest.mark.timeout(120)
def test_workers_on_two_hosts_train_together(ssh, storage: str, capfd) -> None:
    h0, h1 = ssh.hosts[0], ssh.hosts[1]
    result = TorchTrainer(
        allreduce_on_hosts,
        scaling_config=train.ScalingConfig(num_workers=3, hosts=["h0 slots=2", "h1 slots=2"]),
        run_config=train.RunConfig(name="multi", storage_path=storage),
    ).fit()
    assert result.metrics == {"sum": 6.0, "rank": 0}
    values = result.return_values
    assert [v["ssh"] for v in values] == [[h0.addr, str(h0.port)]] * 2 + [[h1.addr, str(h1.port)]]
    assert [v["node"] for v in values] == [0, 0, 1]
    assert [v["local"] for v in values] == [(0, 2), (1, 2), (0, 1)]
    assert [v["env"][:2] for v in values] == [("0", "0"), ("0", "1"), ("1", "0")]
    out, _ = capfd.readouterr()
    assert "[h0:rank0] hello from rank 0" in out
    assert "[h1:rank2] hello from rank 2" in out
    assert "hello from rank 2" in Path(storage, "multi", "logs", "attempt_0", "rank_2.log").read_text()


def test_hostfile_from_the_environment(ssh, storage: str, tmp_path: Path, monkeypatch) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts, spread\nh1 slots=1\nh2 slots=1\n")
    monkeypatch.setenv("DDPTRAIN_HOSTFILE", str(hostfile))
    result = TorchTrainer(
        allreduce_on_hosts,
        scaling_config=train.ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert [v["ssh"][0] for v in result.return_values] == [ssh.hosts[1].addr, ssh.hosts[2].addr]


def test_unknown_host_key_is_refused(ssh, storage: str, tmp_path: Path, monkeypatch) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    monkeypatch.setenv("DDPTRAIN_SSH_KNOWN_HOSTS", str(empty))
    with pytest.raises(train.LaunchError, match=r"host 'h0' .*unknown host key"):
        TorchTrainer(
            allreduce_on_hosts,
            scaling_config=train.ScalingConfig(num_workers=1, hosts=["h0"]),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()


def test_unreachable_hosts_are_named(ssh, storage: str) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.9", 0))
        port = s.getsockname()[1]
    with pytest.raises(train.LaunchError) as info:
        TorchTrainer(
            allreduce_on_hosts,
            scaling_config=train.ScalingConfig(num_workers=2, hosts=[f"127.0.0.9 port={port}", "ghost.invalid"]),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    message = str(info.value)
    assert f"host '127.0.0.9' (127.0.0.9:{port}): cannot connect" in message
    assert "host 'ghost.invalid' (ghost.invalid:22): cannot connect" in message


def test_missing_python_on_a_host_is_a_clear_error(ssh, storage: str) -> None:
    with pytest.raises(
        train.DdpTrainError, match=r"(?s)on host 'h0' the agent did not start \(exit status 127.*/no/such/python"
    ):
        TorchTrainer(
            allreduce_on_hosts,
            scaling_config=train.ScalingConfig(num_workers=1, hosts=["h0 python=/no/such/python"]),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()


def test_hostile_working_directory(ssh, storage: str, tmp_path: Path) -> None:
    workdir = tmp_path / "dir with spaces 'quotes' $HOME ünïcode"
    workdir.mkdir()
    result = TorchTrainer(
        returns_cwd,
        scaling_config=train.ScalingConfig(num_workers=1, hosts=[HostSpec("h1", slots=1, workdir=str(workdir))]),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_value == str(workdir)


def returns_cwd() -> str:
    return os.getcwd()


def sleeps_after_hello() -> None:
    print("worker up", flush=True)
    import time

    time.sleep(600)


# The training function lives in the script's __main__: it is shipped by value to the hosts.
DRIVER = """
import sys, time
import ddptrain as train

def sleeps_after_hello():
    print("worker up", flush=True)
    time.sleep(600)

if __name__ == "__main__":
    train.DataParallelTrainer(
        sleeps_after_hello,
        scaling_config=train.ScalingConfig(num_workers=2, hosts=["h0 slots=1", "h1 slots=1"]),
        run_config=train.RunConfig(storage_path=sys.argv[1]),
    ).fit()
"""


def start_driver_on_two_hosts(tmp_path: Path, storage: str) -> subprocess.Popen[str]:
    """A driver script in its own process, returned once both remote workers run."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), storage], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    seen = 0
    for line in proc.stdout:
        seen += "worker up" in line
        if seen == 2:
            return proc
    proc.kill()
    raise AssertionError("the remote workers never started")


@pytest.mark.timeout(120)
def test_remote_workers_exit_when_the_driver_is_killed(ssh, storage: str, tmp_path: Path) -> None:
    import time

    proc = start_driver_on_two_hosts(tmp_path, storage)
    assert proc.stdout is not None
    assert len(ssh.ssh_processes()) >= 4  # two agents and two workers, started through sshd
    proc.kill()
    proc.wait()
    proc.stdout.close()
    deadline = time.monotonic() + 10
    while ssh.ssh_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ssh.ssh_processes() == []


def kill_own_agent(config: dict) -> None:
    import signal
    import time

    if train.get_context().get_node_rank() == 1 and config["how"] == "agent":
        os.kill(os.getppid(), signal.SIGKILL)  # the host's agent dies: as if the host went down
    time.sleep(600)


@pytest.mark.timeout(120)
def test_a_host_that_dies_mid_run_fails_the_run_everywhere(ssh, storage: str) -> None:
    import time

    start = time.monotonic()
    with pytest.raises(train.TrainingFailedError) as info:
        train.DataParallelTrainer(
            kill_own_agent,
            train_loop_config={"how": "agent"},
            scaling_config=train.ScalingConfig(num_workers=2, hosts=["h0 slots=1", "h1 slots=1"]),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert "rank 1" in str(info.value)
    assert time.monotonic() - start < 60


def _connection_processes(servers, host) -> list[int]:
    """The per-connection sshd processes serving ``host`` (children of its listener)."""
    from sshd import _children_of

    return _children_of({host.proc.pid})


@pytest.mark.timeout(120)
def test_a_cut_connection_fails_the_run_and_leaves_nothing(ssh, storage: str) -> None:
    import signal
    import threading
    import time

    def cut_when_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len([p for p in ssh.ssh_processes()]) >= 4:
                for pid in _connection_processes(ssh, ssh.hosts[1]):
                    os.kill(pid, signal.SIGKILL)  # the network drops h1's connection
                return
            time.sleep(0.1)

    cutter = threading.Thread(target=cut_when_running, daemon=True)
    cutter.start()
    with pytest.raises(train.TrainingFailedError) as info:
        train.DataParallelTrainer(
            sleeps_after_hello,
            scaling_config=train.ScalingConfig(num_workers=2, hosts=["h0 slots=1", "h1 slots=1"]),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    cutter.join()
    assert "rank(s) [1] on h1 died (connection lost)" in str(info.value)


@pytest.mark.timeout(120)
def test_remote_workers_stop_when_heartbeats_stop(ssh, storage: str, tmp_path: Path, monkeypatch) -> None:
    import signal
    import time

    monkeypatch.setenv("DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S", "2")
    proc = start_driver_on_two_hosts(tmp_path, storage)
    assert proc.stdout is not None
    proc.send_signal(signal.SIGSTOP)  # the driver freezes; its connections stay open
    try:
        deadline = time.monotonic() + 20
        while ssh.ssh_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ssh.ssh_processes() == []
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_ddptrain_check_reports_every_host(ssh, tmp_path: Path) -> None:
    import subprocess
    import sys

    hostfile = tmp_path / "hosts"
    hostfile.write_text("h0 slots=2\nh1 python=/no/such/python\nlocalhost\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ddptrain.cli", "check", str(hostfile)], capture_output=True, text=True, timeout=120
    )
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["host", "ssh", "python"]
    h0 = next(line for line in lines if line.startswith("h0 "))
    assert " ok " in h0 and sys.executable in h0 and "yes" in h0  # reached the driver's port
    h1 = next(line for line in lines if line.startswith("h1 "))
    assert "the probe did not run" in h1
    assert next(line for line in lines if line.startswith("localhost ")).endswith("yes")
    assert proc.returncode == 1
    assert "some hosts are not ready" in proc.stdout


def reads_its_shard() -> list:
    shard = train.get_dataset_shard("train")
    return [int(x) for batch in shard.iter_batches(batch_size=2) for x in batch["id"]]


def test_dataset_shards_reach_remote_workers(ssh, storage: str) -> None:
    result = train.DataParallelTrainer(
        reads_its_shard,
        datasets={"train": train.data.range(6)},
        scaling_config=train.ScalingConfig(num_workers=3, hosts=["localhost slots=1", "h0 slots=1", "h1 slots=1"]),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_values == [[0, 1], [2, 3], [4, 5]]


def test_a_key_the_host_does_not_accept_is_a_clear_error(ssh, storage: str, tmp_path: Path) -> None:
    import subprocess

    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    with pytest.raises(train.LaunchError, match=r"host 'h0' .*authentication failed.*never a password"):
        TorchTrainer(
            allreduce_on_hosts,
            scaling_config=train.ScalingConfig(num_workers=1, hosts=[f"h0 key={key}"]),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()


def test_a_host_with_another_ddptrain_version_is_refused(ssh, storage: str, tmp_path: Path) -> None:
    import sys

    fake = tmp_path / "python-with-old-ddptrain"
    fake.write_text(
        "#!/bin/sh\n"
        f'exec {sys.executable} -c \'import ddptrain, runpy; ddptrain.__version__ = "0.0.1"; '
        'runpy.run_module("ddptrain._agent", run_name="__main__")\'\n'
    )
    fake.chmod(0o755)
    with pytest.raises(
        train.DdpTrainError, match=r"(?s)version mismatch.*ddptrain 0\.0\.1 here, 0\.1\.0 on the driver"
    ):
        TorchTrainer(
            allreduce_on_hosts,
            scaling_config=train.ScalingConfig(num_workers=1, hosts=[f"h0 python={fake}"]),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()


def checkpoint_from_every_rank(config: dict) -> dict:
    import json
    import tempfile

    ctx = train.get_context()
    rank = ctx.get_world_rank()
    sees = os.path.exists(os.path.join(ctx.get_storage().experiment_fs_path, "run.json"))
    start = 0
    if (checkpoint := train.get_checkpoint()) is not None:
        with open(os.path.join(checkpoint.path, f"rank_{rank}.json")) as f:  # this rank's own file
            start = json.load(f)["epoch"] + 1
    for epoch in range(start, config["epochs"]):
        if epoch == config.get("crash_at") and rank == 1 and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()
            os._exit(3)
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, f"rank_{rank}.json"), "w") as f:
                json.dump({"epoch": epoch}, f)
            train.report({"epoch": epoch}, checkpoint=train.Checkpoint.from_directory(d))
    return {"sees_run_dir": sees, "start": start}


_ISOLATED = iter(range(1000))


@pytest.fixture
def isolated(ssh, tmp_path: Path):
    """(storage folder, host name): a host that does not see the folder (own mount namespace)."""
    storage_root = tmp_path / "shared-nowhere"
    storage_root.mkdir()
    name = f"iso{next(_ISOLATED)}"
    host = ssh.add_isolated_host(name, "127.0.0.8", storage_root)
    yield str(storage_root), name
    ssh.remove_host(host)


@pytest.mark.timeout(120)
def test_checkpoints_from_a_host_without_the_storage_are_copied_back(ssh, isolated: tuple[str, str]) -> None:
    storage, iso = isolated
    result = train.DataParallelTrainer(
        checkpoint_from_every_rank,
        train_loop_config={"epochs": 2},
        scaling_config=train.ScalingConfig(num_workers=2, hosts=["localhost slots=1", f"{iso} slots=1"]),
        run_config=train.RunConfig(name="nfs-less", storage_path=storage),
    ).fit()
    assert [v["sees_run_dir"] for v in result.return_values] == [True, False]
    assert sorted(os.listdir(result.checkpoint.path)) == ["rank_0.json", "rank_1.json"]
    assert result.checkpoint.path.startswith(storage)
    assert not os.path.exists(os.path.join(storage, "nfs-less", ".staging"))


@pytest.mark.timeout(120)
def test_a_host_without_the_storage_resumes_from_a_pushed_copy(ssh, isolated: tuple[str, str], tmp_path: Path) -> None:
    storage, iso = isolated
    result = train.DataParallelTrainer(
        checkpoint_from_every_rank,
        train_loop_config={"epochs": 3, "crash_at": 1, "marker": str(tmp_path / "crashed")},
        scaling_config=train.ScalingConfig(num_workers=2, hosts=["localhost slots=1", f"{iso} slots=1"]),
        run_config=train.RunConfig(
            name="restart", storage_path=storage, failure_config=train.FailureConfig(max_failures=1)
        ),
    ).fit()
    assert [v["start"] for v in result.return_values] == [1, 1]
    assert result.metrics == {"epoch": 2}
    assert not list(Path("/tmp").glob(f"ddptrain-{result_run_id(result)}*"))  # the host's copies are gone


def result_run_id(result: train.Result) -> str:
    import json

    return json.loads(Path(result.path, "run.json").read_text())["run_id"]


def test_use_gpu_probes_each_hosts_gpus(ssh, storage: str) -> None:
    with pytest.raises(ValueError, match=r"host 'h0' has no GPU that `use_gpu=True` could use \(nvidia-smi lists 0\)"):
        TorchTrainer(
            allreduce_on_hosts,
            scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True, hosts=["h0"]),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()


@pytest.mark.timeout(120)
def test_py_modules_ship_code_a_host_does_not_have(ssh, isolated: tuple[str, str]) -> None:
    import importlib
    import sys

    storage, iso = isolated
    code = Path(storage, "code")  # inside the folder the isolated host cannot see
    code.mkdir()
    (code / "hidden_helpers.py").write_text("def answer():\n    return 42\n")
    sys.path.insert(0, str(code))
    try:
        hidden_helpers = importlib.import_module("hidden_helpers")
        hosts = ["localhost slots=1", f"{iso} slots=1"]
        with pytest.raises(train.TrainingFailedError, match="No module named 'hidden_helpers'"):
            train.DataParallelTrainer(
                hidden_helpers.answer,
                scaling_config=train.ScalingConfig(num_workers=2, hosts=hosts),
                run_config=train.RunConfig(storage_path=storage),
            ).fit()
        result = train.DataParallelTrainer(
            hidden_helpers.answer,
            scaling_config=train.ScalingConfig(num_workers=2, hosts=hosts),
            run_config=train.RunConfig(storage_path=storage, worker_runtime_env={"py_modules": [hidden_helpers]}),
        ).fit()
        assert result.return_values == [42, 42]
    finally:
        sys.path.remove(str(code))
        sys.modules.pop("hidden_helpers", None)


@pytest.mark.timeout(120)
def test_hosts_with_their_own_network_stacks_train_together(netns, storage: str, capfd) -> None:
    result = TorchTrainer(
        allreduce_on_hosts,
        scaling_config=train.ScalingConfig(num_workers=4, hosts=["n0 slots=2", "n1 slots=2"]),
        run_config=train.RunConfig(name="netns", storage_path=storage),
    ).fit()
    assert result.metrics == {"sum": 10.0, "rank": 0}
    assert [v["ssh"][0] for v in result.return_values] == [netns.hosts[0].addr] * 2 + [netns.hosts[1].addr] * 2
    assert {v["env"][2] for v in result.return_values} == {netns.driver_address}  # the store, across the bridge
    out, _ = capfd.readouterr()
    assert "[n1:rank3] hello from rank 3" in out


def reads_env() -> tuple:
    return os.environ.get("FROM_RUNTIME_ENV"), os.environ.get("MYAPP_TOKEN"), os.environ.get("NOT_FORWARDED")


def test_environment_reaches_remote_workers(ssh, storage: str, monkeypatch) -> None:
    monkeypatch.setenv("MYAPP_TOKEN", "t0k3n")
    monkeypatch.setenv("NOT_FORWARDED", "driver-only")
    monkeypatch.setenv("DDPTRAIN_FORWARD_ENV", "MYAPP_*")
    result = train.DataParallelTrainer(
        reads_env,
        scaling_config=train.ScalingConfig(num_workers=1, hosts=["h0"]),
        run_config=train.RunConfig(
            storage_path=storage, worker_runtime_env={"env_vars": {"FROM_RUNTIME_ENV": "a b'c $X"}}
        ),
    ).fit()
    assert result.return_value == ("a b'c $X", "t0k3n", None)


def test_new_host_keys_are_accepted_only_when_asked(ssh, storage: str, tmp_path: Path, monkeypatch) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    monkeypatch.setenv("DDPTRAIN_SSH_KNOWN_HOSTS", str(empty))
    monkeypatch.setenv("DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS", "1")
    result = train.DataParallelTrainer(
        reads_env,
        scaling_config=train.ScalingConfig(num_workers=1, hosts=["h0"]),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_value[2] is None
