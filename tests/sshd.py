"""Real OpenSSH servers on loopback addresses for the SSH tests.

Each server runs ``/usr/sbin/sshd -D`` as a child of the test process with its own config,
host key and log; a per-session client key is authorized, and the host keys are pinned in a
known_hosts file. ``SetEnv SHLVL=1`` keeps root's shell start-up files out of the way.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = os.environ.get("DDPTRAIN_TEST_SSHD", "/usr/sbin/sshd")

_CONFIG = """\
ListenAddress {addr}
Port {port}
HostKey {dir}/host_key
PidFile {dir}/sshd.pid
AuthorizedKeysFile {authorized}
AuthenticationMethods publickey
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin prohibit-password
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
SetEnv SHLVL=1
ClientAliveInterval 5
ClientAliveCountMax 3
MaxStartups 200:30:400
LogLevel VERBOSE
Subsystem sftp {sftp}
{extra}"""


def why_no_sshd() -> str | None:
    """``None`` when real-SSH tests can run here, else the reason."""
    if not os.path.exists(SSHD):
        return (
            f"{SSHD} not found: the SSH tests need OpenSSH's server "
            "(apt-get install -y --no-install-recommends openssh-server)"
        )
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen not found (apt-get install -y openssh-client)"
    try:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    except OSError as exc:
        return f"cannot create /run/sshd: {exc}"
    return None


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return Path(f"{path}.pub").read_text().strip()


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _pdeathsig() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


@dataclass
class SSHHost:
    """One running sshd."""

    name: str
    addr: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path


class SSHServers:
    """Loopback sshd servers h0, h1, ... on 127.0.0.2, 127.0.0.3, ..."""

    def __init__(self, root: Path, count: int = 3) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd refuses to start without it
        self.client_key = root / "client_key"
        client_pub = _keygen(self.client_key)
        self.authorized = root / "authorized_keys"
        self.authorized.write_text(client_pub + "\n")
        self.known_hosts = root / "known_hosts"
        self.ssh_config = root / "ssh_config"
        self.hosts: list[SSHHost] = []
        known, config = [], []
        for i in range(count):
            host = self._start(f"h{i}", f"127.0.0.{i + 2}")
            self.hosts.append(host)
            pub = (root / host.name / "host_key.pub").read_text().split()
            known.append(f"[{host.addr}]:{host.port} {pub[0]} {pub[1]}")
            config.append(
                f"Host {host.name}\n  HostName {host.addr}\n  Port {host.port}\n  User root\n"
                f"  IdentityFile {self.client_key}\n"
            )
        self.known_hosts.write_text("\n".join(known) + "\n")
        self.ssh_config.write_text("\n".join(config))

    def add_isolated_host(self, name: str, addr: str, hidden: Path) -> SSHHost:
        """A host whose file system does not show ``hidden``: its sshd (and everything started
        through it) runs in its own mount namespace with an empty tmpfs mounted over ``hidden``,
        as on a machine that does not share that storage."""
        return self.add_host(
            name,
            addr,
            wrap=[
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                f'mount -t tmpfs tmpfs "{hidden}" && exec "$0" "$@"',
            ],
        )

    def add_host(
        self, name: str, addr: str, wrap: list[str] | None = None, sftp: str = "internal-sftp", extra: str = ""
    ) -> SSHHost:
        """One more host, known to the SSH config and known_hosts; ``sftp`` is its SFTP server
        command, ``extra`` more sshd_config lines (e.g. a ``ForceCommand``)."""
        host = self._start(name, addr, wrap, sftp, extra)
        self.hosts.append(host)
        pub = (self.root / name / "host_key.pub").read_text().split()
        with open(self.known_hosts, "a") as f:
            f.write(f"[{host.addr}]:{host.port} {pub[0]} {pub[1]}\n")
        with open(self.ssh_config, "a") as f:
            f.write(
                f"\nHost {name}\n  HostName {host.addr}\n  Port {host.port}\n  User root\n"
                f"  IdentityFile {self.client_key}\n"
            )
        return host

    def remove_host(self, host: SSHHost) -> None:
        """Stop one host's sshd and its sessions."""
        stop_hosts([host])
        self.hosts.remove(host)

    def _start(
        self, name: str, addr: str, wrap: list[str] | None = None, sftp: str = "internal-sftp", extra: str = ""
    ) -> SSHHost:
        folder = self.root / name
        folder.mkdir(exist_ok=True)
        if not (folder / "host_key").exists():
            _keygen(folder / "host_key")
        for _ in range(5):
            port = _free_port(addr)
            config = folder / "sshd_config"
            config.write_text(
                _CONFIG.format(addr=addr, port=port, dir=folder, authorized=self.authorized, sftp=sftp, extra=extra)
            )
            log = folder / "sshd.log"
            log.write_text("")
            proc = subprocess.Popen(
                [*(wrap or []), SSHD, "-D", "-E", str(log), "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=_pdeathsig,
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and proc.poll() is None:
                if f"Server listening on {addr} port {port}." in log.read_text():
                    return SSHHost(name, addr, port, proc, log)
                time.sleep(0.01)
            proc.kill()
            proc.wait()
        raise RuntimeError(f"sshd for {name} did not start; see {folder / 'sshd.log'}")

    def ssh_processes(self) -> list[int]:
        """Live processes started through one of our servers (their SSH_CONNECTION names it)."""
        return processes_served_by(self.hosts)

    def close(self) -> None:
        """Stop the servers and every session they started."""
        stop_hosts(self.hosts)


def stop_hosts(hosts: list[SSHHost]) -> None:
    """Kill every process started through these sshd servers, their per-connection sshd
    processes (which outlive the listener), then the listeners."""
    doomed = processes_served_by(hosts) + _children_of({host.proc.pid for host in hosts})
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for host in hosts:
        host.proc.terminate()
    for host in hosts:
        try:
            host.proc.wait(5)
        except subprocess.TimeoutExpired:
            host.proc.kill()
            host.proc.wait()


def processes_served_by(hosts: list[SSHHost]) -> list[int]:
    """Live processes started through these servers: every process an sshd starts carries
    ``SSH_CONNECTION=... <server addr> <server port>`` in its environment, even once orphaned."""
    endpoints = tuple(f" {h.addr} {h.port}".encode() for h in hosts)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(i.startswith(b"SSH_CONNECTION=") and i.endswith(endpoints) for i in env):
            found.append(int(entry.name))
    return found


def _children_of(parents: set[int]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) in parents:
            found.append(int(entry.name))
    return found


def why_no_netns() -> str | None:
    """``None`` when network-namespace hosts can be made here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install -y iproute2 util-linux)"
    if subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True).returncode != 0:
        return "cannot create network namespaces here (unshare --net failed)"
    return None


class NetnsHosts:
    """Hosts with their own network stack and host name: sshd on port 22 inside unnamed network
    namespaces, joined by a bridge ``ddptb<S>`` at 10.77.S.1 (the driver's side). The namespaces
    vanish with their processes; the bridge is deleted on close (and a leftover of a crashed
    run is swept when its subnet is claimed again)."""

    def __init__(
        self,
        servers: SSHServers,
        count: int = 2,
        hidden: dict[int, Path] | None = None,
        sftp: dict[int, str] | None = None,
    ) -> None:
        """``hidden``: host index -> a folder that host does not see (an empty tmpfs over it, as
        in ``SSHServers.add_isolated_host``); ``sftp``: host index -> its SFTP server command."""
        self.servers = servers
        self._hidden = hidden or {}
        self._sftp = sftp or {}
        self.hosts: list[SSHHost] = []
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        for subnet in range(10, 250):
            if f": vt{subnet}x" in links:
                continue  # a veth of an earlier run's namespace, still going away (its sockets closing)
            self.bridge = f"ddptb{subnet}"
            if (
                subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], capture_output=True).returncode
                == 0
            ):
                break
            if not _bridge_in_use(self.bridge):
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
                if (
                    subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], capture_output=True).returncode
                    == 0
                ):
                    break
        else:
            raise RuntimeError("no free subnet for a test bridge")
        subprocess.run(["ip", "link", "set", self.bridge, "alias", f"ddptrain-test pid={os.getpid()}"], check=True)
        self.subnet = subnet
        self.driver_address = f"10.77.{subnet}.1"
        subprocess.run(["ip", "addr", "add", f"{self.driver_address}/24", "dev", self.bridge], check=True)
        subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True)
        known, config = [], []
        for i in range(count):
            name, addr = f"n{i}", f"10.77.{subnet}.{i + 2}"
            host = self._start(name, addr, i)
            self.hosts.append(host)
            pub = (servers.root / name / "host_key.pub").read_text().split()
            known.append(f"{addr} {pub[0]} {pub[1]}")
            config.append(f"Host {name}\n  HostName {addr}\n  User root\n  IdentityFile {servers.client_key}\n")
        with open(servers.known_hosts, "a") as f:
            f.write("\n".join(known) + "\n")
        # First in the file: ssh takes a host's first entry, and an earlier test's hosts of the
        # same names may have had another subnet.
        servers.ssh_config.write_text("\n".join(config) + "\n" + servers.ssh_config.read_text())

    def _start(self, name: str, addr: str, index: int) -> SSHHost:
        folder = self.servers.root / name
        folder.mkdir(exist_ok=True)
        if not (folder / "host_key").exists():
            _keygen(folder / "host_key")
        config = folder / "sshd_config"
        sftp = self._sftp.get(index, "internal-sftp")
        config.write_text(
            _CONFIG.format(addr="0.0.0.0", port=22, dir=folder, authorized=self.servers.authorized, sftp=sftp, extra="")
        )
        log = folder / "sshd.log"
        log.write_text("")
        hidden = self._hidden.get(index)
        isolate = ["--mount", "--propagation", "private"] if hidden else []
        hide = f'mount -t tmpfs tmpfs "{hidden}" && ' if hidden else ""
        proc = subprocess.Popen(
            [
                "unshare",
                "--net",
                "--uts",
                *isolate,
                "sh",
                "-c",
                f'{hide}hostname {name} && ip link set lo up && exec "$0" "$@"',
                SSHD,
                "-D",
                "-E",
                str(log),
                "-f",
                str(config),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_pdeathsig,
        )
        own = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{proc.pid}/ns/net") == own and time.monotonic() < deadline:
            time.sleep(0.01)
        veth = f"vt{self.subnet}x{index}"
        subprocess.run(
            ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(proc.pid)], check=True
        )
        subprocess.run(["ip", "link", "set", veth, "master", self.bridge, "up"], check=True)
        inside = ["nsenter", "-t", str(proc.pid), "-n"]
        subprocess.run([*inside, "ip", "addr", "add", f"{addr}/24", "dev", "eth0"], check=True)
        subprocess.run([*inside, "ip", "link", "set", "eth0", "up"], check=True)
        while time.monotonic() < deadline and proc.poll() is None:
            if "Server listening on 0.0.0.0 port 22." in log.read_text():
                return SSHHost(name, addr, 22, proc, log)
            time.sleep(0.01)
        proc.kill()
        raise RuntimeError(f"sshd in namespace {name} did not start; see {log}")

    def processes(self) -> list[int]:
        """Live processes started through these hosts' sshd (their SSH_CONNECTION names it)."""
        return processes_served_by(self.hosts)

    def set_link(self, index: int, up: bool) -> None:
        """Bring host ``index``'s network link (its ``eth0``) up or down, as a cable pulled."""
        inside = ["nsenter", "-t", str(self.hosts[index].proc.pid), "-n"]
        subprocess.run([*inside, "ip", "link", "set", "eth0", "up" if up else "down"], check=True)

    def close(self) -> None:
        stop_hosts(self.hosts)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _bridge_in_use(bridge: str) -> bool:
    """Whether a test bridge belongs to a live process (its alias names the owner)."""
    out = subprocess.run(["ip", "-o", "link", "show", bridge], capture_output=True, text=True).stdout
    if "pid=" not in out:
        return True
    pid = int(out.split("pid=", 1)[1].split()[0])
    return os.path.exists(f"/proc/{pid}")
