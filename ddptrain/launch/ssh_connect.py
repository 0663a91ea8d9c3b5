"""Logging in to a host over SSH, and running one program there as the agent is run (driver
side), with paramiko.

:func:`connect` checks host keys, names the host in every error, and bounds what waits on the
connection once the host goes silent (:func:`_bound_dead_links`). :func:`remote_command` is the
shell step that starts a program on a host, the agent (``ddptrain.ssh``) or ``ddptrain check``'s
probe (:func:`run_program`).
"""

from __future__ import annotations

import shlex
import socket
from typing import Any

from ddptrain import _env
from ddptrain.errors import LaunchError
from ddptrain.launch.host_scripts import PID_LINE, PRESTART, env_frame, one_line
from ddptrain.launch.hosts import HostSpec
from ddptrain.wire.boot import agent_command

__all__ = ["connect", "remote_command", "run_program"]


def remote_command(python: str, workdir: str | None, program: list[str] | None = None) -> str:
    """The shell command that starts ``program`` (default: the agent) on a host; every value is quoted.

    It holds no environment value: the program gets its environment from ``env_frame`` (see
    ``ddptrain.launch.host_scripts``), sent over the channel's stdin right after the command starts.
    The agent imports ddptrain from the host's installation (or a forwarded ``PYTHONPATH``),
    never from the working directory (see ``ddptrain._agent_start._BOOT``).
    """
    parts = [f"cd {shlex.quote(workdir)} &&"] if workdir else []
    parts += ["exec", shlex.join([python, "-I", "-S", "-c", one_line(PRESTART), *(program or agent_command(python))])]
    return " ".join(parts)


def run_program(
    client: Any, python: str, workdir: str | None, env: dict[str, str], program: list[str], timeout_s: float
) -> tuple[int | None, str, str]:
    """Run ``program`` on a host exactly as the agent is started there (same shell step, working
    directory and environment); returns its exit status, stdout and stderr.

    Raises:
        LaunchError: The connection was lost while it ran (see :func:`connect` for the bound).
    """
    channel = client.get_transport().open_session()
    try:
        channel.settimeout(timeout_s)
        channel.exec_command(remote_command(python, workdir, program))
        try:
            channel.sendall(env_frame(env))
            channel.shutdown_write()
        except OSError:
            pass  # it ended already (no such directory or python): its stderr says why
        out = channel.makefile("rb").read()
        err = channel.makefile_stderr("rb").read()
        code = int(channel.recv_exit_status())
        if code == -1 and not client.get_transport().is_active():
            raise LaunchError(
                "the connection was lost while the program ran there: the host stopped answering, or closed it"
            )
    finally:
        channel.close()
    if out.startswith(PID_LINE):
        out = out.split(b"\n", 1)[1] if b"\n" in out else b""
    return (None if code == -1 else code), out.decode(errors="replace"), err.decode(errors="replace")


def connect(host: HostSpec, timeout_s: float) -> Any:
    """An authenticated paramiko client for ``host``; errors name the host and say what to do.

    Once connected, the kernel ends the connection when the host has acknowledged nothing for
    twice ``DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S`` (:func:`_bound_dead_links`): whatever waits on it
    then fails, also where no heartbeat watches it (``ddptrain check``, the GPU probe, the
    staging folder's removal at shutdown).

    Host keys are checked against ``~/.ssh/known_hosts`` (or ``$DDPTRAIN_SSH_KNOWN_HOSTS``);
    unknown hosts are refused unless ``DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS=1``, which appends their
    key to that file; ``@revoked`` keys are always refused, ``@cert-authority`` lines are skipped
    (see ``ddptrain.launch.known_hosts``). Passwords are never asked for.
    """
    import paramiko  # loaded only when a host list is used, as the known-hosts reader below

    from ddptrain.launch import known_hosts as _known_hosts  # built on paramiko

    client = paramiko.SSHClient()
    known_hosts = _env.ssh_known_hosts()
    known = _known_hosts.install(client, known_hosts, _env.ssh_accept_new_host_keys())
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
    except _known_hosts.RevokedHostKeyError as exc:
        client.close()
        raise LaunchError(f"{where}: {exc} in {known_hosts}; refusing to connect.") from None
    except paramiko.BadHostKeyException as exc:
        client.close()
        if known.is_revoked(exc.key):
            raise LaunchError(
                f"{where}: its host key is marked @revoked in {known_hosts}; refusing to connect."
            ) from None
        raise LaunchError(
            f"{where}: its host key does not match the one in {known_hosts} ({exc}). If the host was "
            "reinstalled, remove the old key with `ssh-keygen -R`; otherwise someone may be intercepting."
        ) from None
    except paramiko.SSHException as exc:
        client.close()
        if _gave_up_waiting(exc):  # before the keys: a login that timed out is not a refused key
            raise LaunchError(
                f"{where}: stopped answering while ddptrain logged in (nothing for "
                f"DDPTRAIN_SSH_CONNECT_TIMEOUT_S={timeout_s:g} s: {exc}). Its network or the machine went away, "
                "or its SSH server is overloaded."
            ) from None
        if isinstance(exc, paramiko.PasswordRequiredException):
            which = f"the key {host.key}" if host.key else "a key of ~/.ssh (id_*)"
            raise LaunchError(
                f"{where}: {which} needs a passphrase, and ddptrain never asks for one. Load it into ssh-agent "
                f"in the shell that starts the run (`ssh-add {host.key or '~/.ssh/id_ed25519'}`), or use a key "
                "without a passphrase (`key=` in the host list)."
            ) from None
        if isinstance(exc, paramiko.AuthenticationException):
            raise LaunchError(
                f"{where}: authentication failed ({exc}). ddptrain logs in with keys only (never a "
                "password): add your public key to the host's authorized_keys, or set `key=` in the host list."
            ) from None
        if "known_hosts" in str(exc):
            skipped = (
                f" Its {known.authorities} @cert-authority line(s) were skipped: ddptrain checks host keys, "
                "not host certificates."
                if known.authorities
                else ""
            )
            raise LaunchError(
                f"{where}: unknown host key (not in {known_hosts}). Connect once with `ssh` to check "
                f"and save it, or set DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS=1 to accept new hosts.{skipped}"
            ) from None
        raise LaunchError(f"{where}: SSH failed: {exc}.") from None
    except OSError as exc:
        client.close()
        if isinstance(exc, TimeoutError):
            raise LaunchError(
                f"{where}: cannot connect: no answer within DDPTRAIN_SSH_CONNECT_TIMEOUT_S={timeout_s:g} s."
            ) from None
        raise LaunchError(f"{where}: cannot connect: {exc}.") from None
    _bound_dead_links(client.get_transport().sock, 2 * _env.ssh_heartbeat_timeout_s())
    return client


def _gave_up_waiting(exc: Exception) -> bool:
    """Whether paramiko gave up waiting for the host while logging in: for its banner, the key
    exchange (``No existing session`` follows one that did not finish in time) or the answer
    to a key."""
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text or text == "no existing session"


def _bound_dead_links(sock: Any, timeout_s: float) -> None:
    """Make the kernel end the connection on ``sock`` once the host acknowledged nothing for
    ``timeout_s``: TCP keepalives probe the link after a second without traffic, and Linux's
    ``TCP_USER_TIMEOUT`` ends a connection whose data or probes go unacknowledged that long.
    Without it, a read or write on a link that went down waits for TCP's own retries (about
    15 minutes) or forever."""
    if not isinstance(sock, socket.socket):
        return  # a proxy command's pipe: nothing to set
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", max(1, round(timeout_s)))):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, round(timeout_s * 1000))
