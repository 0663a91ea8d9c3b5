"""The sweep's console output: a status table of trials and a summary at the end.

On a terminal the table is redrawn in place (at most once a second); otherwise each change of
a trial's state is one line, so logs and CI output stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from ddptrain.tune.trial import Trial

__all__ = ["StatusReporter"]

_REFRESH_S = 1.0


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 24 else text[:21] + "..."


class StatusReporter:
    """Prints the trials' states.

    Args:
        metric: The metric shown in the table (default: the first numeric one reported).
        mode: ``"min"`` or ``"max"``, for the best trial in the summary.
        verbose: 0 prints nothing, 1 the summary and state changes, 2 also worker output
            (worker output is not filtered here; it is ddptrain's console echo).
        stream: Where to print (default: stdout).
    """

    def __init__(self, metric: str | None, mode: str | None, verbose: int = 1, stream: TextIO | None = None) -> None:
        self.metric = metric
        self.mode = mode
        self.verbose = verbose
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn_lines = 0
        self._last_draw = 0.0

    def trial_changed(self, trial: Trial) -> None:
        """A trial started or ended (lines mode prints it)."""
        if self.verbose < 1 or self.tty:
            return
        self._line(f"Trial {trial.trial_name} {trial.display_status}: {self._describe(trial)}")

    def update(self, trials: list[Trial], force: bool = False) -> None:
        """Redraw the table on a terminal (at most once a second unless ``force``)."""
        if self.verbose < 1 or not self.tty:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < _REFRESH_S:
            return
        self._last_draw = now
        lines = self.table(trials)
        if self._drawn_lines:
            self.stream.write(f"\x1b[{self._drawn_lines}F\x1b[J")  # up to the table's start, clear below
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()
        self._drawn_lines = len(lines)

    def _describe(self, trial: Trial) -> str:
        parts = [f"iter={trial.iteration}"]
        metric = self._metric_of(trial)
        if metric is not None and metric in trial.last_result:
            parts.append(f"{metric}={_short(trial.last_result[metric])}")
        parts.append(f"config={_flatten(trial.config)}")
        if trial.status == "ERROR" and trial.error_msg:
            parts.append(f"error={trial.error_msg.splitlines()[0] if trial.error_msg else ''}")
        if trial.stop_reason and trial.status == "TERMINATED":
            parts.append(f"({trial.stop_reason})")
        return " ".join(parts)

    def _metric_of(self, trial: Trial) -> str | None:
        if self.metric:
            return self.metric
        for key, value in trial.last_result.items():
            if key not in ("training_iteration", "timestamp", "time_this_iter_s", "time_total_s") and isinstance(
                value, (int, float)
            ):
                return key
        return None

    def table(self, trials: list[Trial]) -> list[str]:
        """The status table: one row per trial (name, state, varying params, iterations, metric)."""
        configs = [_flatten(t.config) for t in trials]
        keys = sorted({k for c in configs for k in c})
        varying = [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1] or keys[:4]
        metric = self.metric or next((m for t in trials if (m := self._metric_of(t))), None)
        header = ["Trial name", "status", *varying, "iter", metric or "metric"]
        rows = [header]
        for trial, config in zip(trials, configs, strict=True):
            last = trial.last_result.get(metric) if metric else None
            rows.append(
                [
                    trial.trial_name,
                    trial.display_status,
                    *(_short(config.get(k, "")) for k in varying),
                    str(trial.iteration),
                    "" if last is None else _short(last),
                ]
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        counts: dict[str, int] = {}
        for trial in trials:
            counts[trial.display_status] = counts.get(trial.display_status, 0) + 1
        title = "Trials: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        return [title] + ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]

    def summary(self, trials: list[Trial], elapsed_s: float, best: Trial | None, path: str) -> None:
        """The end of the sweep: counts, time, the best trial and where it is on disk."""
        if self.verbose < 1:
            return
        if not self.tty:
            for line in self.table(trials):
                self._line(line)
        counts: dict[str, int] = {}
        for trial in trials:
            counts[trial.display_status] = counts.get(trial.display_status, 0) + 1
        states = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        self._line(f"Sweep finished in {elapsed_s:.1f} s: {len(trials)} trials ({states}). Results: {path}")
        if best is not None and self.metric:
            value = best.last_result.get(self.metric)
            self._line(
                f"Best trial {best.trial_name} ({self.metric}={_short(value)}): config={best.config}, path={best.path}"
            )
        for trial in trials:
            if trial.status == "ERROR":
                self._line(f"Trial {trial.trial_name} failed: {(trial.error_msg or '').splitlines()[0]}")

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
