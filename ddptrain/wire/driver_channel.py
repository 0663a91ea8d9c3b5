"""The driver's end of the store channel: one thread reads what every worker sent and hands it
on in batches; the driver's commands go to each rank's queue.

Workers append sealed records to segments of their own log (``ddptrain.channel``) and touch the
wake key. The thread waits on that key, then reads the current segment of every sender with one
``multi_get``, opens the new records, checks their numbers and hands the messages on as one
:class:`Batch`. A segment whose last record says so is deleted and its successor read next, until
nothing new is left. Thousands of reports a second cost a few store round trips, not one each.

Whatever else happens to the store, the run fails within a bound instead of hanging, naming what
was done. Every current segment exists from the moment the driver knows of it, so a read that
waits for one (``DDPTRAIN_STORE_TAMPER_TIMEOUT_S``) waits for a key someone deleted; records
missing or rewritten show in the numbers, the lengths, and the heartbeats (each rank says every
2 s how many messages it sent); a flood on the driver's queue is counted against the cap below.
Forged or replayed records are skipped with rate-limited warnings.
What the driver holds for messages it has not handled yet is capped
(``DDPTRAIN_CHANNEL_MAX_UNREAD_MB``): past the cap the run fails with :class:`ChannelError`, as
it does when the thread stops for any other reason.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ddptrain import _env
from ddptrain.errors import ChannelError
from ddptrain.wire import protocol
from ddptrain.wire.channel import _LONG_WAIT, LENGTH, SEGMENT_BYTES, Keys, Outbox, connect
from ddptrain.wire.sealing import (
    BEAT_SENDER,
    DRIVER,
    END_OF_SEGMENT,
    OVERHEAD,
    PART_BYTES,
    ForgedMessageError,
    LostMessageError,
    Order,
    RateLimitedWarnings,
    StoreTamperedError,
    unseal,
)

__all__ = ["Batch", "DriverChannel", "Undelivered"]

_logger = logging.getLogger(__name__)
_READ_INTERVAL_S = 0.001
_QUEUE_CHECK_S = 0.05  # how often the driver's queue is drained of replays and forgeries
# At most this many of them (or bytes) per look: they must not starve real messages.
_QUEUE_BUDGET, _QUEUE_BUDGET_BYTES = 1000, 16 * 2**20
_MiB = 2**20
# The most a segment holds as its sender writes it: short of SEGMENT_BYTES, then one last record.
_SEGMENT_MAX = SEGMENT_BYTES + PART_BYTES + OVERHEAD + 2 * LENGTH.size


@dataclass
class Batch:
    """Messages read in one pass, oldest first. Their ``nbytes`` count as held by the driver
    until :meth:`DriverChannel.release` says they were handled."""

    messages: list[Any]
    nbytes: int


@dataclass(frozen=True)
class Undelivered:
    """A message from ``rank`` that the driver did not get whole: something removed it from the
    store (``error``: a :class:`~ddptrain.sealing.LostMessageError`), or it could not be
    unpickled. Handed on in order, like the messages."""

    rank: int
    error: BaseException


@dataclass
class _Log:
    """How far the driver has read one sender's log."""

    sender: int
    key: str  # its current segment
    segment: int = 0
    offset: int = 0  # bytes of the segment already read

    @property
    def rank(self) -> int:
        return self.sender & ~BEAT_SENDER


@dataclass
class _Pass:
    """What one drain found."""

    messages: list[Any] = field(default_factory=list)
    beats: list[protocol.Beat] = field(default_factory=list)
    nbytes: int = 0


def _who(log: _Log) -> str:
    return f"rank {log.rank}'s heartbeat" if log.sender & BEAT_SENDER else f"rank {log.rank}"


class DriverChannel:
    """Driver end of the channel for a group of ``world_size`` workers."""

    def __init__(self, store: dist.TCPStore, keys: Keys, secret: bytes, world_size: int) -> None:
        self._store = store
        self._keys = keys
        self._secret = secret
        self._aad = keys.log_aad
        self._outbox = Outbox(store, secret, DRIVER)
        senders = [*range(world_size), *(rank | BEAT_SENDER for rank in range(world_size))]
        self._logs = {sender: _Log(sender, keys.segment(sender, 0)) for sender in senders}
        self._order = Order()
        self._claims: dict[int, int] = {}  # rank -> messages its last heartbeat said it had sent
        self._held = 0  # bytes handed on and not released yet
        self._held_lock = threading.Lock()
        self.max_unread_bytes = int(_env.channel_max_unread_mb() * _MiB)
        self.tamper_timeout_s = _env.store_tamper_timeout_s()
        self._warnings = RateLimitedWarnings(_logger, "ddptrain driver")
        self._queue_checked = 0.0
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- the driver's side
    def start(self, on_batch: Callable[[Batch], None], on_failure: Callable[[BaseException], None]) -> None:
        """Start reading; ``on_batch`` and ``on_failure`` run in the channel's thread.

        ``on_failure`` gets a :class:`~ddptrain.channel.StoreTamperedError` naming the rank whose
        messages were tampered with, or a :class:`ChannelError`; the thread has stopped then.
        Messages that went missing on the store are handed on as :class:`Undelivered`.
        """
        host, port = self._store.host, self._store.port
        # A read that waits this long can only wait for a segment someone deleted.
        reader = connect(host, port, timeout_s=self.tamper_timeout_s)
        waiter = connect(host, port, timeout_s=30)
        waiter.set_timeout(_LONG_WAIT)
        for log in self._logs.values():
            reader.append(log.key, b"")  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._run, args=(reader, waiter, on_batch, on_failure), name="ddptrain-channel", daemon=True
        )
        self._thread.start()

    def send(self, rank: int, obj: Any) -> None:
        """Push a sealed command to one worker."""
        self._outbox.push(self._keys.to_worker(rank), obj)

    def notify(self, rank: int, obj: Any) -> None:
        """Push a sealed notice to one worker, read while it trains (``Keys.notices``)."""
        self._outbox.push(self._keys.notices(rank), obj)

    def release(self, nbytes: int) -> None:
        """A batch of ``nbytes`` was handled: the driver no longer holds it."""
        with self._held_lock:
            self._held -= nbytes

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (safe to call twice); it looks at the driver's queue one last time."""
        if self._thread is None:
            return
        self._stopping = True
        try:
            self._store.append(self._keys.wake, b"")  # type: ignore[attr-defined]
        except Exception as exc:
            _logger.debug("could not wake the channel thread: %s", exc)
        self._thread.join(timeout_s)
        self._thread = None

    # ----------------------------------------------------------------- the thread
    def _run(
        self,
        reader: dist.TCPStore,
        waiter: dist.TCPStore,
        on_batch: Callable[[Batch], None],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        read_at = 0.0
        try:
            while True:
                waiter.wait([self._keys.wake])
                # At most one read a millisecond: a busy run's messages come in batches, and a
                # quiet run's first message is read at once.
                time.sleep(max(0.0, read_at + _READ_INTERVAL_S - time.monotonic()))
                read_at = time.monotonic()
                waiter.delete_key(self._keys.wake)  # before reading: a later write wakes us again
                if self._stopping:
                    self._drain_queue(reader)
                    return
                self._drain(reader, on_batch)
                if time.monotonic() - self._queue_checked >= _QUEUE_CHECK_S:
                    self._drain_queue(reader)
                self._warnings.flush()
        except BaseException as exc:
            if self._stopping:
                _logger.debug("driver channel stopped: %s", exc)
                return
            if not isinstance(exc, (StoreTamperedError, ChannelError)):
                cause, exc = (
                    exc,
                    ChannelError(f"the driver stopped reading its workers' messages: {type(exc).__name__}: {exc}"),
                )
                exc.__cause__ = cause
            on_failure(exc)
        finally:
            self._warnings.flush(force=True)

    def _drain(self, reader: dist.TCPStore, on_batch: Callable[[Batch], None]) -> None:
        """Read every log to its end, handing on what each read finds (oldest first per sender).

        After a read, only the logs whose segment ended are read again; when heartbeats came,
        all of them once more: when nothing has ended, everything written before that last
        read has been read, which is what the heartbeats' claims are checked against."""
        beats: list[protocol.Beat] = []
        logs, every = list(self._logs.values()), True
        while True:
            found = _Pass()
            values = self._read(reader, logs)
            ended = [log for log, value in zip(logs, values, strict=True) if self._read_segment(log, value, found)]
            for log in ended:
                reader.delete_key(log.key)
                log.segment, log.offset = log.segment + 1, 0
                log.key = self._keys.segment(log.sender, log.segment)
                reader.append(log.key, b"")  # type: ignore[attr-defined]
            beats.extend(found.beats)
            self._hand_on(found, on_batch)
            if ended:
                logs, every = ended, False
            elif every or not beats:
                break
            else:
                logs, every = list(self._logs.values()), True
        self._hand_on(_Pass(messages=list(self._check_claims(beats))), on_batch)

    def _hand_on(self, found: _Pass, on_batch: Callable[[Batch], None]) -> None:
        held = self._held + found.nbytes + self._order.partial_bytes
        if held > self.max_unread_bytes:
            raise ChannelError(
                f"the driver holds {held / _MiB:.0f} MiB of worker messages it has not handled yet, more than "
                f"DDPTRAIN_CHANNEL_MAX_UNREAD_MB={self.max_unread_bytes / _MiB:g} allows. The driver falls behind "
                "its workers (a slow callback?), or they send very large metrics or return values: raise the "
                "limit if the driver has the memory."
            )
        if found.messages:
            with self._held_lock:
                self._held += found.nbytes
            on_batch(Batch(found.messages, found.nbytes))

    def _read(self, reader: dist.TCPStore, logs: list[_Log]) -> list[bytes]:
        try:
            return reader.multi_get([log.key for log in logs])
        except dist.DistStoreError as exc:
            gone = [log for log in logs if not reader.check([log.key])]
            if not gone:
                raise
            raise StoreTamperedError(
                f"the store key of {_who(gone[0])}'s messages to the driver was deleted (waited "
                f"{self.tamper_timeout_s:g} s for it, DDPTRAIN_STORE_TAMPER_TIMEOUT_S): something else removes "
                "keys from this run's store (the store was tampered with)",
                gone[0].rank,
            ) from exc

    def _read_segment(self, log: _Log, value: bytes, found: _Pass) -> bool:
        """Take the new records of one segment; whether it has ended."""
        if len(value) < log.offset:
            raise StoreTamperedError(
                f"{_who(log)}'s messages to the driver were replaced on the store: something else writes to "
                "this run's store (the store was tampered with)",
                log.rank,
            )
        if len(value) == log.offset:
            return False
        if len(value) > _SEGMENT_MAX:
            raise StoreTamperedError(
                f"{_who(log)}'s messages to the driver hold {len(value)} bytes, more than it ever writes: something "
                "else writes to this run's store (the store was tampered with)",
                log.rank,
            )
        view, offset = memoryview(value), log.offset
        while offset < len(view):
            end = len(view) + 1  # a length that does not fit: bytes its sender did not write
            if offset + LENGTH.size <= len(view):
                end = offset + LENGTH.size + LENGTH.unpack_from(view, offset)[0]
            if end > len(view):
                raise StoreTamperedError(
                    f"{_who(log)}'s messages to the driver hold bytes it did not write: something else writes "
                    "to this run's store (the store was tampered with)",
                    log.rank,
                )
            record, offset = view[offset + LENGTH.size : end], end
            if self._take(log, record, found):
                if offset < len(view):
                    self._warnings.warn(
                        "after the end of a log", "ignored bytes written after the end of a log segment"
                    )
                log.offset = len(view)
                return True
        log.offset = offset
        return False

    def _take(self, log: _Log, record: memoryview, found: _Pass) -> bool:
        """Open one record and hand on its message once whole; whether it ends its segment."""
        try:
            sender, number, part, parts, flags, piece = unseal(self._secret, self._aad, record)
            if sender != log.sender:
                raise ForgedMessageError(f"rejected a replayed store message (from {log.sender} in {_who(log)}'s log)")
            whole = self._order.accept(sender, number, part, parts, piece)
        except ForgedMessageError as exc:
            self._warnings.warn("replayed" if "replayed" in str(exc) else "with a bad signature", str(exc))
            return False
        except LostMessageError as exc:
            found.messages.append(Undelivered(log.rank, exc))
            return bool(flags & END_OF_SEGMENT)
        if whole is not None:
            try:
                message = pickle.loads(whole)
            except Exception as exc:  # whatever unpickling the sender's objects raises
                error = RuntimeError(
                    f"the driver could not unpickle message #{number} from {_who(log)} "
                    f"({type(exc).__name__}: {exc}). What workers report must unpickle in the driver: "
                    "plain data, or classes the driver's Python can import."
                )
                error.__cause__ = exc
                message = Undelivered(log.rank, error)
            if isinstance(message, protocol.Beat):
                found.beats.append(message)
            else:
                found.messages.append(message)
                found.nbytes += len(whole)
        return bool(flags & END_OF_SEGMENT)

    def _check_claims(self, beats: list[protocol.Beat]) -> list[Undelivered]:
        """A heartbeat says how many messages its rank had sent. When what the previous beat
        claimed has still not arrived (every log was read to its end since), someone removed it
        from the store, even the rank's last message."""
        lost = []
        for beat in beats:
            claimed = self._claims.get(beat.rank)
            self._claims[beat.rank] = beat.pushed
            received = self._order.expected.get(beat.rank, 0)
            if claimed is not None and received < claimed:
                self._claims.pop(beat.rank)
                lost.append(Undelivered(beat.rank, LostMessageError(beat.rank, received, claimed - 1)))
        return lost

    def _drain_queue(self, reader: dist.TCPStore) -> None:
        """Workers never push to the driver's queue: whatever is there was copied off the store
        or forged. Reject it, a bounded number per look; fail when it piles up past the cap."""
        self._queue_checked = time.monotonic()
        key = self._keys.to_driver
        waiting = reader.queue_len(key)
        popped = nbytes = 0
        while popped < min(waiting, _QUEUE_BUDGET) and nbytes < _QUEUE_BUDGET_BYTES:
            try:
                data = reader.queue_pop(key, False)
            except dist.QueueEmptyError:  # someone else popped it
                break
            popped += 1
            nbytes += len(data)
            try:
                sender, number, _part, _parts, _flags, _piece = unseal(self._secret, key.encode(), data)
            except ForgedMessageError as exc:
                self._warnings.warn("with a bad signature", str(exc))
                continue
            rank = "the driver" if sender == DRIVER else f"rank {sender & ~BEAT_SENDER}"
            self._warnings.warn(
                "replayed",
                f"rejected a replayed store message (#{number} from {rank}, pushed again to the driver's queue)",
            )
        left = waiting - popped
        if popped and left * nbytes / popped > self.max_unread_bytes:
            raise ChannelError(
                f"about {left * nbytes / popped / _MiB:.0f} MiB of forged or replayed messages ({left}) wait on the "
                f"driver's queue, more than DDPTRAIN_CHANNEL_MAX_UNREAD_MB={self.max_unread_bytes / _MiB:g}: "
                "something floods this run's store (the store was tampered with)"
            )
