"""Host keys for SSH connections: the user's known_hosts, read the way OpenSSH writes it.

paramiko's own loader stops at the first line it cannot parse, so one ``@cert-authority`` or
``@revoked`` line made every connection fail; and its "accept new hosts" policy rewrote the
whole file, dropping comments and every line it did not understand. Here:

- ``@revoked`` keys are refused for every host, even one that lists the same key as valid;
- ``@cert-authority`` lines are skipped (paramiko cannot check host certificates): a host known
  only through one is unknown, and the error says why;
- a line that cannot be parsed is skipped (logged at debug level), never fatal;
- a new host key (``DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS=1``) is appended as one line; nothing
  else in the file changes.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import paramiko

__all__ = ["KnownHosts", "RevokedHostKeyError", "install"]

_logger = logging.getLogger(__name__)


class RevokedHostKeyError(paramiko.SSHException):
    """The server presented a key that known_hosts marks ``@revoked``."""


@dataclass
class KnownHosts:
    """What a known_hosts file says, as far as ddptrain uses it."""

    path: str
    entries: list[Any] = field(default_factory=list)  # paramiko HostKeyEntry, revoked keys left out
    revoked: set[bytes] = field(default_factory=set)  # key blobs
    authorities: int = 0  # @cert-authority lines skipped

    @classmethod
    def load(cls, path: str) -> KnownHosts:
        """Read ``path`` (a missing file is an empty one)."""
        known = cls(path)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return known
        parsed = []
        for lineno, raw in enumerate(lines, 1):
            fields = raw.split()
            if not fields or fields[0].startswith("#"):
                continue
            if fields[0] == "@revoked":
                blob = _key_blob(fields[3] if len(fields) > 3 else "")
                if blob is None:
                    _logger.debug("%s:%d: unreadable @revoked line skipped", path, lineno)
                else:
                    known.revoked.add(blob)
                continue
            if fields[0].startswith("@"):  # @cert-authority, or a marker of a later OpenSSH
                known.authorities += fields[0] == "@cert-authority"
                _logger.debug("%s:%d: %s line skipped (not supported)", path, lineno, fields[0])
                continue
            try:
                entry = paramiko.hostkeys.HostKeyEntry.from_line(" ".join(fields), lineno)
            except Exception as exc:  # paramiko raises several kinds for a malformed line
                _logger.debug("%s:%d: unreadable line skipped: %s", path, lineno, exc)
                continue
            if entry is not None:
                parsed.append(entry)
        known.entries = [e for e in parsed if e.key.asbytes() not in known.revoked]
        return known

    def is_revoked(self, key: Any) -> bool:
        """Whether ``key`` (a paramiko PKey) is marked ``@revoked``."""
        return bool(key.asbytes() in self.revoked)

    def append(self, hostname: str, key: Any) -> None:
        """Add one line for ``hostname`` at the end of the file (created 0600 if missing)."""
        folder = os.path.dirname(self.path)
        if folder:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n".encode()
        try:
            with open(self.path, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        line = b"\n" + line
        except FileNotFoundError:
            pass
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _key_blob(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True) or None
    except (binascii.Error, ValueError):
        return None


class _Policy(paramiko.MissingHostKeyPolicy):
    """Unknown hosts: refuse, or (``accept_new``) trust and append; revoked keys: always refuse."""

    def __init__(self, known: KnownHosts, accept_new: bool) -> None:
        self.known = known
        self.accept_new = accept_new

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        if self.known.is_revoked(key):
            raise RevokedHostKeyError(f"the {key.get_name()} host key of {hostname} is marked @revoked")
        if not self.accept_new:
            raise paramiko.SSHException(f"Server {hostname!r} not found in known_hosts")
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known.append(hostname, key)
        _logger.warning("ddptrain: added the %s host key of %s to %s", key.get_name(), hostname, self.known.path)


def install(client: Any, path: str, accept_new: bool) -> KnownHosts:
    """Give ``client`` the host keys of ``path`` and the policy for keys not in it."""
    known = KnownHosts.load(path)
    keys = client.get_host_keys()
    for entry in known.entries:
        for name in entry.hostnames:
            keys.add(name, entry.key.get_name(), entry.key)
    client.set_missing_host_key_policy(_Policy(known, accept_new))
    return known
