"""Multi-host runs over real SSH (loopback sshd servers standing in for hosts)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from forked_driver import ForkedDriver

import ddptrain as train
from ddptrain.launch.hosts import HostSpec
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
        "ifname": (os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")),
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


def test_a_host_that_refuses_on_stdout_says_why_the_agent_did_not_start(ssh, storage: str, capfd) -> None:
    """A login that ends at once and says why on stdout (a nologin shell's "This account is
    currently not available.", a maintenance ForceCommand): that line, where the agent's pid
    line was expected, was dropped, and the error named only the exit status."""
    refuses = "ForceCommand echo 'This host is closed for maintenance until 18:00.'; exit 1\n"
    host = ssh.add_host("closed", "127.0.0.13", extra=refuses)
    try:
        with pytest.raises(
            train.DdpTrainError,
            match=r"(?s)on host 'closed' the agent did not start \(exit status 1:.*closed for maintenance until 18:00",
        ):
            TorchTrainer(
                allreduce_on_hosts,
                scaling_config=train.ScalingConfig(num_workers=1, hosts=["root@closed"]),  # `user@host`, as in ssh
                run_config=train.RunConfig(storage_path=storage, name="closed"),
            ).fit()
    finally:
        ssh.remove_host(host)
    # The run failed (it was not aborted): `ddptrain runs` and the console say so.
    run = json.loads(Path(storage, "closed", "run.json").read_text())
    assert run["status"] == "ERRORED" and "closed for maintenance" in run["error"], run
    err = capfd.readouterr().err
    assert re.search(r"(?s)ddptrain: run 'closed' failed after .*LaunchError: .*closed for maintenance", err), err


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


def start_driver_on_two_hosts(tmp_path: Path, storage: str) -> ForkedDriver:
    """A driver script in its own process (forked from this one: no torch import of its own),
    returned once both remote workers run."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = ForkedDriver(script, [storage], stderr="inherit")
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


def reports_a_checkpoint_then_waits() -> None:
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "weights.txt").write_text("w")
        train.report({"step": 1}, checkpoint=train.Checkpoint.from_directory(folder))
    time.sleep(600)


@pytest.mark.timeout(120)
def test_a_host_whose_network_goes_away_is_named_and_restarting_fails_fast(
    make_netns, tmp_path: Path, monkeypatch, caplog
) -> None:
    """Issue 23. n1 does not see the run directory, so the driver copies its checkpoint back
    over SFTP; its link goes down as that copy starts (its SFTP server pulls the cable). The
    driver must declare n1 lost within the heartbeat timeout (not wait on the copy for good),
    fail the attempt naming it, let FailureConfig restart, and fail the restart fast because
    n1 is still unreachable: n1 is tried once, for one connect timeout (not again once the
    group is down). Once the link is back, nothing of the run is left on n1."""
    import shutil
    import threading
    import time

    sftp_server = next(p for p in ("/usr/lib/openssh/sftp-server", "/usr/libexec/sftp-server") if os.path.exists(p))
    storage, cut = tmp_path / "runs", tmp_path / "cut"
    storage.mkdir()
    pull_cable = f"touch {cut}; {shutil.which('ip')} link set eth0 down; exec {sftp_server}"
    hosts = make_netns(hidden={1: storage}, sftp={1: pull_cable})
    heartbeat_s, connect_s = 2, 5
    monkeypatch.setenv("DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S", str(heartbeat_s))
    monkeypatch.setenv("DDPTRAIN_SSH_CONNECT_TIMEOUT_S", str(connect_s))
    ended = threading.Event()

    def restore_if_stuck() -> None:  # without the fix the copy waits until the link is back
        if not ended.wait(60):
            hosts.set_link(1, True)

    threading.Thread(target=restore_if_stuck, daemon=True).start()
    try:
        with pytest.raises(train.TrainingFailedError) as caught:
            train.DataParallelTrainer(
                reports_a_checkpoint_then_waits,
                scaling_config=train.ScalingConfig(num_workers=2, hosts=["n0 slots=1", "n1 slots=1"]),
                run_config=train.RunConfig(
                    name="cut", storage_path=str(storage), failure_config=train.FailureConfig(max_failures=1)
                ),
            ).fit()
        took = time.time() - cut.stat().st_mtime
    finally:
        ended.set()
    message = str(caught.value)
    assert re.search(r"host 'n1' stopped answering: nothing came from it for \d+\.\d s", message), message
    # FailureConfig allowed a restart; it failed at once, as n1 is still unreachable.
    assert "The next attempt could not start: host 'n1'" in message, message
    assert "Host 'n1' stopped answering and could not be reached again (tried once" in message, message
    tries = caplog.text.count("could not start the next attempt's agents: host 'n1'")
    assert tries == 1, f"n1 was tried {tries} times"
    # The link's loss, one connect timeout, the teardown (two tries took at least 2 * connect_s).
    assert took < heartbeat_s + 2 * connect_s, f"fit() ended {took:.1f} s after the link went down"
    hosts.set_link(1, True)
    deadline = time.monotonic() + 15
    while hosts.processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hosts.processes() == []  # the agent stopped its workers, and the sessions are gone


def pulls_its_cable_then_floods_its_output() -> None:
    import shutil
    import subprocess
    import time

    if train.get_context().get_node_rank() == 1:
        subprocess.run([shutil.which("ip") or "ip", "link", "set", "eth0", "down"], check=True)
        line = "x" * 1023
        for _ in range(8 * 1024):  # 8 MiB: more than the SSH window, so its agent's pipe fills up
            print(line)
    time.sleep(600)


@pytest.mark.timeout(120)
def test_a_host_cut_off_mid_run_is_named_and_leaves_nothing(netns, storage: str, monkeypatch) -> None:
    """n1's link goes down mid-run while its worker prints a flood (nothing can reach the driver
    and the pipe to sshd fills up): the driver names n1 within the heartbeat timeout, and n1's
    agent stops its workers even though its own writes are stuck."""
    import threading
    import time

    monkeypatch.setenv("DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S", "2")
    ended = threading.Event()

    def restore_if_stuck() -> None:
        if not ended.wait(60):
            netns.set_link(1, True)

    threading.Thread(target=restore_if_stuck, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(train.TrainingFailedError) as caught:
            train.DataParallelTrainer(
                pulls_its_cable_then_floods_its_output,
                scaling_config=train.ScalingConfig(num_workers=2, hosts=["n0 slots=1", "n1 slots=1"]),
                run_config=train.RunConfig(name="flood", storage_path=storage),
            ).fit()
        took = time.monotonic() - started
        assert re.search(r"host 'n1' stopped answering: .*; rank\(s\) \[1\] ran there", str(caught.value))
        assert took < 30, f"fit() took {took:.0f} s"
        deadline = time.monotonic() + 10  # the agent's heartbeat check, then SIGTERM and its grace
        while netns.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert netns.processes() == [], "n1's agent and worker outlived the heartbeat timeout"
    finally:
        ended.set()
        netns.set_link(1, True)


def _cable_pulled_on_n1(marker: str) -> str:
    """Run wherever the training function's config is unpickled: on n1, the first time, its
    link goes down (its agent is loading the training function; its workers do not run yet)."""
    import shutil

    if socket.gethostname() == "n1" and not os.path.exists(marker):
        Path(marker).touch()
        subprocess.run([shutil.which("ip") or "ip", "link", "set", "eth0", "down"], check=True)
    return marker


class PullsTheCableWhenLoaded:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (_cable_pulled_on_n1, (self.marker,))


def returns_host(config: dict) -> str:
    return socket.gethostname()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("moment", ["storage check", "loading"])
def test_a_host_cut_off_while_its_workers_start_is_named_and_used_again_once_back(
    make_netns, tmp_path: Path, monkeypatch, caplog, moment: str
) -> None:
    """Issue 23. n1's link goes down while its workers start: while the driver's storage check
    runs there (its agent is starting), or while its agent loads the training function. The
    driver must name n1 within the heartbeat timeout (not after the agent start, storage check
    or worker start timeouts: 30-60 s here, 60-120 s by default), fail the attempt naming it
    and let FailureConfig restart. n1's link is back as soon as it is named: the restart
    uses it again."""
    import logging
    import shutil
    import threading
    import time

    storage, cut = tmp_path / "runs", tmp_path / "cut"
    hosts = make_netns()
    monkeypatch.setenv("DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S", "2")
    monkeypatch.setenv("DDPTRAIN_WORKER_START_TIMEOUT_S", "30")
    n1, config = "n1 slots=1", {}
    if moment == "loading":
        config["cable"] = PullsTheCableWhenLoaded(str(cut))
    else:  # n1's python pulls the cable (once) when it runs the storage check's code
        code = ".ddptrain-owner"
        pull = f"[ -e {cut} ] || {{ touch {cut}; {shutil.which('ip')} link set eth0 down; }}"
        wrapper = tmp_path / "python"
        wrapper.write_text(f'#!/bin/sh\ncase "$*" in *{code}*) {pull};; esac\nexec {sys.executable} "$@"\n')
        wrapper.chmod(0o755)
        n1 += f" python={wrapper}"
    named: list[float] = []
    caplog.set_level(logging.INFO, logger="ddptrain")  # the restart's record is INFO (the console has it)

    class CableBackOnceNamed(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "nothing came from host 'n1'" in record.getMessage() and not named:
                named.append(time.time())
                hosts.set_link(1, True)

    handler = CableBackOnceNamed()
    logging.getLogger("ddptrain").addHandler(handler)
    ended = threading.Event()

    def restore_if_stuck() -> None:  # without the fix nothing names n1
        if not ended.wait(40):
            hosts.set_link(1, True)

    threading.Thread(target=restore_if_stuck, daemon=True).start()
    try:
        result = train.DataParallelTrainer(
            returns_host,
            train_loop_config=config,
            scaling_config=train.ScalingConfig(num_workers=2, hosts=["n0 slots=1", n1]),
            run_config=train.RunConfig(
                name="cut", storage_path=str(storage), failure_config=train.FailureConfig(max_failures=1)
            ),
        ).fit()
    finally:
        ended.set()
        logging.getLogger("ddptrain").removeHandler(handler)
        hosts.set_link(1, True)
    assert named, "the driver never said that n1 stopped answering"
    took = named[0] - cut.stat().st_mtime
    assert took < 6, f"n1 was named {took:.1f} s after its link went down"
    assert re.search(r"attempt 0 failed \(rank 1 \(host n1, .*host 'n1' stopped answering", caplog.text), caplog.text
    assert result.return_values == ["n0", "n1"]  # the restart ran on n1 again


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


PAUSED_DRIVER = """
import sys, time
import ddptrain as train

def steps():
    for step in range(1000):
        train.report({"step": step})
        print("step", step, flush=True)
        time.sleep(0.1)

if __name__ == "__main__":
    train.DataParallelTrainer(
        steps,
        scaling_config=train.ScalingConfig(num_workers=2, hosts=["h0 slots=1", "h1 slots=1"]),
        run_config=train.RunConfig(storage_path=sys.argv[1]),
    ).fit()
"""


@pytest.mark.timeout(120)
def test_a_driver_that_was_stopped_does_not_blame_its_hosts(ssh, storage: str, tmp_path: Path, monkeypatch) -> None:
    # Ctrl-Z (or SIGSTOP) on the driver, then `fg`: its hosts' agents stopped their workers when
    # its heartbeats stopped. The error said both hosts "stopped answering ... Its network or the
    # machine went away": its own silence read as theirs.
    import signal
    import time

    monkeypatch.setenv("DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S", "2")
    script = tmp_path / "paused.py"
    script.write_text(PAUSED_DRIVER)
    proc = ForkedDriver(script, [storage], stderr="stdout")
    seen = ""
    for line in proc.stdout:
        seen += line
        if "step 3" in line:
            break
    proc.send_signal(signal.SIGSTOP)
    time.sleep(4)  # the agents give up after 2 s without a heartbeat
    proc.send_signal(signal.SIGCONT)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert f"this driver process (pid {proc.pid}) did not run for" in out, seen + out
    assert "stopped answering" not in out and "HostLostError" not in out, out
    # The error says why the agents stopped (it said "died (exit code 0)" and no more).
    assert "it said: ddptrain agent: no heartbeat from the driver for 2 s; stopping); its workers died" in out, out


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


@pytest.mark.timeout(90)
def test_ddptrain_check_names_a_host_whose_network_goes_away_while_probed(make_netns, tmp_path: Path) -> None:
    """n1's link goes down as ddptrain check's probe starts there (its python pulls the
    cable). No heartbeat watches that connection: the kernel must end it (TCP keepalive and
    TCP_USER_TIMEOUT, twice the heartbeat timeout), not the probe's 120 s read timeout."""
    import shutil
    import time

    hosts = make_netns()
    wrapper = tmp_path / "python"
    wrapper.write_text(
        f'#!/bin/sh\ncase "$*" in *DDPTRAIN_CHECK*) {shutil.which("ip")} link set eth0 down;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"n0\nn1 python={wrapper}\n")
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ddptrain.cli", "check", str(hostfile)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S": "2"},
        )
        took = time.monotonic() - started
    finally:
        hosts.set_link(1, True)
    n1 = next(line for line in proc.stdout.splitlines() if line.startswith("n1 "))
    assert "FAILED: the connection was lost while the program ran there" in n1, proc.stdout
    assert next(line for line in proc.stdout.splitlines() if line.startswith("n0 ")).endswith("yes")
    assert proc.returncode == 1
    assert took < 45, f"ddptrain check took {took:.0f} s"  # a read timeout: 120 s (32 s seen under load)


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


def test_a_key_that_needs_a_passphrase_says_to_load_it_into_the_agent(
    ssh, storage: str, tmp_path: Path, monkeypatch
) -> None:
    """ddptrain never asks for a passphrase: a key protected by one (and not in ssh-agent) was
    reported as 'authentication failed (private key file is encrypted)', with the advice to add
    the key to the host's authorized_keys, which cannot help."""
    key = tmp_path / "locked_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "a passphrase", "-f", str(key)], check=True)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    with pytest.raises(train.LaunchError) as caught:
        TorchTrainer(
            allreduce_on_hosts,
            scaling_config=train.ScalingConfig(num_workers=1, hosts=[f"h0 key={key}"]),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    message = str(caught.value)
    assert "host 'h0' " in message and f"the key {key} needs a passphrase" in message, message
    assert f"ssh-add {key}" in message and "authorized_keys" not in message, message


def test_a_host_that_stops_answering_while_logging_in_is_not_called_a_key_problem(
    ssh, storage: str, tmp_path: Path, monkeypatch
) -> None:
    """The host's SSH server never answers the key (it waits on a command that sleeps, as a host
    whose network goes away mid-login): the error says it stopped answering, within the
    connect timeout, rather than telling the user to fix their keys."""
    import time

    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    sleeps = "AuthorizedKeysCommand /usr/bin/sleep 6\nAuthorizedKeysCommandUser root\n"
    host = ssh.add_host("mute", "127.0.0.12", extra=sleeps)
    monkeypatch.setenv("DDPTRAIN_SSH_CONNECT_TIMEOUT_S", "2")
    started = time.monotonic()
    try:
        with pytest.raises(train.LaunchError) as caught:
            train.DataParallelTrainer(
                returns_cwd,
                scaling_config=train.ScalingConfig(num_workers=1, hosts=[f"mute key={key}"]),
                run_config=train.RunConfig(storage_path=storage),
            ).fit()
        took = time.monotonic() - started
    finally:
        ssh.remove_host(host)
    message = str(caught.value)
    assert "host 'mute' (root@127.0.0.12:" in message and "stopped answering while ddptrain logged in" in message
    assert "authorized_keys" not in message, message
    assert took < 6, f"fit() took {took:.1f} s"


def test_a_host_with_another_ddptrain_version_is_refused(ssh, storage: str, tmp_path: Path) -> None:
    import sys

    # A python wrapper (arguments passed through) whose ddptrain says it is another version.
    site = tmp_path / "old-ddptrain-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import ddptrain._version\nddptrain._version.__version__ = "0.0.1"\n')
    fake = tmp_path / "python-with-old-ddptrain"
    fake.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
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


@pytest.mark.timeout(60)
def test_hosts_with_their_own_network_stacks_train_together(netns, storage: str, capfd) -> None:
    """The hosts' names do not resolve and GLOO_SOCKET_IFNAME is not set: gloo must still find
    the bridge (the interface each host's SSH connection arrives on), not fall back to 127.0.0.1."""
    assert subprocess.run(["getent", "hosts", "n0"], capture_output=True).returncode != 0
    result = TorchTrainer(
        allreduce_on_hosts,
        scaling_config=train.ScalingConfig(num_workers=4, hosts=["n0 slots=2", "n1 slots=2"]),
        run_config=train.RunConfig(name="netns", storage_path=storage),
    ).fit()
    assert result.metrics == {"sum": 10.0, "rank": 0}
    assert [v["ssh"][0] for v in result.return_values] == [netns.hosts[0].addr] * 2 + [netns.hosts[1].addr] * 2
    assert {v["env"][2] for v in result.return_values} == {netns.driver_address}  # the store, across the bridge
    assert {v["ifname"] for v in result.return_values} == {("eth0", "eth0")}
    out, _ = capfd.readouterr()
    assert "[n1:rank3] hello from rank 3" in out


def late_collective() -> float:
    import time

    import torch
    import torch.distributed as dist

    if train.get_context().get_world_rank() == 1:
        time.sleep(1.5)  # longer than gloo's timeout while joining (0.4 s here), far shorter than timeout_s
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


@pytest.mark.timeout(60)
def test_the_bound_on_joining_does_not_shorten_collectives(netns, storage: str, monkeypatch) -> None:
    monkeypatch.setenv("DDPTRAIN_STORE_CONNECT_TIMEOUT_S", "2")
    result = TorchTrainer(
        late_collective,
        scaling_config=train.ScalingConfig(num_workers=2, hosts=["n0 slots=1", "n1 slots=1"]),
        run_config=train.RunConfig(name="late", storage_path=storage),
    ).fit()
    assert result.return_values == [2.0, 2.0]


@pytest.mark.timeout(60)
def test_gloo_that_cannot_reach_the_other_hosts_fails_in_seconds_naming_host_and_fix(
    netns, storage: str, monkeypatch
) -> None:
    """The user's own GLOO_SOCKET_IFNAME wins over the automatic choice; when it names an
    interface the other hosts cannot reach (here loopback), fit() fails within the store
    timeout, not gloo's 30 minutes, and says which host and what to set."""
    import time

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("DDPTRAIN_STORE_CONNECT_TIMEOUT_S", "5")
    started = time.monotonic()
    with pytest.raises(train.TrainingFailedError) as caught:
        TorchTrainer(
            allreduce_on_hosts,
            scaling_config=train.ScalingConfig(num_workers=2, hosts=["n0 slots=1", "n1 slots=1"]),
            run_config=train.RunConfig(name="unreachable", storage_path=storage),
        ).fit()
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert re.search(r"gloo on host n[01] \(GLOO_SOCKET_IFNAME=lo\) could not connect", message), message
    assert "set GLOO_SOCKET_IFNAME to the network interface" in message, message
    assert elapsed < 30, f"failed after {elapsed:.0f} s"


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


# ----------------------------------------------------------------- hardening (issue 9)
def test_forwarded_values_are_never_on_a_command_line(ssh, storage: str, tmp_path: Path, monkeypatch) -> None:
    """What `ps` on a host shows of the commands ddptrain runs there holds no forwarded value."""
    import uuid

    commands = tmp_path / "commands.log"
    logger = tmp_path / "log-command"  # the host runs every command through it: a record of what `ps` saw
    logger.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$SSH_ORIGINAL_COMMAND" >> {commands}\nexec "$SHELL" -c "$SSH_ORIGINAL_COMMAND"\n'
    )
    logger.chmod(0o755)
    host = ssh.add_host("cmdlog", "127.0.0.10", extra=f"ForceCommand {logger}\n")
    token, hf_token = uuid.uuid4().hex, uuid.uuid4().hex
    monkeypatch.setenv("MYAPP_TOKEN", token)
    monkeypatch.setenv("HF_TOKEN", hf_token)  # forwarded by default
    monkeypatch.setenv("DDPTRAIN_FORWARD_ENV", "MYAPP_*")
    try:
        result = train.DataParallelTrainer(
            reads_env,
            scaling_config=train.ScalingConfig(num_workers=1, hosts=["cmdlog"]),
            run_config=train.RunConfig(
                storage_path=storage, worker_runtime_env={"env_vars": {"FROM_RUNTIME_ENV": "x=y"}}
            ),
        ).fit()
    finally:
        ssh.remove_host(host)
    assert result.return_value == ("x=y", token, None)
    seen = commands.read_text()
    assert "ddptrain" in seen  # the agent was started through the logger
    assert token not in seen and hf_token not in seen and "FROM_RUNTIME_ENV" not in seen


def test_env_frame_carries_any_value_and_refuses_what_env_cannot_hold() -> None:
    from ddptrain.errors import ConfigError
    from ddptrain.launch.host_scripts import env_frame

    frame = env_frame({"B": "a b'c $X\nü", "A": ""})
    assert frame == len(frame[4:]).to_bytes(4, "big") + b"A=\0B=" + "a b'c $X\nü".encode()
    for bad in ({"": "x"}, {"A=B": "x"}, {"A": "x\0y"}):
        with pytest.raises(ConfigError, match="cannot be passed to a host"):
            env_frame(bad)


def test_fetched_names_must_stay_inside_the_destination(ssh, tmp_path: Path) -> None:
    """A host that lists `../escape` (a lying SFTP server) cannot make the driver write outside."""
    from ddptrain.errors import LaunchError
    from ddptrain.launch.hosts import with_ssh_config
    from ddptrain.launch.ssh import SSHLauncher

    sftp_server = next(
        (p for p in ("/usr/lib/openssh/sftp-server", "/usr/libexec/sftp-server") if os.path.exists(p)), None
    )
    if sftp_server is None:
        pytest.skip("OpenSSH's sftp-server not found")
    liar = Path(__file__).with_name("lying_sftp.py")
    host = ssh.add_host("liar", "127.0.0.11", sftp=f"{sys.executable} {liar} {sftp_server} escape ../escape")
    remote, local = tmp_path / "remote", tmp_path / "local"
    (remote / "clean").mkdir(parents=True)
    (remote / "clean" / "model.pt").write_text("weights")
    (remote / "evil").mkdir()
    (remote / "evil" / "escape").write_text("listed as ../escape")
    (remote / "escape").write_text("what ../escape names on the host")
    launcher = None
    try:
        launcher = SSHLauncher(with_ssh_config(HostSpec("liar"), str(ssh.ssh_config)), {}, sys.executable, None)
        launcher.fetch_dir(0, str(remote / "clean"), str(local / "clean"))  # an honest listing: copied, then removed
        assert (local / "clean" / "model.pt").read_text() == "weights"
        assert not (remote / "clean").exists()
        with pytest.raises(LaunchError, match=r"host 'liar' listed '\.\./escape' .*not a plain file name"):
            launcher.fetch_dir(0, str(remote / "evil"), str(local / "evil"))
        assert not (local / "escape").exists()
        assert (remote / "evil" / "escape").exists()  # nothing deleted on the host either
    finally:
        if launcher is not None:
            launcher.shutdown(0)
        ssh.remove_host(host)


def test_only_plain_names_are_fetched() -> None:
    from ddptrain.launch.ssh_files import _child_path

    assert _child_path("/dst", "rank_0.pt") == "/dst/rank_0.pt"
    assert _child_path("/dst", "..hidden") == "/dst/..hidden"
    for name in ("", ".", "..", "../x", "/etc/passwd", "a/../../b", "a\0b"):
        assert _child_path("/dst", name) is None


def _h0(ssh) -> HostSpec:
    from ddptrain.launch.hosts import with_ssh_config

    return with_ssh_config(HostSpec("h0"), str(ssh.ssh_config))


def _host_key_line(ssh, name: str) -> str:
    return next(line for line in ssh.known_hosts.read_text().splitlines() if line.startswith(f"[{_addr(ssh, name)}]"))


def _addr(ssh, name: str) -> str:
    return next(h.addr for h in ssh.hosts if h.name == name)


def test_cert_authority_and_revoked_lines_are_understood(ssh, tmp_path: Path, monkeypatch) -> None:
    from ddptrain.launch.ssh_connect import connect

    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    other_key = " ".join(Path(f"{other}.pub").read_text().split()[:2])
    h0_line = _host_key_line(ssh, "h0")
    known = tmp_path / "known_hosts"
    monkeypatch.setenv("DDPTRAIN_SSH_KNOWN_HOSTS", str(known))
    # Markers in the file: every host that has its own key line still connects.
    known.write_text(f"# ours\n@cert-authority *.example.org {other_key}\n@revoked * {other_key}\n{h0_line}\n")
    connect(_h0(ssh), 10).close()
    # A revoked key is refused, even where a line also lists it as valid, even when accepting new keys.
    h0_key = " ".join(h0_line.split()[1:3])
    known.write_text(f"@revoked * {h0_key}\n{h0_line}\n")
    monkeypatch.setenv("DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS", "1")
    with pytest.raises(train.LaunchError, match=r"host 'h0' .*marked @revoked in .*refusing to connect"):
        connect(_h0(ssh), 10)
    # A host known only through a certificate authority is unknown, and the error says why.
    monkeypatch.delenv("DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS")
    known.write_text(f"@cert-authority * {other_key}\n")
    with pytest.raises(train.LaunchError, match=r"unknown host key.*1 @cert-authority line\(s\) were skipped"):
        connect(_h0(ssh), 10)


def test_accepting_a_new_host_key_only_appends_to_known_hosts(ssh, tmp_path: Path, monkeypatch) -> None:
    from ddptrain.launch.ssh_connect import connect

    known = tmp_path / "known_hosts"
    original = f"# my comment, kept\n\n{_host_key_line(ssh, 'h1')}  # h1, with a trailing comment"  # no final newline
    known.write_text(original)
    monkeypatch.setenv("DDPTRAIN_SSH_KNOWN_HOSTS", str(known))
    monkeypatch.setenv("DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS", "1")
    connect(_h0(ssh), 10).close()
    assert known.read_text() == original + "\n" + _host_key_line(ssh, "h0") + "\n"
    monkeypatch.delenv("DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS")
    connect(_h0(ssh), 10).close()  # the appended key is trusted from now on
    fresh = tmp_path / "new" / "known_hosts"  # no file yet: created, private
    monkeypatch.setenv("DDPTRAIN_SSH_KNOWN_HOSTS", str(fresh))
    monkeypatch.setenv("DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS", "1")
    connect(_h0(ssh), 10).close()
    assert fresh.read_text() == _host_key_line(ssh, "h0") + "\n"
    assert fresh.stat().st_mode & 0o777 == 0o600


def returns_ddptrain_file() -> str:
    import ddptrain

    return ddptrain.__file__


def shadowed_filelock() -> str:
    import filelock

    return getattr(filelock, "SHADOW", filelock.__file__)


@pytest.mark.timeout(120)
def test_workers_on_every_host_import_what_a_pythonpath_folder_shadows(
    ssh, storage: str, tmp_path: Path, monkeypatch
) -> None:
    """A patched copy of an installed package, first on the driver's PYTHONPATH (forwarded to
    the hosts): the workers import it, on this machine and on an SSH host, as the driver does."""
    import shutil

    import filelock

    shadow = tmp_path / "patched"
    shutil.copytree(os.path.dirname(filelock.__file__), shadow / "filelock")
    init = shadow / "filelock" / "__init__.py"
    init.write_text(init.read_text() + "\nSHADOW = 'patched'\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.syspath_prepend(str(shadow))  # where a driver started with that PYTHONPATH has it
    result = train.DataParallelTrainer(
        shadowed_filelock,
        scaling_config=train.ScalingConfig(num_workers=2, hosts=["localhost slots=1", "h0 slots=1"]),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_values == ["patched", "patched"]


@pytest.mark.timeout(180)
def test_ddptrain_run_gives_the_ray_names_to_workers_on_ssh_hosts(ssh, storage: str, tmp_path: Path) -> None:
    import json

    scripts = Path(__file__).resolve().parent / "ray_scripts"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h0 slots=2\n")
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run(
        [sys.executable, "-m", "ddptrain", "run", "--hosts", str(hostfile), str(scripts / "uses_helper.py")],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=scripts,  # the host's working directory too: the workers import helper_module from there
        env={**os.environ, "PYTHONPATH": root, "DDPTRAIN_STORAGE_PATH": storage},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "returned: ['ray', 'ray'] metrics: {'rank': 0}" in proc.stdout
    [run] = Path(storage).iterdir()
    assert json.loads((run / "run.json").read_text())["hosts"] == ["h0"]  # the workers ran there


@pytest.mark.timeout(120)
def test_check_probes_what_a_run_uses(ssh, storage: str, tmp_path: Path, monkeypatch) -> None:
    """A host python without ddptrain installed, which gets it from a PYTHONPATH relative to the
    run's working directory: `ddptrain check` agrees with a run that works there, and neither
    imports the `ddptrain/` someone planted in that working directory."""
    import site

    import ddptrain

    venv = tmp_path / "venv-without-ddptrain"  # torch and the rest, but not ddptrain
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    packages = next(venv.glob("lib/python*/site-packages"))
    (packages / "driver_packages.pth").write_text(site.getsitepackages()[0] + "\n")
    python = str(venv / "bin" / "python")
    without_pythonpath = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert (
        subprocess.run(
            [python, "-c", "import ddptrain"], capture_output=True, cwd=tmp_path, env=without_pythonpath
        ).returncode
        == 1
    )
    workdir = tmp_path / "work dir"
    (workdir / "ddptrain").mkdir(parents=True)
    (workdir / "ddptrain" / "__init__.py").write_text('__version__ = "6.6.6"\n')  # planted
    (workdir / "src").symlink_to(Path(ddptrain.__file__).parent.parent)
    monkeypatch.setenv("PYTHONPATH", "src")  # forwarded; relative to the working directory
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"h0 python={python} workdir='{workdir}'\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ddptrain.cli", "check", str(hostfile)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    h0 = next(line for line in proc.stdout.splitlines() if line.startswith("h0 "))
    assert f" {ddptrain.__version__} " in h0 and "missing" not in h0 and "6.6.6" not in h0, proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = train.DataParallelTrainer(
        returns_ddptrain_file,
        scaling_config=train.ScalingConfig(num_workers=1, hosts=[HostSpec("h0", python=python, workdir=str(workdir))]),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_value == str(workdir / "src" / "ddptrain" / "__init__.py")


def staging_folders() -> dict[str, int]:
    """The /tmp/ddptrain-* folders this host has, with their modes."""
    return {p.name: p.stat().st_mode & 0o777 for p in Path("/tmp").glob("ddptrain-*") if p.is_dir()}


STAGING_DRIVER = """
import sys, tempfile, time
from pathlib import Path
import ddptrain as train

def checkpoints_then_sleeps():
    with tempfile.TemporaryDirectory() as d:
        Path(d, "w.txt").write_text("w")
        train.report({"step": 0}, checkpoint=train.Checkpoint.from_directory(d))
    print("worker up", flush=True)
    time.sleep(600)

if __name__ == "__main__":
    train.DataParallelTrainer(
        checkpoints_then_sleeps,
        scaling_config=train.ScalingConfig(num_workers=1, hosts=[sys.argv[2]]),
        run_config=train.RunConfig(name="killed", storage_path=sys.argv[1]),
    ).fit()
"""


@pytest.mark.timeout(120)
def test_a_killed_drivers_staging_folder_is_removed_by_the_next_run(
    ssh, isolated: tuple[str, str], tmp_path: Path
) -> None:
    import json
    import time

    storage, iso = isolated
    before = set(staging_folders())
    script = tmp_path / "driver.py"
    script.write_text(STAGING_DRIVER)
    proc = ForkedDriver(script, [storage, iso], stderr="inherit")  # a driver process of its own
    try:
        assert any("worker up" in line for line in proc.stdout)
        run_id = json.loads(Path(storage, "killed", "run.json").read_text())["run_id"]
        stale = f"ddptrain-{run_id}"
        assert stale in set(staging_folders()) - before  # made on the host for this run
    finally:
        proc.kill()  # SIGKILL: no chance to clean up
        proc.wait()
        proc.stdout.close()
    deadline = time.monotonic() + 20
    while ssh.ssh_processes() and time.monotonic() < deadline:  # the host's agent and worker end
        time.sleep(0.1)
    # It stays behind until a run on that host starts (under -n, another test's run may be that one).
    result = train.DataParallelTrainer(
        staging_folders,
        scaling_config=train.ScalingConfig(num_workers=1, hosts=[iso]),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    seen = result.return_value
    assert stale not in seen  # the next run on that host removed it
    assert seen[f"ddptrain-{result_run_id(result)}"] == 0o700  # and its own is private
    assert not Path("/tmp", stale).exists()


def report_store_port() -> None:
    train.report({"port": int(os.environ["MASTER_PORT"])})


class _StoreListeners(train.UserCallback):
    """Runs in the driver: where the store listens, seen while the run is live."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def after_report(self, run_context, metrics, checkpoint) -> None:
        from test_store_security import _listen_addresses

        self.seen.append(_listen_addresses(metrics[0]["port"]))


@pytest.mark.timeout(60)
def test_a_multi_host_store_listens_only_where_the_hosts_reach_it(netns, storage: str) -> None:
    listeners = _StoreListeners()
    train.DataParallelTrainer(
        report_store_port,
        scaling_config=train.ScalingConfig(num_workers=2, hosts=["n0 slots=1", "n1 slots=1"]),
        run_config=train.RunConfig(storage_path=storage, callbacks=[listeners]),
    ).fit()
    assert listeners.seen == [[netns.driver_address]]  # not every interface, not loopback


def test_a_storage_check_killed_on_a_host_is_a_failure_that_is_retried(ssh, storage: str, tmp_path: Path) -> None:
    """The check whether a host sees the run directory was SIGKILLed there (by an OOM killer,
    say): the run ended at once with "cannot prepare its storage: ''". It is now a failure of
    the attempt, named as a kill, and the next attempt runs."""
    killed = tmp_path / "killed"
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *.ddptrain-owner*) [ -e {killed} ] || {{ touch {killed}; kill -9 $$; }};; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    result = train.DataParallelTrainer(
        returns_host,
        scaling_config=train.ScalingConfig(num_workers=1, hosts=[f"h0 python={wrapper}"]),
        run_config=train.RunConfig(
            name="check", storage_path=storage, failure_config=train.FailureConfig(max_failures=1)
        ),
    ).fit()
    assert killed.exists() and result.return_values == [socket.gethostname()]
    errors = json.loads((Path(storage) / "check" / "run.json").read_text())["attempt_errors"]
    assert len(errors) == 1 and "its storage check was killed before it answered" in str(errors[0]), errors


def leaves_its_agents_pid_then_waits(config: dict) -> None:
    """Node 1 leaves its agent's pid in a file; every rank waits until the test stops it."""
    import time

    if train.get_context().get_node_rank() == 1:
        Path(config["agent"]).write_text(str(os.getppid()))
    time.sleep(120)


@pytest.mark.timeout(120)
def test_a_stopped_agent_on_a_host_is_named_not_blamed_on_the_network(
    ssh, storage: str, tmp_path: Path, monkeypatch
) -> None:
    # A SIGSTOP to h1's agent: it sends nothing, and the host was declared lost with "Its network
    # or the machine went away" while its SSH server answered all along.
    import signal
    import threading
    import time

    monkeypatch.setenv("DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S", "2")
    agent_file = tmp_path / "agent"
    agent = 0

    def stop_the_agent() -> None:
        nonlocal agent
        deadline = time.monotonic() + 60
        while (not agent_file.exists() or not agent_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if agent_file.exists():
            agent = int(agent_file.read_text())
            os.kill(agent, signal.SIGSTOP)

    stopper = threading.Thread(target=stop_the_agent, daemon=True)
    stopper.start()
    try:
        with pytest.raises(train.TrainingFailedError) as info:
            train.DataParallelTrainer(
                leaves_its_agents_pid_then_waits,
                train_loop_config={"agent": str(agent_file)},
                scaling_config=train.ScalingConfig(num_workers=2, hosts=["h0 slots=1", "h1 slots=1"]),
                run_config=train.RunConfig(storage_path=storage),
            ).fit()
    finally:
        stopper.join(60)
        if agent:
            os.kill(agent, signal.SIGCONT)  # it sees its connection gone and stops its workers
    message = str(info.value)
    assert agent and f"ddptrain agent (pid {agent}) on host 'h1' is stopped by a signal" in message, message
    assert f"kill -CONT {agent}" in message and "network" not in message, message
