"""Signed messages through the driver's TCPStore: the one module that names store keys.

Workers push messages (reports, call results, completion) to one driver queue; the driver
pushes commands to one queue per rank. Every message is ``HMAC-SHA256(secret, payload) ||
payload`` and is checked before it is unpickled: the store is open to anyone who can reach
its port, the secret is not (it travels over the process pipe or the SSH channel only).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import pickle
import threading
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch.distributed as dist

__all__ = ["Keys", "ForgedMessageError", "sign", "verify", "DriverChannel", "WorkerChannel", "connect"]

_logger = logging.getLogger(__name__)
_DIGEST = hashlib.sha256
_MAC_BYTES = 32
# Blocking queue pops wait this long before looping; a quiet run is not an error.
_LONG_WAIT = datetime.timedelta(days=7)
STOP = "__ddptrain_stop__"


class ForgedMessageError(Exception):
    """A message on the store did not carry a valid signature."""


class Keys:
    """Store keys of one attempt of one run. Nothing else formats key strings."""

    def __init__(self, run_id: str, attempt: int) -> None:
        self.prefix = f"ddptrain/{run_id}/{attempt}"

    @property
    def to_driver(self) -> str:
        return f"{self.prefix}/to_driver"

    def to_worker(self, rank: int) -> str:
        return f"{self.prefix}/to_worker/{rank}"


def _mac(secret: bytes, key: str, payload: bytes) -> bytes:
    # The MAC covers the queue's key too: a message is only valid on the queue it was sent to.
    return hmac.new(secret, key.encode() + b"\0" + payload, _DIGEST).digest()


def sign(secret: bytes, key: str, obj: Any, *, plain_pickle: bool = False) -> bytes:
    """Pickle ``obj`` for the queue ``key`` and put its MAC in front.

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
    return _mac(secret, key, payload) + payload


def verify(secret: bytes, key: str, data: bytes) -> Any:
    """Check the MAC of ``data`` read from queue ``key``, then unpickle it.

    Raises:
        ForgedMessageError: The MAC is wrong; nothing was unpickled.
    """
    mac, payload = data[:_MAC_BYTES], data[_MAC_BYTES:]
    if len(mac) != _MAC_BYTES or not hmac.compare_digest(mac, _mac(secret, key, payload)):
        raise ForgedMessageError(f"rejected a store message of {len(data)} bytes with a bad signature")
    return pickle.loads(payload)


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client connection to the driver's store."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class DriverChannel:
    """Driver end: one thread pops worker messages and hands verified ones to ``on_message``."""

    def __init__(self, store: dist.TCPStore, keys: Keys, secret: bytes) -> None:
        self._store = store
        self._keys = keys
        self._secret = secret
        self._thread: threading.Thread | None = None

    def start(self, on_message: Callable[[Any], None]) -> None:
        """Start consuming; ``on_message`` runs in the consumer thread."""
        reader = connect(self._store.host, self._store.port, timeout_s=30)
        reader.set_timeout(_LONG_WAIT)

        def consume() -> None:
            while True:
                try:
                    data = reader.queue_pop(self._keys.to_driver)
                except Exception as exc:  # the store is going away
                    _logger.debug("driver channel stopped: %s", exc)
                    return
                try:
                    message = verify(self._secret, self._keys.to_driver, data)
                except ForgedMessageError as exc:
                    _logger.warning("ddptrain: %s (someone else is writing to this run's store)", exc)
                    continue
                except Exception as exc:
                    _logger.warning("ddptrain: could not decode a worker message: %r", exc)
                    continue
                if message == STOP:
                    return
                on_message(message)

        self._thread = threading.Thread(target=consume, name="ddptrain-channel", daemon=True)
        self._thread.start()

    def send(self, rank: int, obj: Any) -> None:
        """Push a signed command to one worker."""
        key = self._keys.to_worker(rank)
        self._store.queue_push(key, sign(self._secret, key, obj))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the consumer thread (safe to call twice)."""
        if self._thread is None:
            return
        try:
            key = self._keys.to_driver
            self._store.queue_push(key, sign(self._secret, key, STOP))
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

    def send(self, obj: Any) -> None:
        """Push a signed message to the driver."""
        key = self.keys.to_driver
        self.store.queue_push(key, sign(self.secret, key, obj, plain_pickle=True))

    def recv(self) -> Any:
        """Block until the driver sends this rank a command."""
        while True:
            key = self.keys.to_worker(self.rank)
            data = self.store.queue_pop(key)
            try:
                return verify(self.secret, key, data)
            except ForgedMessageError as exc:
                _logger.warning("ddptrain rank %d: %s", self.rank, exc)
