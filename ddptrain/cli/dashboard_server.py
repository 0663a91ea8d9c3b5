"""The dashboard's HTTP server: a fixed pool of threads serves requests that have fully arrived.

Every connection waits in one selector, not in a thread, until its request line and headers
are all there (the dashboard answers GET only: a request is its head). The pool's threads then
read the request from memory, so a client that is slow to send, or sends a byte at a time,
holds no thread while it does. A connection is closed when:

* it sends nothing for ``idle_timeout_s`` after it opens;
* its request line and headers have not all arrived ``request_timeout_s`` after its first byte
  (answered ``408 Request Timeout`` first), or they are over ``MAX_HEAD_BYTES`` (``431``);
* ``max_connections`` are open and it is the oldest of those still waiting for their requests
  (a new connection takes its place; when all of them are being served, the new one is closed).

Answers are written by the pool's threads, each write bounded by ``idle_timeout_s`` (the
handler's ``timeout``).
"""

from __future__ import annotations

import io
import logging
import re
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, cast

__all__ = ["MAX_HEAD_BYTES", "PooledHTTPServer", "ReadRequestHandler"]

_logger = logging.getLogger(__name__)

# The most a request line and its headers may take (http.server's own limit for one line).
MAX_HEAD_BYTES = 64 * 1024
_END_OF_HEAD = re.compile(rb"\n\r?\n")  # the empty line after the headers (CRLF, or LF as http.server allows)


def _plain(status: str, message: str) -> bytes:
    body = (message + "\n").encode()
    head = f"HTTP/1.0 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
    return (head + "Connection: close\r\n\r\n").encode() + body


class _Waiting:
    """A connection in the selector: where it comes from, the bytes of its request so far, and
    when it is closed unless its request is complete."""

    __slots__ = ("address", "deadline", "head")

    def __init__(self, address: Any, deadline: float) -> None:
        self.address, self.deadline, self.head = address, deadline, bytearray()


class PooledHTTPServer(HTTPServer):
    """An ``HTTPServer`` with a fixed pool of threads (see the module's docstring); its handler
    must be a :class:`ReadRequestHandler`."""

    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[ReadRequestHandler],
        *,
        workers: int,
        idle_timeout_s: float,
        request_timeout_s: float,
        max_connections: int,
    ) -> None:
        for name, value in (("idle_timeout_s", idle_timeout_s), ("request_timeout_s", request_timeout_s)):
            if not value > 0:
                raise ValueError(f"`{name}` must be > 0 (seconds), got {value!r}.")
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)
        self.workers, self.max_connections = workers, max_connections
        self.idle_timeout_s, self.request_timeout_s = idle_timeout_s, request_timeout_s
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._lock = threading.Lock()
        self._serving: dict[socket.socket, bytes] = {}  # handed to the pool: its request's head
        late = f"the request line and headers did not arrive within {request_timeout_s:g} s of their first byte"
        self._late = _plain("408 Request Timeout", late)

    def serve_forever(self, poll_interval: float = 0.25) -> None:
        self._stop.clear()
        self._stopped.clear()
        waiting: dict[socket.socket, _Waiting] = {}  # oldest first
        selector = selectors.DefaultSelector()
        selector.register(self.socket, selectors.EVENT_READ)
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ddptrain-dashboard")
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(poll_interval):
                    if key.fileobj is self.socket:
                        self._accept(selector, waiting)
                    else:
                        self._receive(selector, waiting, cast(socket.socket, key.fileobj), pool)
                now = time.monotonic()
                for conn in [c for c, w in waiting.items() if w.deadline <= now]:
                    late = f"the request line and headers did not arrive within {self.request_timeout_s:g} s"
                    self._close(
                        selector, waiting, conn, _plain("408 Request Timeout", late) if waiting[conn].head else b""
                    )
        finally:
            for conn in list(waiting):
                self._close(selector, waiting, conn)
            selector.close()
            with self._lock:
                for conn in self._serving:  # wakes the threads serving them
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            pool.shutdown(wait=True)
            self._stopped.set()

    def _accept(self, selector: selectors.BaseSelector, waiting: dict[socket.socket, _Waiting]) -> None:
        try:
            conn, address = self.socket.accept()
        except OSError:
            return
        with self._lock:
            full = len(waiting) + len(self._serving) >= self.max_connections
        if full and not waiting:  # every one is being served
            conn.close()
            return
        if full:
            self._close(selector, waiting, next(iter(waiting)))
        conn.setblocking(False)
        selector.register(conn, selectors.EVENT_READ)
        waiting[conn] = _Waiting(address, time.monotonic() + self.idle_timeout_s)

    def _receive(
        self,
        selector: selectors.BaseSelector,
        waiting: dict[socket.socket, _Waiting],
        conn: socket.socket,
        pool: ThreadPoolExecutor,
    ) -> None:
        """Read what ``conn`` sent; hand it to the pool once its request's head is complete."""
        entry = waiting[conn]
        try:
            data = conn.recv(MAX_HEAD_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client closed it (or it failed)
            self._close(selector, waiting, conn)
            return
        if not entry.head:  # from its first byte, the whole request has its own deadline
            entry.deadline = time.monotonic() + self.request_timeout_s
        start = max(0, len(entry.head) - 2)
        entry.head += data
        if _END_OF_HEAD.search(entry.head, start) is None:
            if len(entry.head) > MAX_HEAD_BYTES:
                large = f"the request line and headers are over {MAX_HEAD_BYTES} bytes"
                self._close(selector, waiting, conn, _plain("431 Request Header Fields Too Large", large))
            return
        del waiting[conn]
        selector.unregister(conn)
        conn.setblocking(True)
        with self._lock:
            self._serving[conn] = bytes(entry.head)
        pool.submit(self._serve, conn, entry.address)

    @staticmethod
    def _close(
        selector: selectors.BaseSelector,
        waiting: dict[socket.socket, _Waiting],
        conn: socket.socket,
        answer: bytes = b"",
    ) -> None:
        """Close a waiting connection, after a short ``answer`` if given (sent only if it fits
        in the socket's buffer at once: never a wait)."""
        del waiting[conn]
        selector.unregister(conn)
        try:
            if answer:
                for _ in range(4):  # what is left unread would turn the close into a reset
                    if not conn.recv(MAX_HEAD_BYTES):
                        break
        except OSError:  # nothing more to read (or the client is gone)
            pass
        try:
            if answer:
                conn.send(answer)
                conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket, address: Any) -> None:
        try:
            self.finish_request(conn, address)
        except Exception:
            _logger.debug("ddptrain dashboard: a connection from %s failed", address, exc_info=True)
        finally:
            self.shutdown_request(conn)
            with self._lock:
                self._serving.pop(conn, None)

    def request_head(self, conn: socket.socket) -> bytes:
        """The request line and headers ``conn`` sent (read by the selector)."""
        with self._lock:
            return self._serving.get(conn, b"")

    def shutdown(self) -> None:
        self._stop.set()
        self._stopped.wait()


class ReadRequestHandler(BaseHTTPRequestHandler):
    """A request handler that reads its request from what the :class:`PooledHTTPServer`
    received, never from the socket (it writes its answer there)."""

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.rfile = io.BytesIO(cast(PooledHTTPServer, self.server).request_head(self.connection))
