"""A real SLURM cluster on this one machine for the SLURM tests: munged, slurmctld and one slurmd
per node, each daemon in its own network, host-name and mount namespace.

Layout (S: the first free number from 101; the 10.79.S.0/24 subnet and names ``ddpsl<S>*`` are
this test bed's own, apart from the SSH tests' 10.77.x hosts)::

    login side (the tests, srun/sbatch/salloc)  root namespaces, bridge ddpsl<S> = 10.79.S.1
    controller "ctl"                            netns ddpsl<S>c,  10.79.S.2, slurmctld :6817
    node "n<i>"                                 netns ddpsl<S>n<i>, 10.79.S.(10+i), slurmd :6818
    munged                                      root namespace, its socket a file under the root

Inside ctl and the nodes, the test bed's ``hosts`` file is mounted over /etc/hosts (n0, n1, ctl
and ``login`` resolve there); the machine's own /etc/hosts is never changed. The nodes share the
file system (like a shared home) and the process id space.

The daemons are started without the test session's tag (``conftest.TAG_VAR``), so the leftover
check of each test does not count them; what a test starts through ``srun``/``sbatch``/``salloc``
carries the tag (SLURM exports the submitter's environment), so the check sees it if it is left.
``close`` kills everything inside the test bed's namespaces, then the daemons, then deletes the
namespaces and the bridge: nothing is left behind.

``cred_expire=5`` (default 120 s): a requeued job waits that long before it starts again.

Learnt from ``shared/reference/slurm-testbed.md``: ``nsenter --net``, never ``ip netns exec`` (which
remounts /sys and hides the cgroup tree slurmd needs); slurmctld needs its own host name ``ctl``;
srun and slurmstepd without their daemons ignore SIGTERM, so stopping ends with SIGKILL.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["SlurmCluster", "why_no_slurm"]

_DAEMONS = ("munged", "slurmctld", "slurmd")
_CONF = """\
ClusterName=ddptest
SlurmctldHost=ctl({net}.2)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=4
"""


def why_no_slurm() -> str | None:
    """``None`` when the SLURM test bed can run here, else the reason."""
    if os.geteuid() != 0:
        return "the SLURM test bed needs root (network namespaces, slurmd)"
    for tool in ("slurmctld", "slurmd", "srun", "sbatch", "salloc", "scontrol", "munged", "ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install -y --no-install-recommends slurm-wlm munge iproute2 util-linux)"
    if not os.path.isdir("/sys/fs/cgroup") or not os.listdir("/sys/fs/cgroup"):
        return "/sys/fs/cgroup is not mounted: slurmd does not start without it"
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=False)


class SlurmCluster:
    """A running test cluster of ``nodes`` nodes of ``cpus`` CPUs each, its files under ``root``.

    ``env`` holds ``SLURM_CONF``: set it for ``srun``, ``sbatch``, ``salloc`` and ``scontrol``.
    """

    def __init__(self, root: Path, nodes: int = 2, cpus: int = 2, tag_var: str = "DDPTRAIN_TEST_TAG") -> None:
        self.root = root
        self.node_names = [f"n{i}" for i in range(nodes)]
        self.cpus = cpus
        self._daemon_env = {k: v for k, v in os.environ.items() if k != tag_var}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._netns: list[str] = []
        self._veths: list[str] = []
        self.bridge: str | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def node_address(self, node: str) -> str:
        return f"{self.net}.{10 + self.node_names.index(node)}"

    # ----------------------------------------------------------------- start
    def _claim_subnet(self) -> None:
        taken = _run("ip", "-4", "-o", "addr").stdout
        for subnet in range(101, 251):
            bridge = f"ddpsl{subnet}"
            if f" 10.79.{subnet}." in taken:
                continue
            if _run("ip", "link", "add", bridge, "type", "bridge").returncode == 0:  # atomic: ours now
                self.bridge, self.subnet, self.net = bridge, subnet, f"10.79.{subnet}"
                _run("ip", "link", "set", bridge, "alias", f"ddptrain-slurm-test pid={os.getpid()}")
                return
            if _stale(bridge):  # a crashed test session's: take it over
                _run("ip", "link", "del", bridge)
                for name in _run("ip", "netns", "list").stdout.split():
                    if name.startswith(bridge):
                        _run("ip", "netns", "del", name)
                if _run("ip", "link", "add", bridge, "type", "bridge").returncode == 0:
                    self.bridge, self.subnet, self.net = bridge, subnet, f"10.79.{subnet}"
                    _run("ip", "link", "set", bridge, "alias", f"ddptrain-slurm-test pid={os.getpid()}")
                    return
        raise RuntimeError("no free subnet for the SLURM test bed (10.79.101-250.0/24)")

    def _add_netns(self, name: str, address: str) -> None:
        for args in (
            ("ip", "netns", "add", name),
            ("ip", "link", "add", f"{name}r", "type", "veth", "peer", "name", "eth0", "netns", name),
            ("ip", "link", "set", f"{name}r", "master", str(self.bridge), "up"),
            ("ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0"),
            ("ip", "-n", name, "link", "set", "eth0", "up"),
            ("ip", "-n", name, "link", "set", "lo", "up"),
        ):
            done = _run(*args)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(args)} failed: {done.stderr.strip()}")
            if args[1:3] == ("netns", "add"):
                self._netns.append(name)
            elif args[1:3] == ("link", "add"):
                self._veths.append(f"{name}r")

    def _spawn(self, name: str, argv: list[str], netns: str | None = None, hostname: str | None = None) -> None:
        if netns is not None:  # exec all the way down: the Popen's pid is the daemon's
            argv = [
                "nsenter",
                f"--net=/run/netns/{netns}",
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "slave",
                "sh",
                "-c",
                'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"',
                "sh",
                str(hostname),
                str(self.root / "hosts"),
                *argv,
            ]
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (the daemon holds it)
        with log:
            self._procs[name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self._daemon_env, start_new_session=True
            )

    def _wait(self, what: str, ready: object, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"SLURM test bed: {name} exited ({proc.returncode}); see {self.root / 'log'}")
            if ready():  # type: ignore[operator]
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM test bed: no {what} after {timeout_s:g} s; see {self.root / 'log'}")
            time.sleep(0.05)

    def _start(self) -> None:
        root = self.root
        for sub in ("munge", "state", "log", "run", *(f"spool/{n}" for n in self.node_names)):
            (root / sub).mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)  # munged wants its socket's folder traversable
        self._claim_subnet()
        net = self.net
        hosts = ["127.0.0.1 localhost", f"{net}.1 login", f"{net}.2 ctl"]
        hosts += [f"{self.node_address(n)} {n}" for n in self.node_names]
        (root / "hosts").write_text("\n".join(hosts) + "\n")
        mem = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) // 1024
        conf = _CONF.format(net=net, root=root)
        for node in self.node_names:
            conf += (
                f"NodeName={node} NodeHostname={node} NodeAddr={self.node_address(node)} CPUs={self.cpus} "
                f"Sockets=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory={mem} State=UNKNOWN\n"
            )
        conf += "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        self.conf.write_text(conf)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        socket_path = root / "munge" / "munge.socket"
        self._spawn(
            "munged",
            [
                "munged",
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={socket_path}",
                f"--pid-file={root / 'run' / 'munged.pid'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}",
            ],
        )
        _run("ip", "addr", "add", f"{net}.1/24", "dev", str(self.bridge))
        _run("ip", "link", "set", str(self.bridge), "up")
        self._add_netns(f"{self.bridge}c", f"{net}.2")
        for node in self.node_names:
            self._add_netns(f"{self.bridge}{node}", self.node_address(node))
        self._wait("munge socket", socket_path.exists, 10)
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)], f"{self.bridge}c", "ctl")
        ctld_log = root / "log" / "slurmctld.log"
        self._wait(
            "slurmctld", lambda: ctld_log.exists() and "Running as primary controller" in ctld_log.read_text(), 20
        )
        for node in self.node_names:
            argv = ["slurmd", "-D", "-N", node, "-f", str(self.conf)]
            self._spawn(f"slurmd-{node}", argv, f"{self.bridge}{node}", node)
        self._wait("idle nodes", self._all_idle, 30)

    def _all_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout_s=5).stdout.split()
        return sum(state in ("idle", "mixed", "allocated") for state in out[1::2]) == len(self.node_names)

    # ----------------------------------------------------------------- use
    def run(self, argv: list[str], timeout_s: float = 60, **kwargs: object) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command on the login side (with ``SLURM_CONF``)."""
        env = {**os.environ, **self.env, **kwargs.pop("env", {})}  # type: ignore[dict-item]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, check=False, **kwargs)  # type: ignore[call-overload]

    def slurmd_pid(self, node: str) -> int:
        return self._procs[f"slurmd-{node}"].pid

    def node_processes(self, node: str | None = None) -> list[int]:
        """Live processes on the nodes (or one node), the slurmd daemons left out."""
        daemons = {proc.pid for proc in self._procs.values()}
        found = []
        for name in self.node_names if node is None else [node]:
            for pid in _run("ip", "netns", "pids", f"{self.bridge}{name}").stdout.split():
                if int(pid) not in daemons and _alive(int(pid)):
                    found.append(int(pid))
        return found

    def describe(self, pids: list[int]) -> str:
        lines = []
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            lines.append(f"{pid}: {cmd[:200]}")
        return "\n".join(lines)

    def wait_nodes_clean(self, timeout_s: float) -> list[int]:
        """Wait until no process but slurmd runs on any node; returns what is left after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := self.node_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def kill_node(self, node: str) -> None:
        """A node dies: SIGKILL its slurmd and everything running on it."""
        for pid in [self.slurmd_pid(node), *self.node_processes(node)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def restart_node(self, node: str) -> None:
        """Start a killed node's slurmd again and wait until the node is idle."""
        self._procs[f"slurmd-{node}"].wait(5)
        argv = ["slurmd", "-D", "-N", node, "-f", str(self.conf)]
        self._spawn(f"slurmd-{node}", argv, f"{self.bridge}{node}", node)
        self._wait("idle nodes", self._all_idle, 60)

    # ----------------------------------------------------------------- stop
    def close(self) -> None:
        """Kill everything in the test bed's namespaces, then its daemons; delete its network. Safe twice."""
        pids = [int(p) for ns in self._netns for p in _run("ip", "netns", "pids", ns).stdout.split()]
        pids += [proc.pid for proc in self._procs.values() if proc.poll() is None]
        for sig, grace_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
                for proc in self._procs.values():
                    proc.poll()
                time.sleep(0.05)
        for proc in self._procs.values():
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        for veth in self._veths:
            _run("ip", "link", "del", veth)
        for ns in self._netns:
            _run("ip", "netns", "del", ns)
        if self.bridge is not None:
            _run("ip", "link", "del", self.bridge)
        self._veths, self._netns, self.bridge = [], [], None


def _stale(bridge: str) -> bool:
    """Whether a test bridge's owner (named in its alias) is gone."""
    out = _run("ip", "-o", "link", "show", bridge).stdout
    if "pid=" not in out:
        return False
    return not os.path.exists(f"/proc/{out.split('pid=', 1)[1].split()[0]}")
