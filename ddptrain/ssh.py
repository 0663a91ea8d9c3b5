"""Starting one host's workers over SSH (driver side), with paramiko.

One SSH connection per host runs ``PYTHON -m ddptrain._agent`` without a pty; the agent's
stdin, stdout and stderr are the channel's. The driver sends the bootstrap (function and
secret) over stdin, reads framed output and exit events from stdout, and sends a heartbeat
byte every half second: the agent kills its whole process tree when stdin closes (the
connection dropped, the driver died) or when heartbeats stop (a host or network that vanished
without closing the connection).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shlex
import stat
import sys
import threading
from collections.abc import Callable
from typing import Any

from ddptrain import _env
from ddptrain._agent import AGENT_RANK, FRAME, agent_command, read_frame
from ddptrain._logs import LogSink
from ddptrain.errors import LaunchError
from ddptrain.hosts import HostSpec

__all__ = ["SSHLauncher", "connect", "remote_command"]

_logger = logging.getLogger(__name__)
_HEARTBEAT_S = 0.5


def remote_command(python: str, workdir: str | None, env: dict[str, str]) -> str:
    """The shell command that starts the agent on a host; every value is quoted.

    The agent imports ddptrain from the host's installation (or a forwarded ``PYTHONPATH``),
    never from the working directory (see ``ddptrain._agent._BOOT``).
    """
    parts = []
    if workdir:
        parts.append(f"cd {shlex.quote(workdir)} &&")
    parts.append("exec env")
    parts.extend(shlex.quote(f"{key}={value}") for key, value in sorted(env.items()))
    parts.extend(shlex.quote(arg) for arg in agent_command(python))
    return " ".join(parts)


def connect(host: HostSpec, timeout_s: float) -> Any:
    """An authenticated paramiko client for ``host``; errors name the host and say what to do.

    Host keys are checked against ``~/.ssh/known_hosts`` (or ``$DDPTRAIN_SSH_KNOWN_HOSTS``);
    unknown hosts are refused unless ``DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS=1``. Passwords are never
    asked for.
    """
    import paramiko

    client = paramiko.SSHClient()
    known_hosts = _env.ssh_known_hosts()
    if os.path.exists(known_hosts):
        client.load_host_keys(known_hosts)
    if _env.ssh_accept_new_host_keys():
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    else:
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
    address = host.address or host.name
    port = host.port or 22
    where = f"host {host.name!r} ({host.user + '@' if host.user else ''}{address}:{port})"
    try:
        client.connect(
            address,
            port=port,
            username=host.user,
            key_filename=host.key,
            timeout=timeout_s,
            banner_timeout=timeout_s,
            auth_timeout=timeout_s,
            allow_agent=True,
            look_for_keys=host.key is None,
            password=None,
        )
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise LaunchError(
            f"{where}: its host key does not match the one in {known_hosts} ({exc}). If the host was "
            "reinstalled, remove the old key with `ssh-keygen -R`; otherwise someone may be intercepting."
        ) from None
    except paramiko.AuthenticationException as exc:
        client.close()
        raise LaunchError(
            f"{where}: authentication failed ({exc}). ddptrain logs in with keys only (never a "
            "password): add your public key to the host's authorized_keys, or set `key=` in the host list."
        ) from None
    except paramiko.SSHException as exc:
        client.close()
        if "known_hosts" in str(exc):
            raise LaunchError(
                f"{where}: unknown host key (not in {known_hosts}). Connect once with `ssh` to check "
                "and save it, or set DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS=1 to accept new hosts."
            ) from None
        raise LaunchError(f"{where}: SSH failed: {exc}.") from None
    except OSError as exc:
        client.close()
        raise LaunchError(f"{where}: cannot connect: {exc}.") from None
    return client


_GPU_PROBE = "nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true"


def gpu_slots(hosts: list[HostSpec], gpus_per_worker: float) -> list[HostSpec]:
    """Hosts without ``slots`` get one slot per ``gpus_per_worker`` GPUs, probed on the host.

    Raises:
        ConfigError: A host without ``slots`` has no GPU.
    """
    from dataclasses import replace

    from ddptrain.errors import ConfigError
    from ddptrain.hosts import is_local

    probed: list[HostSpec] = []
    for host in hosts:
        if host.slots is not None:
            probed.append(host)
            continue
        if is_local(host):
            import torch

            count = torch.cuda.device_count()
        else:
            client = connect(host, _env.ssh_connect_timeout_s())
            try:
                _, stdout, _ = client.exec_command(_GPU_PROBE, timeout=30)
                count = int(stdout.read().decode().strip() or 0)
            finally:
                client.close()
        slots = int(count // max(gpus_per_worker, 1e-9)) if gpus_per_worker >= 1 else int(count / gpus_per_worker)
        if slots < 1:
            raise ConfigError(
                f"host {host.name!r} has no GPU that `use_gpu=True` could use (nvidia-smi lists {count}); "
                "give it `slots=` in the host list, or remove it."
            )
        probed.append(replace(host, slots=slots))
    return probed


class SSHLauncher:
    """Runs one host's workers under an agent started over SSH.

    Args:
        host: The host (after ``~/.ssh/config`` lookups).
        env: Environment variables of the agent and its workers.
        python: Python executable on the host.
        workdir: Working directory on the host.
    """

    def __init__(self, host: HostSpec, env: dict[str, str], python: str, workdir: str | None) -> None:
        self.host = host
        self.workdir = workdir
        self._client: Any = connect(host, _env.ssh_connect_timeout_s())
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stderr_tail: list[str] = []
        self._sftp_client: Any = None
        self.cache_dir: str | None = None
        try:
            transport = self._client.get_transport()
            # The address this machine uses to reach the host: the host can reach us back on it.
            self.local_address: str = transport.sock.getsockname()[0]
            self._channel = transport.open_session()
            self._channel.exec_command(remote_command(python, workdir, env))
        except Exception as exc:
            self._client.close()
            raise LaunchError(f"host {host.name!r}: cannot start the ddptrain agent: {exc}.") from None
        self._spawn(self._read_stderr)

    def _spawn(self, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=f"ddptrain-ssh-{self.host.name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _read_stderr(self) -> None:
        stream = self._channel.makefile_stderr("rb")
        for line in stream:
            text = line.decode("utf-8", errors="replace").rstrip()
            if text:
                self._stderr_tail = (self._stderr_tail + [text])[-20:]
                sys.stderr.write(f"[ddptrain agent {self.host.name}] {text}\n")

    def start(
        self, bootstrap: dict[str, Any], sink: LogSink, on_event: Callable[[tuple[bytes, int, bytes]], None]
    ) -> None:
        # Over SSH the agent also stops when the heartbeat stops (a host or network that vanished).
        payload = pickle.dumps({**bootstrap, "cwd": self.workdir, "heartbeat_s": _env.ssh_heartbeat_timeout_s()})
        try:
            self._channel.sendall(FRAME.pack(b"B", AGENT_RANK, len(payload)) + payload)
        except OSError:
            raise LaunchError(f"on host {self.host.name!r} the agent did not start ({self._exit_detail()})") from None

        def read_frames() -> None:
            stream = self._channel.makefile("rb")
            seen = False
            while (frame := read_frame(stream)) is not None:
                seen = True
                kind, rank, data = frame
                if kind in (b"O", b"E"):
                    sink.write(rank, kind, data)
                else:
                    on_event((kind, rank, data))
            code = self._exit_code()
            if not seen:  # the agent never ran: wrong python, missing ddptrain, ...
                detail = self._exit_detail()
                on_event((b"F", AGENT_RANK, f"on host {self.host.name!r} the agent did not start ({detail})".encode()))
            on_event((b"D", AGENT_RANK, repr(code).encode()))

        def heartbeat() -> None:
            while not self._stop.wait(_HEARTBEAT_S):
                try:
                    self._channel.sendall(b"H")
                except OSError:
                    return

        self._spawn(read_frames)
        self._spawn(heartbeat)

    # ----------------------------------------------------------------- files (no shared storage)
    def _sftp(self) -> Any:
        import paramiko

        if self._sftp_client is None:
            try:
                self._sftp_client = self._client.open_sftp()
            except paramiko.SSHException as exc:
                raise LaunchError(
                    f"host {self.host.name!r} cannot see the run directory, so checkpoints are copied over "
                    f"SFTP, but its SSH server refused SFTP ({exc}). Enable the sftp subsystem there, or put "
                    "`storage_path` on a file system the hosts share."
                ) from None
        return self._sftp_client

    def sees_run_dir(self, run_dir: str, run_id: str) -> bool:
        """Whether this host sees the driver's run directory (a shared file system)."""
        path = shlex.quote(os.path.join(run_dir, "run.json"))
        _, stdout, _ = self._client.exec_command(f"cat -- {path} 2>/dev/null", timeout=30)
        try:
            return bool(json.loads(stdout.read().decode() or "{}").get("run_id") == run_id)
        except ValueError:
            return False

    def fetch_dir(self, remote: str, local: str) -> None:
        """Copy a folder from the host to this machine (recursively), then delete it there."""
        sftp = self._sftp()
        os.makedirs(local, exist_ok=True)
        for entry in sftp.listdir_attr(remote):
            source, target = f"{remote}/{entry.filename}", os.path.join(local, entry.filename)
            if stat.S_ISDIR(entry.st_mode or 0):
                self.fetch_dir(source, target)
            else:
                sftp.get(source, target)
        self._client.exec_command(f"rm -rf -- {shlex.quote(remote)}")[1].channel.recv_exit_status()

    def push_dir(self, local: str, remote: str) -> None:
        """Copy a folder from this machine to the host (recursively)."""
        sftp = self._sftp()
        self._client.exec_command(f"mkdir -p -- {shlex.quote(remote)}")[1].channel.recv_exit_status()
        for name in os.listdir(local):
            source, target = os.path.join(local, name), f"{remote}/{name}"
            if os.path.isdir(source):
                self.push_dir(source, target)
            else:
                sftp.put(source, target)

    def _exit_code(self) -> int | None:
        # The exit status may follow the end of the output by a moment.
        if not self._channel.status_event.wait(2.0):
            return None
        code = int(self._channel.recv_exit_status())
        return None if code == -1 else code  # -1: the connection ended without an exit status

    def _exit_detail(self) -> str:
        """``exit status N`` and the agent's last stderr lines, for errors."""
        code = self._exit_code()
        for thread in self._threads[:1]:  # the stderr reader: let it take the last lines
            thread.join(1.0)
        tail = "\n".join(self._stderr_tail[-10:])
        return f"exit status {code}" + (f":\n{tail}" if tail else "")

    def shutdown(self, grace_s: float) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._channel.sendall(b"K")
            self._channel.shutdown_write()
        except OSError:
            pass
        deadline_s = grace_s + 2.0
        ready = threading.Event()

        def wait_for_exit() -> None:
            self._channel.recv_exit_status()
            ready.set()

        threading.Thread(target=wait_for_exit, daemon=True).start()
        if not ready.wait(deadline_s):
            _logger.warning("ddptrain: the agent on %s did not stop in %.0f s", self.host.name, deadline_s)
        self._channel.close()
        if self.cache_dir is not None:  # staged and pushed checkpoint copies on this host
            try:
                self._client.exec_command(f"rm -rf -- {shlex.quote(self.cache_dir)}")[1].channel.recv_exit_status()
            except Exception as exc:
                _logger.warning("ddptrain: could not remove %s on %s: %s", self.cache_dir, self.host.name, exc)
        if self._sftp_client is not None:
            self._sftp_client.close()
        self._client.close()
        for thread in self._threads:
            thread.join(2.0)
