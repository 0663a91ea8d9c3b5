"""Encrypted, numbered messages through the driver's TCPStore: the one module that names store keys.

Anyone who can reach the store's port can list its plain keys, read and delete them, and push
to or pop from any queue whose name they know. So:

- every message is sealed with AES-256-GCM under a key derived from the run's secret (HKDF,
  ``ddptrain.wire.sealing``): nothing is readable on the store, and nothing is unpickled before its
  tag checks out. The secret travels over the process pipe or the SSH channel only, never
  through the store or the run directory;
- queue names carry 128 bits derived from the secret, and queues are not listed by the store;
  the plain keys the workers write (below) are named by a second derived key, so they give
  nothing of the queue names away;
- each sender numbers its messages per queue: a replayed message is rejected, and a missing one
  (someone popped or deleted it) fails the run instead of losing a report silently;
- messages larger than ``PART_BYTES`` travel as several sealed parts, so return values,
  metrics and broadcasts of any size get through without a plain key.

The driver sends to one queue per rank (:class:`Outbox` and :class:`Inbox`). Workers send
to the driver through a log of their own (``Outbox(logs=keys)``): sealed records appended to
numbered segment keys, after which they touch the wake key the driver waits on. The driver
reads every sender's new records with one ``multi_get`` (``ddptrain.wire.driver_channel``), where
a queue would cost a round trip per message: that keeps up with thousands of reports a second.

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
from typing import Any

import cloudpickle
import torch.distributed as dist

from ddptrain.wire import protocol
from ddptrain.wire.sealing import (
    BEAT_SENDER,
    DRIVER,
    END_OF_SEGMENT,
    OVERHEAD,
    ForgedMessageError,
    LostMessageError,
    Order,
    RateLimitedWarnings,
    StoreTamperedError,
    derived,
    seal,
    split,
    unseal,
)

__all__ = [
    "Keys",
    "ForgedMessageError",
    "LostMessageError",
    "StoreTamperedError",
    "RateLimitedWarnings",
    "sign",
    "verify",
    "open_message",
    "Outbox",
    "Inbox",
    "WorkerChannel",
    "connect",
    "open_store",
    "DRIVER",
]

_logger = logging.getLogger(__name__)
# Blocking waits on the store last this long before looping; a quiet run is not an error.
_LONG_WAIT = datetime.timedelta(days=7)
LENGTH = struct.Struct(">I")  # in front of each record of a log segment
HEARTBEAT_S = 2.0  # between a worker's heartbeats (WorkerChannel.start_heartbeat)
NOTICE_POLL_S = 0.25  # how often the heartbeat thread looks for the driver's notices
# A worker's log segment ends after this many records or bytes, or with the first record
# written this long after it began (the driver reads a segment whole each time, so what it has
# read already should stay short, and deletes it once it has ended).
SEGMENT_RECORDS = 32
SEGMENT_BYTES = 16 * 2**10
SEGMENT_S = 1.0


class Keys:
    """Store keys of one worker group. Nothing else formats key strings.

    Queue names share :attr:`prefix`, 128 bits derived from the secret; the store does not list
    queues. The plain keys of the workers' logs (which the store lists to anyone) are named by
    another derived key, one name per segment, so they tell nothing of the queues or each other.
    """

    def __init__(self, secret: bytes) -> None:
        material = derived(secret)
        self.prefix = "ddptrain/" + material.queue_names.hex()
        # The driver's queue: what workers send it travels through their logs, so anything
        # pushed here is a replay or a forgery (the driver drains it to say so).
        self.to_driver = f"{self.prefix}/to_driver"
        # What a log record is bound to (a record copied onto a queue does not open there).
        self.log_aad = self.to_driver.encode() + b"\0log"
        self._log_names = material.log_names
        self.wake = self._log_key(b"wake")

    def to_worker(self, rank: int) -> str:
        return f"{self.prefix}/to_worker/{rank}"

    def notices(self, rank: int) -> str:
        """The queue of notices to ``rank`` that arrive while it trains (preemption)."""
        return f"{self.prefix}/notices/{rank}"

    def segment(self, sender: int, index: int) -> str:
        """Segment ``index`` of the log of ``sender``."""
        return self._log_key(f"segment/{sender}/{index}".encode())

    def _log_key(self, what: bytes) -> str:
        return "ddptrain/" + hmac.new(self._log_names, what, hashlib.sha256).hexdigest()[:32]


def _pickle(obj: Any, plain_pickle: bool) -> bytes:
    if plain_pickle:
        try:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            pass
    data: bytes = cloudpickle.dumps(obj)
    return data


def sign(secret: bytes, key: str, obj: Any, *, sender: int = 0, number: int = 0, plain_pickle: bool = False) -> bytes:
    """``obj`` sealed as message ``number`` of ``sender`` for the queue ``key`` (one part).

    ``plain_pickle`` tries the (faster) standard pickle first; only for plain data whose
    classes the receiver can import, such as metrics sent to the driver.
    """
    return seal(secret, key.encode(), sender, number, 0, 1, 0, _pickle(obj, plain_pickle))


def open_message(secret: bytes, key: str, data: bytes) -> tuple[int, int, Any]:
    """Open a one-part message read from queue ``key``: ``(sender, number, object)``.

    Raises:
        ForgedMessageError: It was not sealed for ``key`` with this secret; nothing was unpickled.
    """
    sender, number, _part, _parts, _flags, payload = unseal(secret, key.encode(), data)
    return sender, number, pickle.loads(payload)


def verify(secret: bytes, key: str, data: bytes) -> Any:
    """Open a message read from queue ``key`` and unpickle it (no order check)."""
    return open_message(secret, key, data)[2]


class Outbox:
    """One sender's end: numbers its messages per queue and splits large ones into parts.

    Args:
        logs: For a worker: its messages to ``logs.to_driver`` are appended to its own log
            (segment keys) and announced on the wake key, instead of pushed to the queue.
    """

    def __init__(self, store: dist.TCPStore, secret: bytes, sender: int, logs: Keys | None = None) -> None:
        self.store = store
        self.secret = secret
        self.sender = sender
        self._logs = logs
        self._numbers: dict[str, int] = {}
        self._pushed: dict[str, int] = {}  # messages whose push has returned, per queue
        self._lock = threading.Lock()  # numbers must reach the store in order
        # Pushes are fire-and-forget: once two connections push (see `push`'s `store`), each push
        # waits until the store has processed it, or a later one on the other could overtake it.
        self.round_trip = False
        self._segment, self._segment_records, self._segment_bytes, self._segment_began = 0, 0, 0, 0.0
        self._segment_key = logs.segment(sender, 0) if logs is not None else ""

    def pushed(self, key: str) -> int:
        """How many messages were pushed to ``key`` so far (their pushes returned)."""
        return self._pushed.get(key, 0)

    def push(self, key: str, obj: Any, *, plain_pickle: bool = False, store: dist.TCPStore | None = None) -> None:
        """Push ``obj`` to ``key`` (through ``store``: another connection to the same store, for
        a thread that must not wait for the one blocked in a pop; the numbering is shared)."""
        payload = _pickle(obj, plain_pickle)
        store = store if store is not None else self.store
        with self._lock:
            number = self._numbers.get(key, 0)
            self._numbers[key] = number + 1
            if self._logs is not None and key == self._logs.to_driver:
                self._append(store, number, payload)
            else:
                aad = key.encode()
                for part, parts, piece in split(payload):
                    record = seal(self.secret, aad, self.sender, number, part, parts, 0, piece)
                    store.queue_push(key, record)
            if self.round_trip:
                store.check([key])  # answered after the writes above are processed
            self._pushed[key] = number + 1

    def _append(self, store: dist.TCPStore, number: int, payload: bytes) -> None:
        assert self._logs is not None
        aad = self._logs.log_aad
        now = time.monotonic()
        for part, parts, piece in split(payload):
            size = OVERHEAD + len(piece)
            if not self._segment_records:
                self._segment_began = now
            ends = (
                self._segment_records + 1 >= SEGMENT_RECORDS
                or self._segment_bytes + size >= SEGMENT_BYTES
                or now - self._segment_began >= SEGMENT_S
            )
            flags = END_OF_SEGMENT if ends else 0
            record = seal(self.secret, aad, self.sender, number, part, parts, flags, piece, LENGTH)
            store.append(self._segment_key, record)  # type: ignore[attr-defined]
            if ends:
                self._segment += 1
                self._segment_records = self._segment_bytes = 0
                self._segment_key = self._logs.segment(self.sender, self._segment)
            else:
                self._segment_records += 1
                self._segment_bytes += size
        store.append(self._logs.wake, b"")  # type: ignore[attr-defined]


class Inbox:
    """A receiving end of one queue: opens messages, checks their order, joins their parts."""

    def __init__(self, store: dist.TCPStore, secret: bytes, key: str) -> None:
        self.store = store
        self.secret = secret
        self.key = key
        self._order = Order()

    def received(self, sender: int) -> int:
        """How many messages of ``sender`` arrived so far."""
        return self._order.expected.get(sender, 0)

    def pop(self) -> Any:
        """Block until the next whole message; raises ForgedMessageError or LostMessageError."""
        while True:
            try:
                data = self.store.queue_pop(self.key)
            except dist.QueueEmptyError:  # another client popped it between the wait and the pop
                continue
            sender, number, part, parts, _flags, piece = unseal(self.secret, self.key.encode(), data)
            whole = self._order.accept(sender, number, part, parts, piece)
            if whole is not None:
                return pickle.loads(whole)


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


class WorkerChannel:
    """Worker end: send to the driver (through this rank's log), pop this rank's commands."""

    def __init__(self, store: dist.TCPStore, keys: Keys, secret: bytes, rank: int) -> None:
        self.store = store
        self.keys = keys
        self.secret = secret
        self.rank = rank
        self._outbox = Outbox(store, secret, rank, logs=keys)
        self._inbox = Inbox(store, secret, keys.to_worker(rank))
        self._warnings = RateLimitedWarnings(_logger, f"ddptrain rank {rank}")
        self.on_notice: Callable[[Any], None] | None = None  # called in the heartbeat thread
        self._address: tuple[str, int] | None = None  # the store's, for other connections
        self._aside: dist.TCPStore | None = None  # see send_aside
        self._aside_lock = threading.Lock()

    def send(self, obj: Any) -> None:
        """Send a sealed message to the driver."""
        self._outbox.push(self.keys.to_driver, obj, plain_pickle=True)

    def order_across_connections(self) -> None:
        """From now on every message is in the store before the next is sent: call it before
        the first message that :meth:`send_aside` may follow (the two connections' writes
        could otherwise reach the store out of order, and the driver would take one as lost)."""
        self._outbox.round_trip = True

    def send_aside(self, obj: Any) -> None:
        """Send a message from another thread than the one that receives (a background
        upload's): over a connection of its own, since the main one may be blocked in a pop,
        in the same order as :meth:`send`'s messages."""
        with self._aside_lock:
            if self._aside is None:
                assert self._address is not None, "start_heartbeat names the store first"
                self._aside = connect(*self._address, timeout_s=30)
        self._outbox.push(self.keys.to_driver, obj, plain_pickle=True, store=self._aside)

    def start_heartbeat(self, host: str, port: int, interval_s: float = HEARTBEAT_S) -> None:
        """Every ``interval_s``, tell the driver how many messages this rank has sent, over a
        connection of its own (the main one may be blocked in a pop). A message someone removed
        from the store is then noticed within two beats, even the last one."""
        self._address = (host, port)
        store = connect(host, port, timeout_s=30)
        beats = Outbox(store, self.secret, self.rank | BEAT_SENDER, logs=self.keys)
        notices = Inbox(store, self.secret, self.keys.notices(self.rank))
        step_s = min(interval_s, NOTICE_POLL_S)

        def beat() -> None:
            next_beat = time.monotonic() + interval_s
            while True:
                time.sleep(step_s)
                try:
                    # The driver's notices (preemption) are looked for between beats.
                    while store.queue_len(notices.key) > 0:
                        notice = notices.pop()
                        if self.on_notice is not None:
                            self.on_notice(notice)
                    if time.monotonic() >= next_beat:
                        next_beat += interval_s
                        pushed = self._outbox.pushed(self.keys.to_driver)
                        beats.push(self.keys.to_driver, protocol.Beat(self.rank, pushed))
                except (ForgedMessageError, LostMessageError) as exc:
                    self._warnings.warn("notice refused", str(exc))
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
                command = self._inbox.pop()
                self._warnings.flush()  # the count of those rejected meanwhile, once a while
                return command
            except ForgedMessageError as exc:
                self._warnings.warn("replayed" if "replayed" in str(exc) else "with a bad signature", str(exc))
