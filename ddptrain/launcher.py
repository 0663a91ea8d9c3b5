"""Starting worker processes on this machine, through one agent process (driver side).

The agent (``python -m ddptrain._agent``) runs in its own session, imports torch once and
forks the workers, so every worker starts in about the time of one torch import. Its stdout
carries framed worker output and exit events back; closing its stdin, or a kill frame,
tears the whole tree down. The driver then also kills the agent's process group, which
catches anything the workers started (DataLoader workers included).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ddptrain._agent import AGENT_RANK, FRAME, agent_command, import_roots, read_frame
from ddptrain._logs import LogSink
from ddptrain.errors import LaunchError

__all__ = ["Launcher", "LocalLauncher", "AgentEvent"]

_logger = logging.getLogger(__name__)

# (kind, rank, payload): b"S" started, b"X" exited, b"F" agent failure, b"D" agent gone.
AgentEvent = tuple[bytes, int, bytes]


class Launcher(Protocol):
    """Starts a worker group and tears it down."""

    def start(self, bootstrap: dict[str, Any], sink: LogSink, on_event: Callable[[AgentEvent], None]) -> None:
        """Hand the bootstrap to the agents; worker output goes to ``sink``."""

    def shutdown(self, grace_s: float) -> None:
        """Stop every worker: SIGTERM, then SIGKILL after ``grace_s``. Safe to call twice."""

    def bind_address(self) -> str:
        """The address the driver's store listens on: the one these agents' workers use."""

    def ask(self, command: bytes) -> None:
        """Send the agents a one-byte request: ``b"Q"`` (worker states), ``b"T"`` (and stacks)."""


class LocalLauncher:
    """Runs the workers of this machine under one agent process.

    Args:
        env: Environment of the agent and its workers.
    """

    def __init__(self, env: dict[str, str]) -> None:
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            agent_command(sys.executable, import_roots()),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self._threads: list[threading.Thread] = []
        # Read the agent's stderr from the start: a full pipe would stall it.
        self._spawn_thread(self._read_stderr, self._proc)

    def _spawn_thread(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=f"ddptrain-{target.__name__}", daemon=True)
        thread.start()
        self._threads.append(thread)

    @staticmethod
    def _read_stderr(proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            text = line.decode("utf-8", errors="replace").rstrip()
            if text:
                sys.stderr.write(f"[ddptrain agent] {text}\n")

    def bind_address(self) -> str:
        return "127.0.0.1"  # a local run's store is never reachable from elsewhere

    def ask(self, command: bytes) -> None:
        proc = self._proc
        try:
            if proc is not None and proc.stdin is not None and proc.poll() is None:
                proc.stdin.write(command)
                proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the agent is gone; its exit is reported elsewhere

    def start(self, bootstrap: dict[str, Any], sink: LogSink, on_event: Callable[[AgentEvent], None]) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise LaunchError("The launcher was already shut down.")
        payload = pickle.dumps(bootstrap)
        try:
            proc.stdin.write(FRAME.pack(b"B", AGENT_RANK, len(payload)) + payload)
            proc.stdin.flush()
        except BrokenPipeError:
            raise LaunchError(f"The ddptrain agent exited before it got its work (exit code {proc.poll()}).") from None

        def read_frames() -> None:
            assert proc.stdout is not None
            while (frame := read_frame(proc.stdout)) is not None:
                kind, rank, data = frame
                if kind in (b"O", b"E"):
                    sink.write(rank, kind, data)
                else:
                    on_event((kind, rank, data))
            try:
                code = proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                code = None
            on_event((b"D", AGENT_RANK, repr(code).encode()))

        self._spawn_thread(read_frames)

    def shutdown(self, grace_s: float) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(b"K")
                proc.stdin.flush()
        except OSError:
            pass
        try:
            proc.wait(timeout=grace_s + 1.0)
        except subprocess.TimeoutExpired:
            _logger.warning("ddptrain agent %d did not stop in %.1f s; killing it", proc.pid, grace_s + 1)
        # Whatever is left in the agent's session (its workers' own children too) goes now.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        deadline = time.monotonic() + 2.0
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "localhost")


def _bind_address(addresses: list[str]) -> str:
    """Where a multi-host run's store listens: the one address the hosts reach this machine
    at (loopback when every host is this machine), or every interface when they use several."""
    remote = sorted({a for a in addresses if not _is_loopback(a)})
    if not remote:
        return "127.0.0.1"
    if len(remote) == 1:
        return remote[0]
    _logger.info(
        "ddptrain: the hosts reach this machine at several addresses (%s); the store listens on all "
        "interfaces (messages stay signed; see Security in the README)",
        ", ".join(remote),
    )
    return "::" if any(":" in a for a in remote) else "0.0.0.0"


class GroupLauncher:
    """Launchers of several hosts driven as one: each gets its node's share of the bootstrap.

    Args:
        launchers: ``(launcher, store address as seen from that host)`` by node rank.
    """

    def __init__(self, launchers: list[tuple[Launcher, str]]) -> None:
        self._launchers = launchers
        self._bind = _bind_address([address for _, address in launchers])
        if not _is_loopback(self._bind):  # local agents reach the store at that address too
            self._launchers = [(launcher, self._bind if _is_loopback(a) else a) for launcher, a in launchers]
        self._by_rank: dict[int, Any] = {}
        self.unshared_ranks: set[int] = set()  # ranks on hosts that cannot see the run directory

    def bind_address(self) -> str:
        return self._bind

    def ask(self, command: bytes) -> None:
        for launcher, _ in self._launchers:
            launcher.ask(command)

    def fetch_dir(self, rank: int, remote: str, local: str) -> None:
        """Copy a folder from the host of ``rank`` to this machine, and delete it there."""
        self._by_rank[rank].fetch_dir(remote, local)

    def _prepare_storage(self, launcher: Any, share: dict[str, Any]) -> None:
        """For a host that cannot see the run directory: mark it, and give it the checkpoint to
        resume from as a local copy in its staging folder (which the launcher removes when it
        shuts down, or the next run on that host if this driver is killed first)."""
        run = share["run"]
        if not hasattr(launcher, "prepare_storage") or not run.get("run_dir"):
            return  # a group that runs functions has no run directory to share
        cache = launcher.prepare_storage(run["run_dir"], run["run_id"])
        if cache is None:
            return
        self.unshared_ranks.update(spec["rank"] for spec in share["workers"])
        run["shared_storage"] = False
        run["local_cache"] = cache
        if run.get("checkpoint"):
            copy = f"{cache}/resume/a{run['attempt']}/{os.path.basename(run['checkpoint'])}"
            launcher.push_dir(run["checkpoint"], copy)
            run["checkpoint"] = copy

    def start(self, bootstrap: dict[str, Any], sink: LogSink, on_event: Callable[[AgentEvent], None]) -> None:
        for node, (launcher, address) in enumerate(self._launchers):
            share = dict(bootstrap)
            share["workers"] = [
                {**spec, "env": {**spec["env"], "MASTER_ADDR": address}}
                for spec in bootstrap["workers"]
                if spec["node_rank"] == node
            ]
            share["run"] = {**bootstrap["run"], "store_host": address}
            self._by_rank.update((spec["rank"], launcher) for spec in share["workers"])
            self._prepare_storage(launcher, share)
            first = min(spec["rank"] for spec in share["workers"])

            def tagged(event: AgentEvent, first: int = first) -> None:
                kind, rank, data = event
                on_event((kind, first if rank == AGENT_RANK else rank, data))  # name the agent by its first rank

            launcher.start(share, sink, tagged)

    def shutdown(self, grace_s: float) -> None:
        threads = [
            threading.Thread(target=launcher.shutdown, args=(grace_s,), daemon=True) for launcher, _ in self._launchers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(grace_s + 10.0)
