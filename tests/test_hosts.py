"""Host lists: the file format, ~/.ssh/config lookups, and placement of ranks on hosts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddptrain.errors import ConfigError
from ddptrain.hosts import HostSpec, parse_hostfile, parse_hosts, place_workers, with_ssh_config


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
