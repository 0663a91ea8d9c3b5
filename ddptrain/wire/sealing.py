"""Sealed records: how a message crosses the driver's store, and how a receiver puts the
records of each sender back in order (``ddptrain.channel`` names the keys they travel under).

A record is ``nonce || AES-256-GCM(header || payload)`` under a key derived from the run's
secret (HKDF-SHA256), bound to where it may be read (a queue's name, or the driver's logs). The
header holds the sender, its message number, and the part of the message it carries: a message
larger than ``PART_BYTES`` travels as several records, because the store's server drops
connections that send values of about 8 MiB or more.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "BEAT_SENDER",
    "DRIVER",
    "END_OF_SEGMENT",
    "OVERHEAD",
    "PART_BYTES",
    "ForgedMessageError",
    "LostMessageError",
    "Order",
    "RateLimitedWarnings",
    "StoreTamperedError",
    "derived",
    "split",
    "seal",
    "unseal",
    "who",
]

DRIVER = 0xFFFFFFFF  # the driver's sender id
BEAT_SENDER = 0x40000000  # a rank's heartbeats are numbered apart from its messages
# The store's server drops connections that send values of about 8 MiB or more.
PART_BYTES = 4 * 2**20
# A sealed record: nonce, then (header, payload) encrypted, then the tag.
_NONCE, _TAG = 12, 16
_HEADER = struct.Struct(">IqIIB")  # sender, message number, part, parts, flags
OVERHEAD = _NONCE + _HEADER.size + _TAG
END_OF_SEGMENT = 1  # flag: the sender's next record goes to its next segment


class StoreTamperedError(Exception):
    """Something other than this run's processes changed its store. ``rank``: the worker whose
    messages it affected (``None``: not one in particular)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple[Any, ...]:  # crosses processes inside failure records
        return (StoreTamperedError, (str(self), self.rank))


class ForgedMessageError(Exception):
    """A message on the store was not sealed with the run's key, or was a replay."""


class LostMessageError(StoreTamperedError):
    """Messages ``first..last`` that ``sender`` sent never arrived: something else removed them
    from the store. ``rank`` is the worker they came from (``None``: the driver)."""

    def __init__(self, sender: int, first: int, last: int) -> None:
        super().__init__(
            f"message(s) #{first}..#{last} from {who(sender)} never arrived: something else removed them "
            "from this run's store (the store was tampered with)",
            None if sender == DRIVER else sender & ~BEAT_SENDER,
        )
        self.sender, self.first, self.last = sender, first, last

    def __reduce__(self) -> tuple[Any, ...]:
        return (LostMessageError, (self.sender, self.first, self.last))


@dataclass(frozen=True)
class Derived:
    aead: AESGCM
    queue_names: bytes  # 16 bytes: the queues' name prefix
    log_names: bytes  # names the workers' log segments and the wake key


def _derive(secret: bytes, purpose: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=b"ddptrain channel: " + purpose).derive(
        secret
    )


@functools.lru_cache(maxsize=16)
def derived(secret: bytes) -> Derived:
    """The keys of one secret, each for one purpose."""
    return Derived(
        AESGCM(_derive(secret, b"message key", 32)),
        _derive(secret, b"queue names", 16),
        _derive(secret, b"log names", 32),
    )


def seal(
    secret: bytes,
    aad: bytes,
    sender: int,
    number: int,
    part: int,
    parts: int,
    flags: int,
    payload: Any,
    length: struct.Struct | None = None,
) -> bytes:
    """One sealed record (``payload``: bytes-like), with its size in front when ``length`` is given."""
    nonce = os.urandom(_NONCE)
    sealed = derived(secret).aead.encrypt(nonce, _HEADER.pack(sender, number, part, parts, flags) + payload, aad)
    if length is None:
        return nonce + sealed
    return b"".join((length.pack(_NONCE + len(sealed)), nonce, sealed))


def unseal(secret: bytes, aad: bytes, record: Any) -> tuple[int, int, int, int, int, memoryview]:
    """``(sender, number, part, parts, flags, payload)`` of a sealed record.

    Raises:
        ForgedMessageError: It was not sealed with this secret for ``aad``; nothing was unpickled.
    """
    view = memoryview(record)
    try:
        if len(view) < OVERHEAD:
            raise InvalidTag
        plain = derived(secret).aead.decrypt(view[:_NONCE], view[_NONCE:], aad)
    except InvalidTag:
        raise ForgedMessageError(f"rejected a store message of {len(view)} bytes with a bad signature") from None
    sender, number, part, parts, flags = _HEADER.unpack_from(plain)
    return sender, number, part, parts, flags, memoryview(plain)[_HEADER.size :]


def who(sender: int) -> str:
    if sender == DRIVER:
        return "the driver"
    if sender & BEAT_SENDER:
        return f"rank {sender & ~BEAT_SENDER}'s heartbeat"
    return f"rank {sender}"


class RateLimitedWarnings:
    """Warnings about rejected store messages: the first ``burst`` of each ``interval_s`` one
    by one, the rest as one line with their count (a flood must not flood the console)."""

    def __init__(self, logger: logging.Logger, who: str, interval_s: float = 10.0, burst: int = 3) -> None:
        self._logger, self._who, self._interval_s, self._burst = logger, who, interval_s, burst
        self._window = time.monotonic()
        self._shown = 0
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, reason: str, text: str) -> None:
        """One rejected message: ``reason`` counts it in the summary, ``text`` says what it was."""
        with self._lock:
            self._roll(time.monotonic())
            if self._shown < self._burst:
                self._shown += 1
                self._logger.warning("%s: %s (something else is writing to this run's store)", self._who, text)
            else:
                self._held[reason] = self._held.get(reason, 0) + 1

    def flush(self, force: bool = False) -> None:
        """Write the count of messages rejected silently, once their interval is over (or now)."""
        with self._lock:
            self._roll(float("inf") if force else time.monotonic())

    def _roll(self, now: float) -> None:
        if now - self._window < self._interval_s:
            return
        if self._held:
            counts = ", ".join(f"{n} {reason}" for reason, n in sorted(self._held.items()))
            self._logger.warning(
                "%s: rejected %d more store messages in the last %.0f s (%s): something else is writing to "
                "this run's store",
                self._who,
                sum(self._held.values()),
                time.monotonic() - self._window,
                counts,
            )
        self._window, self._shown, self._held = time.monotonic(), 0, {}


@dataclass
class _Partial:
    number: int
    parts: int
    pieces: list[bytes] = field(default_factory=list)
    nbytes: int = 0


class Order:
    """Each sender's message numbers, and the parts of its large messages until they are whole."""

    def __init__(self) -> None:
        self.expected: dict[int, int] = {}
        self.partial: dict[int, _Partial] = {}
        self.partial_bytes = 0  # held in unfinished messages

    def accept(self, sender: int, number: int, part: int, parts: int, piece: memoryview) -> bytes | None:
        """Take one record; the whole message once its last part is in, else ``None``.

        Raises:
            ForgedMessageError: A replay (a number already taken).
            LostMessageError: Records before this one never came.
        """
        expected = self.expected.get(sender, 0)
        partial = self.partial.get(sender)
        next_part = len(partial.pieces) if partial is not None else 0
        if number < expected or (number == expected and part < next_part):
            raise ForgedMessageError(
                f"rejected a replayed store message (#{number} from {who(sender)}, which was already received)"
            )
        if number > expected or part > next_part or (partial is not None and partial.parts != parts):
            # Lost: the messages before this one, and this one too if its first parts are missing.
            last = number - 1 if number > expected and part == 0 else number
            self._drop(sender)
            self.expected[sender] = number + 1
            raise LostMessageError(sender, expected, last)
        if parts == 1:
            self.expected[sender] = number + 1
            return bytes(piece)
        if partial is None:
            partial = self.partial[sender] = _Partial(number, parts)
        partial.pieces.append(bytes(piece))
        partial.nbytes += len(piece)
        self.partial_bytes += len(piece)
        if len(partial.pieces) < parts:
            return None
        self._drop(sender)
        self.expected[sender] = number + 1
        return b"".join(partial.pieces)

    def _drop(self, sender: int) -> None:
        partial = self.partial.pop(sender, None)
        if partial is not None:
            self.partial_bytes -= partial.nbytes


def split(payload: bytes) -> list[tuple[int, int, Any]]:
    """``(part, parts, piece)`` of a message's pickled bytes."""
    if len(payload) <= PART_BYTES:
        return [(0, 1, payload)]
    view = memoryview(payload)
    count = -(-len(view) // PART_BYTES)
    return [(part, count, view[part * PART_BYTES : (part + 1) * PART_BYTES]) for part in range(count)]
