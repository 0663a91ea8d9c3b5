"""``CheckpointUploads``: a worker's checkpoint uploads in the background
(``report(..., checkpoint_upload_mode=CheckpointUploadMode.ASYNC)``).

One thread per worker runs the uploads one at a time, in report order, so the driver can
commit them in that order (each upload is made by the worker's upload process, see
``upload_process``, while this thread waits for it). At most ``max_pending`` uploads are queued or running: a report
that would exceed it waits for the oldest one (back-pressure), and says so in the worker's
log after a few seconds. The first upload that fails stops the ones queued after it (a later
checkpoint must not be committed before an earlier one); its error is raised by the next
:meth:`CheckpointUploads.submit` or :meth:`CheckpointUploads.wait`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["CheckpointUploads"]

_logger = logging.getLogger(__name__)
WARN_AFTER_S = 5.0  # a report held back by back-pressure, or the end waiting, is logged after this


class CheckpointUploads:
    """A worker's background uploads, in order, at most ``max_pending`` at a time.

    Args:
        max_pending: Uploads queued or running before a new one waits (>= 1).
        warn_after_s: Seconds a wait lasts before it is logged (then every 30 s).
    """

    def __init__(self, max_pending: int, warn_after_s: float = WARN_AFTER_S) -> None:
        if max_pending < 1:
            raise ValueError(f"`max_pending` must be >= 1, got {max_pending}.")
        self.max_pending = max_pending
        self.warn_after_s = warn_after_s
        self._jobs: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self._running: int | None = None  # the report index being uploaded
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> list[int]:
        """The report indices queued or being uploaded, oldest first."""
        with self._cond:
            return self._pending()

    def _pending(self) -> list[int]:
        return ([self._running] if self._running is not None else []) + [index for index, _ in self._jobs]

    def check(self) -> None:
        """Raise the error of an upload that failed, if one did."""
        with self._cond:
            if self._error is not None:
                raise self._error

    def submit(self, index: int, announce: Callable[[], None], upload: Callable[[], None]) -> None:
        """Upload report ``index``'s checkpoint in the background: wait for a free slot, call
        ``announce()`` (the report goes to the driver before its upload ends), queue ``upload``.

        Raises:
            BaseException: An earlier upload failed (its error).
        """
        self._wait(lambda: len(self._pending()) < self.max_pending, f"report #{index} waits for")
        announce()
        with self._cond:
            self._jobs.append((index, upload))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="ddptrain-uploads", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self) -> None:
        """Wait until every upload has ended (the training function returned).

        Each upload is bounded by its store's own timeouts; this wait is logged every 30 s,
        naming the uploads it waits for.

        Raises:
            BaseException: An upload failed (its error).
        """
        self._wait(lambda: not self._pending(), "the training function returned; its end waits for")

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        started = time.monotonic()
        warn_at = started + self.warn_after_s
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                if ready():
                    return
                now = time.monotonic()
                if now >= warn_at:
                    warn_at = now + 30.0
                    _logger.warning(
                        "ddptrain: %s the checkpoint upload(s) of report(s) %s (%.0f s so far; at most %d "
                        "upload(s) in flight per worker, DDPTRAIN_MAX_PENDING_UPLOADS)",
                        what,
                        self._pending(),
                        now - started,
                        self.max_pending,
                    )
                self._cond.wait(timeout=max(0.01, warn_at - now))

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                index, upload = self._jobs.popleft()
                self._running = index
            error: BaseException | None = None
            try:
                upload()
            except BaseException as exc:
                error = exc
            with self._cond:
                self._running = None
                if error is not None:  # the upload logged it (the worker's, in its rank's log)
                    self._error = error
                    self._jobs.clear()  # a later checkpoint is never committed before an earlier one
                self._cond.notify_all()
