"""Signed, numbered messages through the driver's TCPStore: the one module that names store keys.

Workers push messages (reports, call results, completion) to one driver queue; the driver
pushes commands to one queue per rank. Every message is ``HMAC-SHA256(secret, key, sender,
number, payload) || sender || number || payload`` and is checked before it is unpickled:

- the secret travels over the process pipe or the SSH channel only, never through the store
  or the run directory, so nobody who can reach the store can forge a message;
- queue names are derived from the secret, so they cannot be guessed from anything on disk;
- each sender numbers its messages per queue: a replayed message is rejected, and a missing
  one (someone popped it) fails the run instead of losing a report silently;
- messages larger than ``CHUNK_BYTES`` travel as several store values, announced by a small
  signed message, so return values, metrics and broadcasts of any size get through.

The store of a local run listens on loopback only (:func:`open_store`).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch.distributed as dist

from ddptrain import protocol

__all__ = [
    "Keys",
    "ForgedMessageError",
    "Lost",
    "LostMessageError",
    "sign",
    "verify",
    "open_message",
    "Outbox",
    "Inbox",
    "DriverChannel",
    "WorkerChannel",
    "connect",
    "open_store",
    "DRIVER",
]

_logger = logging.getLogger(__name__)
_DIGEST = hashlib.sha256
_MAC_BYTES = 32
_HEADER = struct.Struct(">Iq")  # sender, message number
# Blocking queue pops wait this long before looping; a quiet run is not an error.
_LONG_WAIT = datetime.timedelta(days=7)
STOP = "__ddptrain_stop__"
DRIVER = 0xFFFFFFFF  # the driver's sender id
# The store's server drops connections that send values of about 8 MiB or more.
CHUNK_BYTES = 4 * 2**20
_CHUNKS = "__ddptrain_chunks__"
_BEAT_SENDER = 0x40000000  # a rank's heartbeats are numbered apart from its messages


class ForgedMessageError(Exception):
    """A message on the store did not carry a valid signature, or was a replay."""


class LostMessageError(Exception):
    """Messages ``first..last`` that ``sender`` pushed never arrived: someone else removed them
    from the store. ``rank`` is the worker they came from (``None``: the driver)."""

    def __init__(self, sender: int, first: int, last: int) -> None:
        super().__init__(
            f"message(s) #{first}..#{last} from {_who(sender)} never arrived: something else removed them "
            "from this run's store"
        )
        self.sender, self.first, self.last = sender, first, last
        self.rank = None if sender == DRIVER else sender & ~_BEAT_SENDER

    def __reduce__(self) -> tuple[Any, ...]:  # crosses processes inside failure records
        return (LostMessageError, (self.sender, self.first, self.last))


@dataclass(frozen=True)
class Lost:
    """What the driver's consumer hands on when messages from ``error.rank`` were removed from
    the store (never on the wire: the driver makes it from a :class:`LostMessageError`)."""

    error: LostMessageError

    @property
    def rank(self) -> int:
        return 0 if self.error.rank is None else int(self.error.rank)


class Keys:
    """Store keys of one attempt of one run. Nothing else formats key strings.

    The names come from the attempt's secret, so nobody who lacks it can name a queue.
    """

    def __init__(self, secret: bytes) -> None:
        self.prefix = "ddptrain/" + hmac.new(secret, b"queue names", _DIGEST).hexdigest()[:32]

    @property
    def to_driver(self) -> str:
        return f"{self.prefix}/to_driver"

    def to_worker(self, rank: int) -> str:
        return f"{self.prefix}/to_worker/{rank}"


def _mac(secret: bytes, key: str, body: bytes) -> bytes:
    # The MAC covers the queue's key too: a message is only valid on the queue it was sent to.
    return hmac.new(secret, key.encode() + b"\0" + body, _DIGEST).digest()


def sign(secret: bytes, key: str, obj: Any, *, sender: int = 0, number: int = 0, plain_pickle: bool = False) -> bytes:
    """Pickle ``obj`` for the queue ``key`` as message ``number`` of ``sender``, MAC in front.

    ``plain_pickle`` tries the (faster) standard pickle first; only for plain data whose
    classes the receiver can import, such as metrics sent to the driver.
    """
    payload = b""
    if plain_pickle:
        try:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            payload = b""
    if not payload:
        payload = cloudpickle.dumps(obj)
    body = _HEADER.pack(sender, number) + payload
    return _mac(secret, key, body) + body


def open_message(secret: bytes, key: str, data: bytes) -> tuple[int, int, Any]:
    """Check the MAC of ``data`` read from queue ``key``; returns ``(sender, number, object)``.

    Raises:
        ForgedMessageError: The MAC is wrong; nothing was unpickled.
    """
    mac, body = data[:_MAC_BYTES], data[_MAC_BYTES:]
    if len(body) < _HEADER.size or not hmac.compare_digest(mac, _mac(secret, key, body)):
        raise ForgedMessageError(f"rejected a store message of {len(data)} bytes with a bad signature")
    sender, number = _HEADER.unpack_from(body)
    return sender, number, pickle.loads(body[_HEADER.size :])


def verify(secret: bytes, key: str, data: bytes) -> Any:
    """Check the MAC of ``data`` read from queue ``key``, then unpickle it (no order check)."""
    return open_message(secret, key, data)[2]


def _who(sender: int) -> str:
    if sender == DRIVER:
        return "the driver"
    if sender & _BEAT_SENDER:
        return f"rank {sender & ~_BEAT_SENDER}'s heartbeat"
    return f"rank {sender}"


class Outbox:
    """One sender's end: numbers its messages per queue and splits large ones."""

    def __init__(self, store: dist.TCPStore, secret: bytes, sender: int) -> None:
        self.store = store
        self.secret = secret
        self.sender = sender
        self._numbers: dict[str, int] = {}
        self._pushed: dict[str, int] = {}  # messages whose push has returned, per queue
        self._lock = threading.Lock()  # numbers must reach the queue in order

    def pushed(self, key: str) -> int:
        """How many messages were pushed to ``key`` so far (their pushes returned)."""
        return self._pushed.get(key, 0)

    def push(self, key: str, obj: Any, *, plain_pickle: bool = False) -> None:
        with self._lock:
            number = self._numbers.get(key, 0)
            self._numbers[key] = number + 1
            data = sign(self.secret, key, obj, sender=self.sender, number=number, plain_pickle=plain_pickle)
            if len(data) > CHUNK_BYTES:
                blob = f"{key}/blob/{self.sender}/{number}"
                count = 0
                for offset in range(0, len(data), CHUNK_BYTES):
                    self.store.set(f"{blob}/{count}", data[offset : offset + CHUNK_BYTES])  # type: ignore[arg-type]
                    count += 1
                announce = (_CHUNKS, blob, count)
                data = sign(self.secret, key, announce, sender=self.sender, number=number, plain_pickle=True)
            self.store.queue_push(key, data)
            self._pushed[key] = number + 1


class Inbox:
    """A receiving end of one queue: checks signatures, order, and joins split messages."""

    def __init__(self, store: dist.TCPStore, secret: bytes, key: str) -> None:
        self.store = store
        self.secret = secret
        self.key = key
        self._expected: dict[int, int] = {}

    def received(self, sender: int) -> int:
        """How many messages of ``sender`` arrived so far."""
        return self._expected.get(sender, 0)

    def pop(self) -> Any:
        """Block until the next message; raises ForgedMessageError or LostMessageError."""
        data = self.store.queue_pop(self.key)
        sender, number, obj = open_message(self.secret, self.key, data)
        expected = self._expected.get(sender, 0)
        if number < expected:
            raise ForgedMessageError(
                f"rejected a replayed store message (#{number} from {_who(sender)}, which was already received)"
            )
        if number > expected:
            self._expected[sender] = number + 1
            raise LostMessageError(sender, expected, number - 1)
        self._expected[sender] = number + 1
        if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == _CHUNKS:
            names = [f"{obj[1]}/{i}" for i in range(obj[2])]
            data = b"".join(self.store.multi_get(names))
            for name in names:
                self.store.delete_key(name)
            inner_sender, inner_number, obj = open_message(self.secret, self.key, data)
            if (inner_sender, inner_number) != (sender, number):
                raise ForgedMessageError("rejected a split store message that does not match its announcement")
        return obj


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client connection to the driver's store."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def open_store(bind_address: str, timeout_s: float = 30.0) -> dist.TCPStore:
    """The driver's store, listening on ``bind_address`` only (``"0.0.0.0"``: every interface).

    torch's own server would listen on every interface; here it serves a socket bound first.
    """
    family = socket.AF_INET6 if ":" in bind_address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind_address, 0))
        listener.listen(1024)
        port = listener.getsockname()[1]
        host = "127.0.0.1" if bind_address in ("0.0.0.0", "::") else bind_address
        store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(),
            use_libuv=True,
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket now and closes it
    return store


class DriverChannel:
    """Driver end: one thread pops worker messages and hands verified ones to ``on_message``."""

    def __init__(self, store: dist.TCPStore, keys: Keys, secret: bytes) -> None:
        self._store = store
        self._keys = keys
        self._secret = secret
        self._outbox = Outbox(store, secret, DRIVER)
        self._claims: dict[int, int] = {}  # rank -> messages its last heartbeat said it had pushed
        self._thread: threading.Thread | None = None

    def start(self, on_message: Callable[[Any], None]) -> None:
        """Start consuming; ``on_message`` runs in the consumer thread.

        Messages that went missing on the store are handed on as :class:`Lost`
        (a :class:`LostMessageError`).
        """
        reader = connect(self._store.host, self._store.port, timeout_s=30)
        reader.set_timeout(_LONG_WAIT)
        inbox = Inbox(reader, self._secret, self._keys.to_driver)

        def consume() -> None:
            while True:
                try:
                    message = inbox.pop()
                except ForgedMessageError as exc:
                    _logger.warning("ddptrain: %s (someone else is writing to this run's store)", exc)
                    continue
                except LostMessageError as exc:
                    on_message(Lost(exc))
                    continue
                except (pickle.UnpicklingError, AttributeError, ImportError, EOFError) as exc:
                    _logger.warning("ddptrain: could not decode a worker message: %r", exc)
                    continue
                except Exception as exc:  # the store is going away
                    _logger.debug("driver channel stopped: %s", exc)
                    return
                if message == STOP:
                    return
                if isinstance(message, protocol.Beat):
                    lost = self._check_beat(inbox, message.rank, message.pushed)
                    if lost is not None:
                        on_message(Lost(lost))
                    continue
                on_message(message)

        self._thread = threading.Thread(target=consume, name="ddptrain-channel", daemon=True)
        self._thread.start()

    def _check_beat(self, inbox: Inbox, rank: int, pushed: int) -> LostMessageError | None:
        """A worker's heartbeat says how many messages it had pushed; if what the previous beat
        claimed has still not arrived, someone removed it from the store (even the last one)."""
        claimed = self._claims.get(rank)
        self._claims[rank] = pushed
        received = inbox.received(rank)
        if claimed is not None and received < claimed:
            self._claims.pop(rank)
            return LostMessageError(rank, received, claimed - 1)
        return None

    def send(self, rank: int, obj: Any) -> None:
        """Push a signed command to one worker."""
        self._outbox.push(self._keys.to_worker(rank), obj)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the consumer thread (safe to call twice)."""
        if self._thread is None:
            return
        try:
            self._outbox.push(self._keys.to_driver, STOP)
        except Exception as exc:
            _logger.debug("could not wake the channel thread: %s", exc)
        self._thread.join(timeout_s)
        self._thread = None


class WorkerChannel:
    """Worker end: push to the driver, pop this rank's commands."""

    def __init__(self, store: dist.TCPStore, keys: Keys, secret: bytes, rank: int) -> None:
        self.store = store
        self.keys = keys
        self.secret = secret
        self.rank = rank
        self._outbox = Outbox(store, secret, rank)
        self._inbox = Inbox(store, secret, keys.to_worker(rank))

    def send(self, obj: Any) -> None:
        """Push a signed message to the driver."""
        self._outbox.push(self.keys.to_driver, obj, plain_pickle=True)

    def start_heartbeat(self, host: str, port: int, interval_s: float) -> None:
        """Every ``interval_s``, tell the driver how many messages this rank has pushed, over a
        connection of its own (the main one may be blocked in a pop). A message someone removed
        from the store is then noticed within two beats, even the last one."""
        beats = Outbox(connect(host, port, timeout_s=30), self.secret, self.rank | _BEAT_SENDER)

        def beat() -> None:
            while True:
                time.sleep(interval_s)
                try:
                    beats.push(self.keys.to_driver, protocol.Beat(self.rank, self._outbox.pushed(self.keys.to_driver)))
                except Exception:
                    return  # the store is gone, and with it the driver

        threading.Thread(target=beat, name="ddptrain-heartbeat", daemon=True).start()

    def recv(self) -> Any:
        """Block until the driver sends this rank a command.

        Raises:
            LostMessageError: A command of the driver's was removed from the store.
        """
        while True:
            try:
                return self._inbox.pop()
            except ForgedMessageError as exc:
                _logger.warning("ddptrain rank %d: %s", self.rank, exc)
