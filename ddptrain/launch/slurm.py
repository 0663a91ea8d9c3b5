"""Running a group on the nodes of the SLURM allocation this process runs in (driver side).

``ScalingConfig(hosts="slurm")`` (or ``DDPTRAIN_HOSTFILE=slurm``, ``ddptrain run --hosts slurm``)
takes the nodes from the job's environment: ``SLURM_JOB_NODELIST`` expanded as ``scontrol show
hostnames`` does (``slurm_allocation``), workers per node from the allocation
(``allocation_hosts``). There is no auto-detection: a script that runs inside an allocation
but is not told ``hosts="slurm"`` runs on the machine it is on, as anywhere else.

Each node's agent is one job step, started with ``srun --overlap --nodes=1 --ntasks=1 -w NODE``
(never SSH: many clusters forbid it between compute nodes). The step's stdin, stdout and stderr
are the pipe to the agent, as a local process's or an SSH channel's (:class:`SrunConnection`;
``AgentSession`` does the rest): the environment goes over stdin first
(``host_scripts.PRESTART``), then the bootstrap; heartbeats go both ways, so a node that dies or
whose step the scheduler kills is noticed within ``DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S``, and the
agent stops its workers when the driver's heartbeats stop or its stdin closes (the driver died:
``srun`` passes the end of its stdin on to the step).

The driver runs where the script runs (the batch host under ``sbatch``, the login side under
``salloc``); its store listens on the address this machine routes to the nodes from
(``DDPTRAIN_DRIVER_ADDRESS`` overrides it). A node that does not see the run directory keeps
its checkpoint files in a staging folder, copied back through job steps (``slurm_files``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping
from typing import IO

from ddptrain import _env
from ddptrain.errors import HostLostError, LaunchError
from ddptrain.launch.agent_session import AgentSession, OutputSink
from ddptrain.launch.host_scripts import PRESTART, STAGING_PREFIX, STORAGE_PREP, env_frame, one_line, read_pid_line
from ddptrain.launch.slurm_allocation import node_address, route_source
from ddptrain.launch.slurm_files import NodeFiles
from ddptrain.wire.agent_events import AgentEvent
from ddptrain.wire.boot import agent_command, import_pins
from ddptrain.wire.protocol import ALIVE_S, Bootstrap

__all__ = ["STEP_VARIABLES", "SlurmLauncher", "SrunConnection", "prestart_command", "srun_command", "step_env"]

_logger = logging.getLogger(__name__)


def srun_command(node: str, program: list[str]) -> list[str]:
    """The ``srun`` command that runs ``program`` as a one-task job step on ``node``.

    ``--overlap``: the step shares the allocation's CPUs with the batch script and the other
    steps; ``--kill-on-bad-exit``: a task that fails ends the step; ``--unbuffered``: the output
    passes through as it comes, not line by line (the agent's frames are binary);
    ``--input=all``: stdin goes to the task, and its end too.
    """
    return [
        "srun",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--kill-on-bad-exit=1",
        "--unbuffered",
        "--input=all",
        "--job-name=ddptrain-agent",
        *program,
    ]


# What srun sets for the agent's step that would mislead a worker: the step's task identity
# (every agent is task 0 of a one-task step on one node), its ids and its launcher's ports.
# Workers find their rank in RANK, LOCAL_RANK, NODE_RANK and WORLD_SIZE, as on any host.
STEP_VARIABLES = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_GTIDS",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_NNODES",
    "SLURM_TASKS_PER_NODE",
    "SLURM_TASK_PID",
    "SLURM_STEPID",
    "SLURM_STEP_*",
    "SLURM_SRUN_COMM_*",
    "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_DISTRIBUTION",
    "SLURM_CPU_BIND*",
)


def step_env(env: Mapping[str, str], driver_address: str, driver_env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for an agent's job step, with what ``PRESTART`` does there before the agent starts:
    the step's own variables (:data:`STEP_VARIABLES`) removed, ``SLURM_JOB_NAME`` the
    allocation's (the step's ``--job-name`` renames it), and the network interface for gloo and
    NCCL the one on the node's route to ``driver_address``. Names in ``env`` are kept as given."""
    unset = [name for name in STEP_VARIABLES if name not in env]
    extra = {"DDPTRAIN_ROUTE_TO": driver_address}
    if "SLURM_JOB_NAME" not in env:
        if driver_env.get("SLURM_JOB_NAME"):
            extra["SLURM_JOB_NAME"] = driver_env["SLURM_JOB_NAME"]
        else:
            unset.append("SLURM_JOB_NAME")
    return {**env, **extra, "DDPTRAIN_UNSET": ",".join(unset)}


def prestart_command(python: str, program: list[str]) -> list[str]:
    """``program`` started as on an SSH host: its environment read from stdin first (``PRESTART``)."""
    return [python, "-I", "-S", "-c", one_line(PRESTART), *program]


class SrunConnection:
    """The pipe to an agent that runs as a job step: ``srun``'s stdin, stdout and stderr.
    The agent first prints its pid on a line of its own.

    Args:
        node: The node.
        python: Python executable on the node.
        env: Environment variables of the agent and its workers, on top of the driver's
            (``srun`` passes the driver's environment on); sent over stdin, never on a command line.

    Raises:
        ConfigError: A variable of ``env`` cannot be passed (see ``env_frame``).
    """

    def __init__(self, node: str, python: str, env: dict[str, str]) -> None:
        self.where = f"on node {node!r}"
        self.agent_pid: int | None = None
        self.stray_output = ""  # what its stdout said instead of the pid line
        self.pid_known = threading.Event()
        self._node = node
        self._argv = srun_command(node, prestart_command(python, agent_command(python, import_pins())))
        self._frame = env_frame(env)
        self._proc: subprocess.Popen[bytes] | None = None

    def open(self) -> None:
        try:
            self._proc = subprocess.Popen(
                self._argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C in the terminal is the driver's to handle, not srun's
            )
        except OSError as exc:
            raise LaunchError(f"node {self._node!r}: cannot run srun: {exc}") from None
        assert self._proc.stdin is not None and self._proc.stdout is not None and self._proc.stderr is not None
        self.stdout: IO[bytes] = self._proc.stdout
        self.stderr: IO[bytes] = self._proc.stderr
        try:
            self._proc.stdin.write(self._frame)
            self._proc.stdin.flush()
        except OSError:
            pass  # it ended already; `start` reports how
        threading.Thread(target=self._read_pid, name=f"ddptrain-srun-{self._node}", daemon=True).start()

    def _read_pid(self) -> None:
        try:
            self.agent_pid, self.stray_output = read_pid_line(self.stdout)
        finally:
            self.pid_known.set()

    def probe(self) -> bool:
        # Nothing on the node answers cheaply before the agent speaks: the step is there while
        # srun runs (srun notices a node or step that goes away). Before `open`, nothing is gone.
        return self._proc is None or self._proc.poll() is None

    def write(self, data: bytes) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.poll() is not None:
            raise BrokenPipeError("the agent's step has ended")
        try:
            proc.stdin.write(data)
            proc.stdin.flush()
        except ValueError:  # closed at shutdown
            raise BrokenPipeError("the agent's stdin is closed") from None

    def wait_ready(self) -> None:
        self.pid_known.wait()

    def exit_code(self) -> int | None:
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return None

    def _signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def close(self, grace_s: float) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # the agent's stdin ends: it stops whatever is left
        except OSError:
            pass
        # srun ends when the step does; SIGTERM makes it end the step, SIGKILL (it can ignore
        # SIGTERM once its daemons are gone) leaves the step to its agent's heartbeat check.
        for sig, wait_s in ((None, grace_s + 2.0), (signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            if sig is not None:
                _logger.warning("ddptrain: srun of the agent %s did not end; sending it %s", self.where, sig.name)
                self._signal(sig)
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass

    def abort(self) -> None:
        # The node stopped answering: srun goes, which ends every read and write on it; the
        # agent stops its workers once the driver's heartbeats stop.
        self._signal(signal.SIGKILL)


class SlurmLauncher:
    """Runs one node's workers under an agent started as a job step (see the module docstring).

    Args:
        node: The node's name in the allocation.
        env: Environment variables of the agent and its workers (on top of the driver's).
        python: Python executable on the node (the driver's: the nodes of an allocation share
            its software).
        workdir: Working directory of the workers.
    """

    def __init__(self, node: str, env: dict[str, str], python: str, workdir: str | None) -> None:
        self.node = node
        self.workdir = workdir
        self.python = python
        self._lost_after_s = _env.ssh_heartbeat_timeout_s()
        self.local_address = _env.driver_address() or route_source(node_address(node))
        self._connection = SrunConnection(node, python, step_env(env, self.local_address, os.environ))
        label = f"ddptrain agent {node}"
        self._session = AgentSession(self._connection, ALIVE_S, label, lost_after_s=self._lost_after_s)
        try:
            self._session.open()
        except Exception as exc:
            self._session.shutdown(0)
            raise LaunchError(f"node {node!r}: cannot start the ddptrain agent: {exc}.", hosts=[node]) from None
        self._closed = False
        self._cache: str | None = None  # the staging folder of a node that does not see the run directory
        self._files = NodeFiles(node, python)

    def lost_error(self) -> HostLostError | None:
        return self._session.lost_error(self.node)

    def start(self, bootstrap: Bootstrap, sink: OutputSink, on_event: Callable[[AgentEvent], None]) -> None:
        """Hand the node's share of the bootstrap to its agent (see ``AgentSession.start``).

        Raises:
            HostLostError: The node stopped answering before its agent got its work.
            LaunchError: The agent is gone.
        """
        bootstrap = dataclasses.replace(bootstrap, cwd=self.workdir, heartbeat_s=self._lost_after_s)
        self._session.start_on(self.node, bootstrap, sink, on_event)

    def prepare_storage(self, probe: str, run_id: str) -> str | None:
        """``None`` when the node sees the run directory (checked on the node, in a step of its
        own, as on an SSH host); else the node's new private staging folder, where its workers
        keep checkpoint files until the driver copies them back (``NodeFiles``).

        Raises:
            LaunchError: The check failed, or the staging folder is not a private one of this user.
        """
        if not self._connection.pid_known.wait(_env.worker_start_timeout_s()):
            raise LaunchError(f"the ddptrain agent on node {self.node!r} did not start in time", hosts=[self.node])
        if self._connection.agent_pid is None:
            return None  # the agent did not start: `start` reports why
        cache = STAGING_PREFIX + run_id
        program = [self.python, "-I", "-S", "-c", one_line(STORAGE_PREP)]
        program += [probe, run_id, cache, str(self._connection.agent_pid), f"{socket.gethostname()} pid {os.getpid()}"]
        try:
            done = subprocess.run(
                srun_command(self.node, program),
                capture_output=True,
                text=True,
                timeout=_env.storage_timeout_s(),
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise LaunchError(
                f"node {self.node!r}: checking whether it sees the run directory took over "
                f"{_env.storage_timeout_s():g} s (DDPTRAIN_STORAGE_TIMEOUT_S)",
                hosts=[self.node],
            ) from None
        try:
            answer = json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise LaunchError(
                f"node {self.node!r}: checking whether it sees the run directory failed "
                f"(exit status {done.returncode}): {done.stderr.strip()[-500:]}",
                hosts=[self.node],
            ) from None
        if "error" in answer:
            raise LaunchError(f"node {self.node!r}: {answer['error']}", hosts=[self.node])
        if answer.get("shared"):
            return None
        self._cache = cache  # removed when the group shuts down
        return cache

    def push_dir(self, local: str, remote: str) -> None:
        """Copy a folder of this machine to the node, through a job step (``NodeFiles``)."""
        self._files.push_dir(local, remote)

    def fetch_dir(self, rank: int, remote: str, local: str) -> None:
        """Copy a folder of the node to this machine through a job step, then delete it there."""
        self._files.fetch_dir(remote, local)

    def reset(self, timeout_s: float) -> bool:
        """Stop the workers and keep the agent for the next attempt (``AgentSession.reset``)."""
        return not self._closed and self._session.reset(timeout_s)

    def ask(self, command: bytes) -> None:
        self._session.ask(command)

    def stopped_agents(self) -> list[tuple[str, int]]:
        return []  # a stopped agent there goes silent: its host is declared lost

    def bind_address(self) -> str:
        return self.local_address

    def shutdown(self, grace_s: float) -> None:
        if self._closed:
            return
        self._closed = True
        self._session.shutdown(grace_s)
        if self._cache is not None:
            if self.lost_error() is not None:  # the next run on the node removes it
                _logger.info("ddptrain: %s stays on node %s, which stopped answering", self._cache, self.node)
            else:
                try:
                    self._files.remove(self._cache)
                except LaunchError as exc:
                    _logger.warning("ddptrain: could not remove %s on node %s: %s", self._cache, self.node, exc)
