"""What the driver's console says about a run: where it is, how far it got, how it ended.

Three modes, from ``DDPTRAIN_PROGRESS`` or :func:`set_progress` (the call wins; inside
``with quiet():`` a thread's fits say nothing, as a sweep's trials do):

* ``"auto"`` (default): a status line redrawn in place when stderr is a terminal, else
  ``"lines"``;
* ``"lines"``: one line when the run starts, one per report (at most one every
  ``DDPTRAIN_PROGRESS_INTERVAL_S``, 10 s by default), restarts, and a summary at the end;
* ``"off"``: nothing from ddptrain itself (worker output still shows, ``[rankN]``-prefixed).

Everything goes to stderr. Worker lines and the status line share the terminal through
:meth:`Progress.console_write`, which takes the status line away, writes the worker's line
whole and draws the status line again, so neither is garbled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

from ddptrain.errors import ConfigError
from ddptrain.storage.checkpoint_manager import flat_metric_names

__all__ = ["Progress", "progress_mode", "quiet", "set_progress"]

MODES = ("auto", "lines", "off")
_chosen: str | None = None
_local = threading.local()  # .quiet: this thread's fits say nothing
_CLEAR = "\r\x1b[2K"
_REDRAW_S = 0.25  # at most four redraws a second


def set_progress(mode: str | None) -> None:
    """Choose how ``fit()`` reports progress in this process: ``"auto"``, ``"lines"`` or
    ``"off"`` (``None``: back to ``DDPTRAIN_PROGRESS``)."""
    global _chosen
    if mode is not None and mode not in MODES:
        raise ConfigError(f"progress mode must be one of {MODES}, got {mode!r}.")
    _chosen = mode


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Within the block, ``fit()`` calls made by this thread print no progress of their own
    (a sweep that shows its own table runs its trials this way)."""
    before = getattr(_local, "quiet", False)
    _local.quiet = True
    try:
        yield
    finally:
        _local.quiet = before


def progress_mode(stream: TextIO | None = None) -> str:
    """The effective mode: ``"live"`` (in place), ``"lines"`` or ``"off"``."""
    if getattr(_local, "quiet", False):
        return "off"
    mode = _chosen or os.environ.get("DDPTRAIN_PROGRESS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ConfigError(f"`DDPTRAIN_PROGRESS` must be one of {MODES}, got {mode!r}.")
    if mode == "auto":
        stream = stream or sys.stderr
        try:
            return "live" if stream.isatty() and os.environ.get("TERM") != "dumb" else "lines"
        except (AttributeError, ValueError):
            return "lines"
    return mode


def _interval_s() -> float:
    try:
        return max(0.0, float(os.environ.get("DDPTRAIN_PROGRESS_INTERVAL_S", "10")))
    except ValueError:
        return 10.0


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 24 else text[:21] + "..."


def format_metrics(metrics: dict[str, Any], limit: int = 4) -> str:
    """A few of a report's metrics, shortened: ``loss=0.1234 epoch=3``."""
    items = [(k, v) for k, v in metrics.items() if isinstance(v, (int, float, str, bool))][:limit]
    more = " ..." if len(metrics) > len(items) else ""
    return " ".join(f"{k}={_short(v)}" for k, v in items) + more


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """The console view of one ``fit()``.

    Args:
        name: The run's name.
        run_dir: Where its results go.
        stream: Where to write (stderr).
    """

    def __init__(self, name: str, run_dir: str, stream: TextIO | None = None) -> None:
        self.name = name
        self.run_dir = run_dir  # as users see it: a local path, a URI, or a path on a storage_filesystem
        self.stream = stream or sys.stderr
        self.mode = progress_mode(self.stream)
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._attempt = 0
        self._reports = 0
        self._metrics: dict[str, Any] = {}
        self._checkpoint: str | None = None
        self._status = ""  # the status line on screen (live mode)
        self._last_draw = 0.0
        self._last_line = -1e9
        self._unprinted = False  # a report not shown yet (lines mode)
        self.scored = False  # checkpoints are ranked by a score (else "best" is the latest)
        self._unscored_said = False

    # ----------------------------------------------------------------- events
    def started(self, *, workers: int, hosts: int, attempt: int, resume_from: str | None) -> None:
        self._attempt = attempt
        where = f"{workers} worker{'s' * (workers != 1)}" + (f" on {hosts} hosts" if hosts > 1 else "")
        resume = f", resuming from {resume_from}" if resume_from else ""
        self._say(
            f"ddptrain: run {self.name!r} started (attempt {attempt}, {where}{resume}); results in {self.run_dir}"
        )

    def recorded(self, metrics: dict[str, Any], report_index: int) -> None:
        """Rank 0's metrics of report ``report_index`` are recorded: counted (and drawn on the
        live status line), even when the other ranks never make that report (``if rank == 0:
        report(...)``, Ray's usual pattern). Lines mode prints at the next :meth:`reported`."""
        with self._lock:
            self._reports = report_index
            self._metrics = metrics
            self._unprinted = True

    def reported(self, metrics: dict[str, Any], report_index: int) -> None:
        """Every rank made report ``report_index`` (its checkpoint is committed)."""
        with self._lock:
            self._reports = report_index
            self._metrics = metrics
            self._unprinted = True
        if self.mode == "live":
            self.tick()
        elif self.mode == "lines" and time.monotonic() - self._last_line >= _interval_s():
            self._print_report()

    def committed(self, checkpoint_path: str) -> None:
        with self._lock:
            self._checkpoint = os.path.basename(checkpoint_path)

    def unscored(self, name: str, attribute: str, metrics: dict[str, Any]) -> None:
        """Checkpoint ``name`` has no ``checkpoint_score_attribute`` (said once per run: a typo
        in the name, or a metric reported without the checkpoint)."""
        if self._unscored_said:
            return
        self._unscored_said = True
        keys = ", ".join(sorted(flat_metric_names(metrics))) or "none"
        self._say(
            f"ddptrain: checkpoint_score_attribute {attribute!r} is not among the metrics of {name} (they are: "
            f"{keys}); checkpoints without it rank as the worst and retention keeps the newest of them. Report "
            f"{attribute!r} with each checkpoint (or from its validation), or correct the name (a nested metric "
            "is named 'outer/inner')."
        )

    def validated(self, name: str, metrics: dict[str, Any], seconds: float) -> None:
        """A checkpoint's validation ended: its metrics (merged into the checkpoint's)."""
        self._say(
            f"ddptrain: {name} validated in {seconds:.1f} s: {format_metrics(metrics, limit=6) or '(no metrics)'}"
        )

    def validation_failed(self, name: str, error: str, log: str, kept: bool) -> None:
        """A checkpoint's validation failed (or was killed): its traceback's last lines, and
        what became of the checkpoint's score."""
        lines = [line for line in error.strip().splitlines() if line.strip()]
        shown = "\n    ".join(lines[-6:])
        score = "it keeps the metrics it was reported with" if kept else "it is not validated"
        where = f" (output: {log})" if log else ""
        self._say(f"ddptrain: the validation of {name} failed{where}; {score}:\n    {shown}")

    def restarting(self, attempt: int, reason: str, resume_from: str | None, budget: str = "") -> None:
        """Attempt ``attempt - 1`` failed for ``reason``; ``attempt`` starts from ``resume_from``
        (``budget``: the failures allowed so far, e.g. "failure 1 of 3 allowed")."""
        self._attempt = attempt
        start = resume_from or "scratch"
        budget = f" ({budget})" if budget else ""
        self._say(f"ddptrain: attempt {attempt - 1} failed ({reason}); attempt {attempt} starts from {start}{budget}")

    def say(self, line: str, attempt: int | None = None) -> None:
        """A line of the driver's own on the console (a preemption notice, a resize; ``attempt``:
        the one that starts now)."""
        if attempt is not None:
            self._attempt = attempt
        self._say(line)

    def preempted(self, reason: str, checkpoint: str | None) -> None:
        """The run's last line when a preemption notice stopped it."""
        if self.mode == "lines" and self._unprinted:
            self._print_report()
        took = format_duration(time.monotonic() - self._started)
        resume = f"resumes from {checkpoint}" if checkpoint else "starts from scratch (no checkpoint was reported)"
        self._say(
            f"ddptrain: run {self.name!r} preempted after {took} ({reason}); run it again with the same "
            f"RunConfig(name={self.name!r}) and it {resume}; everything is in {self.run_dir}"
        )
        with self._lock:
            self._clear_status()

    def finished(
        self, ok: bool, best: tuple[str, dict[str, Any]] | None = None, error: str = "", where: str | None = None
    ) -> None:
        """The run's last line: how it ended, its best checkpoint, and where everything is (the
        run's folder, or ``where``)."""
        if self.mode == "lines" and self._unprinted:
            self._print_report()
        took = format_duration(time.monotonic() - self._started)
        counts = f"{self._reports} reports, attempt {self._attempt}"
        if ok:
            line = f"ddptrain: run {self.name!r} finished in {took} ({counts})"
        else:
            line = f"ddptrain: run {self.name!r} failed after {took} ({counts}): {error}"
        if best is not None:
            path, metrics = best
            which = "best" if self.scored else "latest"
            line += f"; {which} checkpoint {path} ({format_metrics(metrics)})"
        self._say(line + f"; everything is in {where or self.run_dir}")
        with self._lock:
            self._clear_status()

    # ----------------------------------------------------------------- drawing
    def status_text(self) -> str:
        parts = [f"attempt {self._attempt}", f"{self._reports} reports"]
        if self._metrics:
            parts.append(format_metrics(self._metrics))
        if self._checkpoint:
            parts.append(self._checkpoint)
        parts.append(format_duration(time.monotonic() - self._started))
        return f"[{self.name}] " + " | ".join(parts)

    def tick(self) -> None:
        """Redraw the live status line: soon after a report (a few times a second at most),
        else once a second for the clock. Called often, from the driver's event loop."""
        if self.mode != "live":
            return
        now = time.monotonic()
        if now - self._last_draw < (_REDRAW_S if self._unprinted else 1.0):
            return
        with self._lock:
            self._unprinted = False
            self._last_draw = now
            self._draw(self.status_text())

    def console_write(self, out: TextIO, text: str) -> None:
        """Write a worker's output line without garbling the status line."""
        with self._lock:
            if self.mode == "live" and self._status:
                self._write(self.stream, _CLEAR)
            self._write(out, text)
            if self.mode == "live" and self._status:
                self._write(self.stream, self._status)

    def _draw(self, status: str) -> None:
        width = shutil.get_terminal_size((100, 24)).columns
        self._status = status[: max(10, width - 1)]
        self._write(self.stream, _CLEAR + self._status)

    def _clear_status(self) -> None:
        if self._status:
            self._write(self.stream, _CLEAR)
            self._status = ""

    def _print_report(self) -> None:
        self._last_line = time.monotonic()
        self._unprinted = False
        self._say("ddptrain: " + self.status_text())

    def _say(self, line: str) -> None:
        if self.mode == "off":
            return
        with self._lock:
            if self._status:
                self._write(self.stream, _CLEAR)
            self._write(self.stream, line + "\n")
            if self._status:
                self._write(self.stream, self._status)

    @staticmethod
    def _write(out: TextIO, text: str) -> None:
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            pass  # a closed console never fails a run
