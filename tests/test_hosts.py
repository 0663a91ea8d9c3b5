"""Host lists: the file format, ~/.ssh/config lookups, placement of ranks on hosts, and the
GPUs (``gpus=``) each host's workers see."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain.driver.plan import Plan
from ddptrain.errors import ConfigError
from ddptrain.launch.hosts import (
    HostSpec,
    parse_hostfile,
    parse_hosts,
    place_workers,
    visible_gpu_ids,
    with_ssh_config,
)
from ddptrain.launch.ssh import gpu_slots


def test_host_file_with_comments_options_and_blank_lines(tmp_path: Path) -> None:
    file = tmp_path / "hosts"
    file.write_text(
        "# the lab\n\n"
        "gpu-1 slots=4\n"
        "gpu-2   slots=2 user=alice port=2222 python=/opt/venv/bin/python workdir='/srv/my runs'  # second box\n"
        "10.0.0.7\n"
    )
    hosts = parse_hostfile(file)
    assert [h.name for h in hosts] == ["gpu-1", "gpu-2", "10.0.0.7"]
    assert hosts[0].slots == 4
    assert hosts[1] == HostSpec(
        name="gpu-2", slots=2, user="alice", port=2222, python="/opt/venv/bin/python", workdir="/srv/my runs"
    )
    assert hosts[2].slots is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("gpu-1 slots=four", "hosts:1: `slots` must be a whole number, got 'four'"),
        ("gpu-1 cores=2", "hosts:1: unknown option 'cores'"),
        ("gpu-1 slots", "expected `option=value`"),
        ("gpu-1 port=70000", "`port` out of range"),
        ("gpu-1 'unclosed", "cannot parse"),
        ("gpu-1\ngpu-1 slots=2", "listed twice"),
        ("# nothing\n\n", "no hosts listed"),
        ("gpu-1 gpus=0,1,0", "hosts:1: `gpus` lists a GPU id more than once, got '0,1,0'"),
        ("gpu-1 gpus=-1", "hosts:1: `gpus` must be GPU ids: whole numbers >= 0 .*, got '-1'"),
        ("gpu-1 gpus=0,,1", "hosts:1: `gpus` must be GPU ids.*, got '0,,1'"),
        ("gpu-1 gpus=cuda:0", "hosts:1: `gpus` must be GPU ids.*, got 'cuda:0'"),
        ("gpu-1 gpus=GPU-", "hosts:1: `gpus` must be GPU ids.*UUIDs as `nvidia-smi -L` prints them.*, got 'GPU-'"),
        ("gpu-1 slots=1\ngpu-2 gpus=", "hosts:2: expected `option=value`"),
        # Other launchers' `host:slots`: ssh would have taken it for a host name.
        ("gpu-1:4", "hosts:1: 'gpu-1:4' is not a host name .for workers write `gpu-1 slots=4`, for an SSH port"),
        ("alice@gpu-1:2222", "hosts:1: 'gpu-1:2222' is not a host name"),
        ("alice@gpu-1 user=bob", "hosts:1: the user is given twice .alice@ and user=bob."),
        ("@gpu-1", "hosts:1: '@gpu-1' is not a host name .`user@host` needs both"),
    ],
)
def test_bad_host_files_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    file = tmp_path / "hosts"
    file.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        parse_hostfile(file)


def test_missing_host_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Cannot read the host file .*nope"):
        parse_hostfile(tmp_path / "nope")


def test_hosts_as_a_python_list() -> None:
    hosts = parse_hosts(["a slots=2", HostSpec("b", slots=1)])
    assert [(h.name, h.slots) for h in hosts] == [("a", 2), ("b", 1)]
    with pytest.raises(ConfigError, match="non-empty list"):
        parse_hosts([])
    with pytest.raises(ConfigError, match=r"`hosts\[0\]` must be a host name"):
        parse_hosts([3])  # type: ignore[list-item]
    # As in a host file: comments, `user@host`, IPv6 addresses with or without brackets.
    hosts = parse_hosts(["# the boxes", "alice@a slots=2", "[::1] slots=1", "fe80::2"])
    assert [(h.name, h.user, h.slots) for h in hosts] == [("a", "alice", 2), ("::1", None, 1), ("fe80::2", None, None)]


def test_ssh_config_fills_in_what_the_host_list_leaves_out(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Host box\n  HostName 10.1.2.3\n  User bob\n  Port 2200\n  IdentityFile ~/.ssh/lab_key\n")
    host = with_ssh_config(HostSpec("box", port=2222), str(config))
    assert (host.address, host.user, host.port) == ("10.1.2.3", "bob", 2222)
    assert host.key is not None and host.key.endswith("/.ssh/lab_key")
    plain = with_ssh_config(HostSpec("other"), str(config))
    assert (plain.address, plain.user, plain.port) == ("other", None, None)


def test_pack_fills_hosts_in_order_and_spread_deals_round_robin() -> None:
    hosts = [HostSpec("a", slots=2), HostSpec("b", slots=2), HostSpec("c", slots=2)]
    pack = place_workers(hosts, 3, "PACK")
    assert [h.name for h in pack.hosts] == ["a", "b"]
    assert pack.ranks == [[0, 1], [2]]
    spread = place_workers(hosts, 3, "SPREAD")
    assert [h.name for h in spread.hosts] == ["a", "b", "c"]
    assert spread.ranks == [[0], [1], [2]]
    assert spread.node_of(2) == (2, 0)
    assert place_workers(hosts, 5, "SPREAD").ranks == [[0, 1], [2, 3], [4]]


def test_too_few_slots_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"needs 5 slots, but the hosts have 3 \(a=2, b=1\)"):
        place_workers([HostSpec("a", slots=2), HostSpec("b")], 5)


# ----------------------------------------------------------------- gpus=
def test_gpus_lists_the_ids_a_host_lends(tmp_path: Path) -> None:
    file = tmp_path / "hosts"
    file.write_text("box1 gpus=0,1,3\nbox2 slots=1 gpus=2 user=me\n")
    box1, box2 = parse_hostfile(file)
    assert (box1.slots, box1.gpus) == (None, (0, 1, 3))
    assert box2 == HostSpec("box2", slots=1, user="me", gpus=(2,))
    assert parse_hosts(["a gpus=5"])[0].gpus == (5,)
    assert HostSpec("b", gpus=[3, 1]).gpus == (3, 1)  # a list given in Python, kept in its order
    assert parse_hosts(["c"])[0].gpus is None  # every GPU of the host


@pytest.mark.parametrize("gpus", [(0, 0), (-1,), (True,), ("0",), "0,1"])
def test_a_bad_gpus_of_a_host_spec_names_the_host(gpus: object) -> None:
    with pytest.raises(ConfigError, match=r"host 'box': `gpus` (must be GPU ids|lists a GPU id more than once)"):
        HostSpec("box", gpus=gpus)  # type: ignore[arg-type]


_UUID_A = "GPU-3f2a9c1e-0000-4000-8000-000000000001"
_MIG_B = "MIG-77b1c3d4-0000-4000-8000-000000000002"


def test_a_host_lists_its_gpus_by_uuid_and_its_agent_sees_them() -> None:
    # CUDA_VISIBLE_DEVICES takes GPU and MIG UUIDs as nvidia-smi -L prints them; so does `gpus=`.
    (host,) = parse_hosts([f"box gpus={_UUID_A},{_MIG_B},3"])
    assert host.gpus == (_UUID_A, _MIG_B, 3)
    assert HostSpec("box", gpus=[_UUID_A]).gpus == (_UUID_A,)
    plan = Plan(train.ScalingConfig(num_workers=3, use_gpu=True, hosts=[host]))
    assert plan.placement is not None and plan.placement.hosts[0].slots == 3  # one per GPU, no probe
    assert plan.agent_env(remote=True, host=plan.placement.hosts[0])["CUDA_VISIBLE_DEVICES"] == f"{_UUID_A},{_MIG_B},3"


def test_visible_gpu_ids_keep_uuids_and_stop_where_cuda_does() -> None:
    assert visible_gpu_ids("2,5") == [2, 5]
    assert visible_gpu_ids(f"{_UUID_A}, {_MIG_B}") == [_UUID_A, _MIG_B]
    assert visible_gpu_ids("0,2,-1,1") == [0, 2]  # CUDA shows the devices before an invalid entry
    assert visible_gpu_ids("") == [] and visible_gpu_ids(" ") == []


def test_gpus_give_a_host_its_gpu_slots_without_a_probe() -> None:
    # Not a real host: reaching it to count its GPUs would fail.
    unknown = "no-such-host.invalid"
    assert [h.slots for h in gpu_slots([HostSpec(unknown, gpus=(0, 1, 3))], 1)] == [3]
    assert [h.slots for h in gpu_slots([HostSpec(unknown, gpus=(0, 1, 3))], 2)] == [1]
    assert [h.slots for h in gpu_slots([HostSpec(unknown, gpus=(0, 1, 3))], 0.5)] == [6]
    with pytest.raises(ConfigError, match=r"host 'no-such-host.invalid' has no GPU .*\(its `gpus` list lists 1\)"):
        gpu_slots([HostSpec(unknown, gpus=(4,))], 2)


def test_gpus_fewer_than_a_hosts_slots_need_is_an_error_before_anything_starts() -> None:
    assert gpu_slots([HostSpec("box", slots=3, gpus=(0, 1))], 0.5)[0].slots == 3  # 3 halves fit on 2 GPUs
    with pytest.raises(ConfigError, match=r"need 2 GPU\(s\), but its `gpus` lists 1 \(4\)"):
        gpu_slots([HostSpec("box", slots=3, gpus=(4,))], 0.5)
    scaling = train.ScalingConfig(num_workers=2, use_gpu=True, hosts=["box slots=2 gpus=1"])
    with pytest.raises(ConfigError, match=r"host 'box' runs 2 worker\(s\) at 1 GPU\(s\) each, which need 2"):
        Plan(scaling)
    assert Plan(train.ScalingConfig(num_workers=2, hosts=["box slots=2 gpus=1"])).placement is not None  # CPU run


def test_the_agent_of_a_host_with_gpus_sees_only_those() -> None:
    hosts = ["box1 slots=2 gpus=1,3", "box2 slots=1", "localhost slots=1 gpus=2"]
    run_env = {"CUDA_VISIBLE_DEVICES": "7"}
    plan = Plan(train.ScalingConfig(num_workers=4, use_gpu=True, hosts=hosts), env_vars=run_env)
    assert plan.placement is not None
    box1, box2, local = plan.placement.hosts
    assert plan.agent_env(remote=True, host=box1)["CUDA_VISIBLE_DEVICES"] == "1,3"  # the host list wins
    assert plan.agent_env(remote=True, host=box2)["CUDA_VISIBLE_DEVICES"] == "7"  # it says nothing here
    assert plan.agent_env(host=local)["CUDA_VISIBLE_DEVICES"] == "2"
    # Workers index their devices by local rank inside what the agent sees.
    assert [s.devices for s in plan.worker_specs(0, "127.0.0.1", 1) if s.node_rank == 0] == [(0,), (1,)]
    cpu = Plan(train.ScalingConfig(num_workers=4, hosts=hosts), env_vars=run_env)
    assert cpu.agent_env(remote=True, host=box1)["CUDA_VISIBLE_DEVICES"] == "7"  # CPU runs leave GPUs alone


def _gpus_seen(config: dict) -> None:
    rank = train.get_context().get_world_rank()
    # SSH_CONNECTION names the port of the loopback sshd a remote worker came through.
    port = os.environ.get("SSH_CONNECTION", "local").split()[-1]
    from ddptrain import context

    devices = list(context._session.devices)  # what get_devices() would index with CUDA present
    record = {"port": port, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "devices": devices, "env": list(os.environ)}
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(record))


class _SharingBackend(train.Backend):
    share_cuda_visible_devices = True  # as torch's: every worker on a host sees the host's GPUs


class _SharingConfig(train.BackendConfig):
    @property
    def backend_cls(self) -> type[train.Backend]:
        return _SharingBackend


@pytest.mark.ssh
@pytest.mark.timeout(120)
@pytest.mark.parametrize("share", [True, False], ids=["shared-like-torch", "own-gpus"])
def test_workers_on_a_host_with_gpus_see_only_those(ssh, storage: str, tmp_path: Path, share: bool) -> None:
    # A CPU stand-in for a GPU run: DataParallelTrainer's workers touch no CUDA device, so
    # `use_gpu=True` runs here, and each worker tells which GPUs it was let see.
    trainer = train.DataParallelTrainer(
        _gpus_seen,
        train_loop_config={"out": str(tmp_path)},
        backend_config=_SharingConfig() if share else None,
        scaling_config=train.ScalingConfig(
            num_workers=4, use_gpu=True, hosts=["h0 gpus=3,5", "h1 slots=1", "localhost slots=1 gpus=0"]
        ),
        run_config=train.RunConfig(
            storage_path=storage, worker_runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": "7"}}
        ),
    )
    trainer.fit()
    ports = {str(h.port): h.name for h in ssh.hosts}
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    seen = [(ports.get(r["port"], "localhost"), r["gpus"], r["devices"]) for r in records]
    if share:  # torch's way: the host's GPUs, and each worker's device indexes into them
        assert seen == [("h0", "3,5", [0]), ("h0", "3,5", [1]), ("h1", "7", [0]), ("localhost", "0", [0])]
    else:  # every other backend, as in Ray: each worker sees its own GPU only, as device 0
        assert seen == [("h0", "3", [0]), ("h0", "5", [0]), ("h1", "7", [0]), ("localhost", "0", [0])]
    assert all("DDPTRAIN_OWN_GPUS" not in r["env"] for r in records)
