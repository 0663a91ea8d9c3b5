"""An SFTP server that lies about file names, as a compromised host could: it runs OpenSSH's
real ``sftp-server`` and renames entries in its directory listings.

Usage (an sshd ``Subsystem sftp`` command): ``python lying_sftp.py SFTP_SERVER NAME LIE [NAME LIE ...]``.
Every listed entry called NAME is reported as LIE (e.g. ``../NAME``); everything else passes
through unchanged.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import threading
from typing import IO

_FXP_NAME = 104


def _exact(stream: IO[bytes], n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _string(body: bytes, at: int) -> tuple[bytes, int]:
    (size,) = struct.unpack_from(">I", body, at)
    return body[at + 4 : at + 4 + size], at + 4 + size


def _attrs_end(body: bytes, at: int) -> int:
    (flags,) = struct.unpack_from(">I", body, at)
    at += 4
    at += 8 if flags & 0x1 else 0  # size
    at += 8 if flags & 0x2 else 0  # uid, gid
    at += 4 if flags & 0x4 else 0  # permissions
    at += 8 if flags & 0x8 else 0  # atime, mtime
    if flags & 0x80000000:  # extended pairs
        (count,) = struct.unpack_from(">I", body, at)
        at += 4
        for _ in range(2 * count):
            _, at = _string(body, at)
    return at


def _lie(body: bytes, renames: dict[bytes, bytes]) -> bytes:
    """A NAME packet (type, id, count, entries) with the names in ``renames`` replaced."""
    (count,) = struct.unpack_from(">I", body, 5)
    out, at = [body[:9]], 9
    for _ in range(count):
        name, at = _string(body, at)
        start = at
        _, at = _string(body, at)  # long name
        at = _attrs_end(body, at)
        name = renames.get(name, name)
        out.append(struct.pack(">I", len(name)) + name + body[start:at])
    return b"".join(out)


def main() -> None:
    server, pairs = sys.argv[1], sys.argv[2:]
    renames = {pairs[i].encode(): pairs[i + 1].encode() for i in range(0, len(pairs), 2)}
    proc = subprocess.Popen([server], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    requests, answers = sys.stdin.buffer, sys.stdout.buffer

    def forward_requests() -> None:
        while chunk := requests.read1(65536):
            proc.stdin.write(chunk)  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        proc.stdin.close()  # type: ignore[union-attr]

    threading.Thread(target=forward_requests, daemon=True).start()
    while (header := _exact(proc.stdout, 4)) is not None:
        body = _exact(proc.stdout, struct.unpack(">I", header)[0])
        if body is None:
            break
        if body[0] == _FXP_NAME:
            body = _lie(body, renames)
        answers.write(struct.pack(">I", len(body)) + body)
        answers.flush()
    proc.wait()


if __name__ == "__main__":
    main()
