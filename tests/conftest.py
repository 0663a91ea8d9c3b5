"""Test hygiene: restore the environment, reset worker-global state, and fail any test that
leaves a process of ours behind (found by a tag in the environment every child inherits)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

TAG_VAR = "DDPTRAIN_TEST_TAG"
os.environ[TAG_VAR] = uuid.uuid4().hex
# Quick teardown in tests: a killed group need not wait long for SIGTERM.
os.environ.setdefault("DDPTRAIN_SHUTDOWN_GRACE_S", "2")


def tagged_processes() -> list[int]:
    """Pids of live processes (other than this one) started under this test session."""
    marker = f"{TAG_VAR}={os.environ[TAG_VAR]}".encode()
    from ddptrain.launch import forkserver

    servers = set(forkserver.server_pids())  # this process's agent fork servers outlive a test on purpose
    forked_driver = sys.modules.get("forked_driver")
    if forked_driver is not None:  # and so does the zygote of its forked drivers (not the drivers)
        servers.update(forked_driver.zygote_pids())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid() or int(entry.name) in servers:
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                status = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if status != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


# Whole modules left out of the contributors' quick check (`pytest -m "not slow"`, about a
# minute on 2 cores): they start many worker groups, kill drivers, fill disks, start sshd
# servers, frameworks or a browser. Tests elsewhere that take long are marked one by one.
SLOW_MODULES = {
    "test_checkpoint_crashes",
    "test_checkpoints",
    "test_dashboard",
    "test_data",
    "test_disk_full",
    "test_elastic",
    "test_docs_examples",
    "test_docs_site",
    "test_examples",
    "test_failures",
    "test_preemption",
    "test_hangs",
    "test_inspect_runs",
    "test_lightning",
    "test_progress",
    "test_ray_compat",
    "test_raysgd",
    "test_raysgd_examples",
    "test_slurm_cluster",
    "test_ssh",
    "test_store_security",
    "test_torch_utils",
    "test_trainer",
    "test_transformers",
    "test_tune_fit",
    "test_worker_group",
    "test_worker_start",
}


# GPU tests share the machine's GPUs and read its nvidia-smi, so they run one at a time even
# under `-n`: xdist sends them all to one worker (`--dist loadgroup` in setup.cfg; other tests
# are spread as with `--dist load`), and a machine-wide lock holds each one's run. The lock is
# what guarantees it: pytest-xdist 3.8's loadgroup does not group on pytest >= 9.2
# (pytest-dev/pytest-xdist#1386), and a second pytest session may run GPU tests too. Waiting
# for it counts against a test's timeout, hence a longer one for GPU tests.
GPU_LOCK = Path(tempfile.gettempdir()) / "ddptrain-tests-gpu.lock"
GPU_TIMEOUT_S = 600


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the `xdist_group` marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    xdist = config.pluginmanager.hasplugin("xdist")
    timeout = config.pluginmanager.hasplugin("timeout")
    for item in items:
        if item.path.stem in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None:
            if xdist:
                item.add_marker(pytest.mark.xdist_group("gpu"))
            if timeout and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(GPU_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _gpu_tests_one_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    # Set up before (torn down after) the leftover check below: it runs under the lock too.
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    from filelock import FileLock

    with FileLock(str(GPU_LOCK)):
        yield


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5.0
    left = tagged_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = tagged_processes()
    if left:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"the test left processes behind: {left}")


@pytest.fixture(autouse=True)
def _restore_state() -> Iterator[None]:
    env = dict(os.environ)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Found ignored between tests (by something outside any one test: xdist's worker, a
        # session fixture or a library): every process this test starts would inherit it and
        # be deaf to Ctrl-C. Tests of Ctrl-C need the default, as a user's terminal gives it.
        warnings.warn("SIGINT was ignored in the test process before this test; restored", stacklevel=1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    handler, blocked = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    os.environ.clear()
    os.environ.update(env)
    from ddptrain import context

    context._set_session(None)
    # What a process starts inherits: a test that left Ctrl-C ignored or blocked here would make
    # every later test's subprocess deaf to it. Put it back, and fail the test that did it.
    now_handler, now_blocked = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    signal.signal(signal.SIGINT, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if now_handler is not handler or now_blocked != blocked:
        pytest.fail(f"the test left SIGINT's handler {now_handler!r} (was {handler!r}), blocked {now_blocked}")


@pytest.fixture
def storage(tmp_path: Path) -> str:
    """A storage_path for one test."""
    return str(tmp_path / "runs")


@pytest.fixture(scope="session")
def _ssh_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from sshd import SSHServers, why_no_sshd

    reason = why_no_sshd()
    if reason:
        if os.environ.get("DDPTRAIN_REQUIRE_SSHD") == "1":
            pytest.fail(f"DDPTRAIN_REQUIRE_SSHD=1 but {reason}")
        pytest.skip(reason)
    servers = SSHServers(tmp_path_factory.mktemp("sshd"), count=3)
    yield servers
    servers.close()


@pytest.fixture
def ssh(_ssh_servers, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Three loopback hosts h0..h2 behind real sshd servers, set up as the user's SSH config.

    Fails the test if anything started over SSH is still running afterwards.
    """
    monkeypatch.setenv("DDPTRAIN_SSH_KNOWN_HOSTS", str(_ssh_servers.known_hosts))
    monkeypatch.setenv("DDPTRAIN_SSH_CONFIG", str(_ssh_servers.ssh_config))
    yield _ssh_servers
    deadline = time.monotonic() + 10.0
    left = _ssh_servers.ssh_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _ssh_servers.ssh_processes()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        pytest.fail(f"processes started over SSH were left behind: {left}")


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real SLURM cluster (``tests/slurm.py``): munged, slurmctld and nodes n0, n1 of 2 CPUs,
    shared by the tests of one module; everything it ran is gone when the module ends."""
    from slurm import SlurmCluster, why_no_slurm

    reason = why_no_slurm()
    if reason:
        if os.environ.get("DDPTRAIN_REQUIRE_SLURM") == "1":
            pytest.fail(f"DDPTRAIN_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus=2, tag_var=TAG_VAR)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def slurm(slurm_cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The module's SLURM cluster, with ``SLURM_CONF`` set; fails the test if anything it ran on
    the nodes is still there afterwards."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    yield slurm_cluster
    left = slurm_cluster.wait_nodes_clean(15.0)
    if left:
        described = slurm_cluster.describe(left)
        slurm_cluster.run(["scancel", "--full", "--user=root"])
        slurm_cluster.wait_nodes_clean(10.0)
        pytest.fail(f"processes were left on the SLURM nodes:\n{described}")


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


@contextlib.contextmanager
def _netns_hosts(ssh, monkeypatch: pytest.MonkeyPatch, **options: object) -> Iterator[object]:
    from sshd import NetnsHosts, why_no_netns

    reason = why_no_netns()
    if reason:
        if os.environ.get("DDPTRAIN_REQUIRE_SSHD") == "1":
            pytest.fail(f"DDPTRAIN_REQUIRE_SSHD=1 but {reason}")
        pytest.skip(reason)
    hosts = NetnsHosts(ssh, **options)
    # Their host names do not resolve: ddptrain must find each host's interface by itself.
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    try:
        yield hosts
        deadline = time.monotonic() + 10.0
        while hosts.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = hosts.processes()
        if left:
            pytest.fail(f"processes started on the namespace hosts were left behind: {left}")
    finally:
        hosts.close()


@pytest.fixture
def netns(ssh, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Two hosts n0, n1 with their own network stacks and host names (network namespaces),
    reached over a bridge; fails the test if anything started through them is left running."""
    with _netns_hosts(ssh, monkeypatch) as hosts:
        yield hosts


@pytest.fixture
def make_netns(ssh, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., object]]:
    """``make_netns(**options)``: hosts as ``netns`` gives, made with ``sshd.NetnsHosts``'s
    options (a folder a host does not see, its SFTP server command...)."""
    with contextlib.ExitStack() as stack:
        yield lambda **options: stack.enter_context(_netns_hosts(ssh, monkeypatch, **options))


# The documentation's blocks (tests/test_docs_examples.py): how many ran, how many were skipped
# and why, printed at the end of the run (the counts come back from xdist's workers too).
_DOC_BLOCKS: list[dict] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        for key, value in report.user_properties:
            if key == "doc_blocks":
                import json

                _DOC_BLOCKS.append(json.loads(value))


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 (pytest's TerminalReporter)
    for summary in _DOC_BLOCKS:
        terminalreporter.write_sep("-", "documentation blocks")
        terminalreporter.write_line(
            f"{summary['executed']} Python blocks of the docs executed, {len(summary['skipped'])} skipped"
        )
        for skip in summary["skipped"]:
            terminalreporter.write_line(f"  skipped {skip}")


from second_user import other_user, shared_folder  # noqa: E402, F401 (fixtures)
