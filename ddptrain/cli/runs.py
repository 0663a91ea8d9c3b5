"""Looking at runs from the shell: ``ddptrain runs``, ``show``, ``logs``, ``export``, ``plot``.

Everything here only reads a run directory's files (``run.json``, ``metrics.jsonl``,
``checkpoints.json``, ``logs/``), of a local run or of a run on remote storage (see
:mod:`ddptrain.storage.read`); a run is RUNNING while a live driver holds its lock, and ABORTED
when ``run.json`` says RUNNING but no driver holds it any more (the driver was killed). For a
run on remote storage that is known only on its driver's host; elsewhere its ``run.json`` says.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddptrain import _env
from ddptrain.driver.progress import format_duration, format_metrics
from ddptrain.storage import layout as storage
from ddptrain.storage import metrics as run_metrics
from ddptrain.storage import run_files
from ddptrain.storage.layout import RunLayout
from ddptrain.storage.lock import driver_is_alive
from ddptrain.storage.read import RunNotFound, RunView, find_run, list_views, open_run
from ddptrain.storage.remote import on_remote_storage

__all__ = [
    "RunNotFound",
    "find_run",
    "list_runs",
    "run_summary",
    "export_rows",
    "report_row",
    "main_runs",
    "main_show",
    "main_logs",
    "main_export",
    "main_plot",
]


_STATUSES = ("RUNNING", "RESTARTING", "FINISHED", "ERRORED", "ABORTED")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _are_texts(value: Any) -> bool:
    return isinstance(value, list) and all(map(_is_text, value))


def _is_failure(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and _is_count(value.get("attempt"))
        and _is_text(value.get("error"))
        and (value.get("log") is None or _is_text(value["log"]))
    )


# The fields of run.json that are read, and whether a value is what ddptrain writes there.
_FIELDS: dict[str, Callable[[Any], bool]] = {
    "status": lambda value: value in _STATUSES,
    "started": _is_number,
    "ended": _is_number,
    "attempt": _is_count,
    "error": _is_text,
    "upload_error": _is_text,
    "attempt_errors": lambda value: isinstance(value, list) and all(map(_is_failure, value)),
    "num_workers": _is_count,
    "use_gpu": lambda value: isinstance(value, bool),
    "hosts": _are_texts,
    "argv": _are_texts,
    "backend_config": _is_text,
    "host": _is_text,
}


def _run_info(view: RunView) -> tuple[dict[str, Any], list[str]]:
    """The fields of the run's ``run.json`` that are sound, and what is wrong with it."""
    shown = view.shown_path(view.layout.run_json)
    try:
        info = run_files.read_json(view.folder, RunLayout.RUN_JSON)
    except run_files.RunFileError as exc:
        return {}, [str(exc).replace(str(view.layout.run_json), shown)]
    if not isinstance(info, dict):
        what = "is missing" if info is None else f"holds a JSON {type(info).__name__}, not an object"
        return {}, [f"{shown} {what}"]
    bad = [key for key, sound in _FIELDS.items() if info.get(key) is not None and not sound(info[key])]
    checked = {key: info[key] for key in _FIELDS if info.get(key) is not None and key not in bad}
    problems = [f"{shown}: " + ", ".join(f"`{key}` is {str(info[key])[:60]!r}" for key in bad)] if bad else []
    return checked, problems


def run_summary(run: Path | RunView) -> dict[str, Any]:
    """What ``runs`` and ``show`` print of one run (a run directory, or a view of any run),
    as plain data, of the types ddptrain writes whatever the run's files hold.

    A run whose files cannot be read (not JSON, of other types, a link, a FIFO...) is
    ``UNREADABLE``, and ``problem`` says why; what could be read is shown as usual. Reading it
    does not grow with its reports (see :func:`ddptrain.run_metrics.read_metrics_summary`): for a
    long run of an older ddptrain, ``metric_stats`` (each metric's last, min, max) is ``None``.
    """
    view = run if isinstance(run, RunView) else RunView(run, str(run))
    info, problems = _run_info(view)
    status = info.get("status", "FINISHED" if info.get("ended") else "RUNNING")
    if status in ("RUNNING", "RESTARTING") and view.driver_alive(info) is False:
        status = "ABORTED"  # its driver died without a word
    try:
        metrics = run_metrics.read_metrics_summary(view.folder)
    except run_files.RunFileError as exc:
        metrics = run_metrics.MetricsSummary(stats=None)
        problems.append(str(exc))
    if metrics.foreign:
        problems.append(f"{view.shown_path(view.layout.metrics)}: {metrics.foreign} line(s) are not reports (skipped)")
    checkpoints: list[tuple[str, dict[str, Any]]] = []
    best, latest, score = None, None, None
    try:
        manager = view.checkpoints()
        checkpoints = [(c.path, m) for c, m in manager.reported_checkpoints()]
        ranked = manager.best_checkpoints()
        best = ranked[-1][0].path if ranked else None
        latest = manager.latest.path if manager.latest else None
        score = manager.config.checkpoint_score_attribute
    except Exception as exc:  # an unreadable index: say so, show the rest
        problems.append(str(exc))
    started = info.get("started")
    ended = info.get("ended") or (time.time() if status in ("RUNNING", "RESTARTING") else None)
    if ended is None and metrics.last:
        ended = metrics.last["time"]
    return {
        "name": view.name,
        "path": view.shown,
        "status": "UNREADABLE" if problems else status,
        "problem": "; ".join(problems) or None,
        "attempts": info.get("attempt", 0) + 1,
        "started": started,
        "duration_s": (ended - started) if started and ended else None,
        "reports": metrics.reports,
        "last_metrics": metrics.last["metrics"] if metrics.last else None,
        "metric_stats": metrics.stats,
        "best_checkpoint": best,
        "latest_checkpoint": latest,
        "checkpoints": checkpoints,
        "score_attribute": score,
        "error": info.get("error"),
        "upload_error": info.get("upload_error"),  # training ended, its last uploads to remote storage failed
        "attempt_errors": info.get("attempt_errors", []),
        "num_workers": info.get("num_workers"),
        "use_gpu": info.get("use_gpu"),
        "hosts": info.get("hosts"),
        "argv": info.get("argv"),
        "backend_config": info.get("backend_config"),
    }


def list_runs(storage_path: str) -> list[dict[str, Any]]:
    """Every run under ``storage_path`` (a folder or a URI), oldest first (a link to a folder
    elsewhere is not one)."""
    runs = [run_summary(view) for view in list_views(storage_path)]
    return sorted(runs, key=lambda r: r["started"] or 0)


def _when(timestamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp)) if timestamp else "-"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=1, default=str))


# ----------------------------------------------------------------- commands
def main_runs(storage_path: str | None, as_json: bool) -> int:
    root = storage_path or _env.default_storage_path()
    runs = list_runs(root)
    if as_json:
        _print_json(runs)
        return 0
    if not runs:
        print(f"no runs in {root}")
        return 0
    rows = [
        [
            r["name"],
            r["status"],
            str(r["attempts"]),
            _when(r["started"]),
            format_duration(r["duration_s"]) if r["duration_s"] is not None else "-",
            format_metrics(r["last_metrics"] or {}, limit=3) or "-",
            os.path.basename(r["best_checkpoint"]) if r["best_checkpoint"] else "-",
        ]
        for r in runs
    ]
    print(_table(["NAME", "STATUS", "ATTEMPTS", "STARTED", "DURATION", "LAST METRICS", "BEST CHECKPOINT"], rows))
    unreadable = [r for r in runs if r["problem"]]
    if unreadable:
        print("\nunreadable runs (shown with what could be read):")
        for r in unreadable:
            print(f"  {r['name']}: {r['problem']}")
    shown = root if on_remote_storage(root) else os.path.abspath(os.path.expanduser(root))
    print(f"\n{len(runs)} run(s) in {shown}")
    return 0


def main_show(run: str, as_json: bool) -> int:
    view = open_run(run)
    summary = run_summary(view)
    if as_json:
        _print_json(summary)
        return 0
    s = summary
    print(f"run {s['name']!r}: {s['status']}  ({s['path']})")
    if s["problem"]:
        print(f"  unreadable: {s['problem']}")
    print(
        f"  started {_when(s['started'])}, duration {format_duration(s['duration_s'] or 0)}, {s['attempts']} attempt(s)"
    )
    print(f"  workers: {s['num_workers']}{' (GPU)' if s['use_gpu'] else ''} on {', '.join(s['hosts'] or ['?'])}")
    print(f"  command: {' '.join(s['argv'] or [])}")
    print(f"  backend: {s['backend_config']}")
    for entry in s["attempt_errors"]:
        print(
            f"  attempt {entry['attempt']} failed: {entry['error']}"
            + (f" (log: {entry['log']})" if entry.get("log") else "")
        )
    if s["error"] and not s["attempt_errors"]:
        print(f"  error: {s['error']}")
    if s["upload_error"]:
        print(f"  upload failed: {s['upload_error']}")
    print(f"  reports: {s['reports']}")
    for key, (last, low, high) in (s["metric_stats"] or {}).items():
        print(f"    {key}: last {last:.6g}, min {low:.6g}, max {high:.6g}")
    if s["metric_stats"] is None and s["last_metrics"]:
        print(f"    last: {format_metrics(s['last_metrics'])} (min and max: not recorded by the ddptrain that wrote")
        print(f"    this run; `ddptrain export {shlex.quote(run)}` has every report)")
    score = s["score_attribute"]
    print(f"  checkpoints ({len(s['checkpoints'])} kept" + (f", scored by {score!r}" if score else "") + "):")
    for path, metrics in s["checkpoints"]:
        marks = [m for m, p in (("latest", s["latest_checkpoint"]), ("best", s["best_checkpoint"])) if p == path]
        print(f"    {os.path.basename(path)}  {format_metrics(metrics)}" + (f"  [{', '.join(marks)}]" if marks else ""))
    return 0


def main_logs(run: str, rank: int, attempt: int | None, follow: bool) -> int:
    view = open_run(run)
    if follow and view.remote is not None:
        print(
            f"ddptrain logs: --follow reads a local run's logs as they grow; {view.shown} is on remote storage, "
            "where logs are uploaded after each attempt (run it without --follow)",
            file=sys.stderr,
        )
        return 2
    attempts = view.attempts()
    if not attempts:
        print(f"ddptrain logs: {view.shown} has no logs", file=sys.stderr)
        return 1
    chosen = attempts[-1] if attempt is None else attempt
    f = view.open_log(chosen, rank)
    if f is None:
        print(
            f"ddptrain logs: no log {view.shown_path(view.layout.rank_log(chosen, rank))} (attempts: {attempts})",
            file=sys.stderr,
        )
        return 1
    out = sys.stdout.buffer
    with f:
        shutil.copyfileobj(f, out)
        out.flush()
        while follow:
            chunk = f.read()
            if chunk:
                out.write(chunk)
                out.flush()
            elif not driver_is_alive(view.folder):
                break
            else:
                time.sleep(0.5)
    return 0


def report_row(index: int, line: dict[str, Any]) -> dict[str, Any]:
    """Report number ``index`` as a row: index, time, attempt, then every metric (nested ones as JSON)."""
    row: dict[str, Any] = {"report": index, "time": line["time"], "attempt": line["attempt"]}
    for key, value in line["metrics"].items():
        row[key] = json.dumps(value) if isinstance(value, (dict, list)) else value
    return row


def export_rows(run_dir: Path) -> list[dict[str, Any]]:
    """One row per report (:func:`report_row`), oldest first."""
    return [report_row(index, line) for index, line in enumerate(run_metrics.iter_metric_lines(run_dir), start=1)]


def main_export(run: str, fmt: str, output: str | None) -> int:
    rows = export_rows(open_run(run).folder)
    if fmt == "json":
        text = json.dumps(rows, indent=1)
    else:
        columns = list(dict.fromkeys(k for row in rows for k in row))
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        text = buffer.getvalue()
    if output:
        storage.write_atomic(output, text.encode())
        print(f"wrote {len(rows)} report(s) to {output}", file=sys.stderr)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def main_plot(runs: list[str], metrics: list[str], output: str, x_axis: str) -> int:
    """Plot ``metrics`` (default: every numeric one) of ``runs``. A word of ``runs`` that is not
    a run but a metric of the runs found is a metric (``ddptrain plot RUN loss acc``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('ddptrain plot needs matplotlib: pip install "ddptrain[plot]" (or matplotlib)', file=sys.stderr)
        return 2
    series: dict[str, list[dict[str, Any]]] = {}
    not_runs: list[tuple[str, RunNotFound]] = []
    for run in runs:
        try:
            view = open_run(run)
        except RunNotFound as missing:  # maybe a metric: `ddptrain plot RUN METRIC ...`
            not_runs.append((run, missing))
            continue
        series[view.name] = export_rows(view.folder)
    if not series:
        raise not_runs[0][1]
    known = {k for rows in series.values() for row in rows for k in row if k not in ("report", "time", "attempt")}
    for word, why in not_runs:
        if word not in known:
            raise RunNotFound(
                f"{why}; nor is {word!r} a metric of the runs given (they have: {', '.join(sorted(known))})"
            )
    metrics = list(dict.fromkeys([*(word for word, _ in not_runs), *metrics]))
    names = metrics or sorted(
        {
            k
            for rows in series.values()
            for row in rows
            for k, v in row.items()
            if k not in ("report", "time", "attempt") and isinstance(v, (int, float))
        }
    )
    if not names:
        print("ddptrain plot: no numeric metrics to plot", file=sys.stderr)
        return 1
    figure, axes = plt.subplots(len(names), 1, figsize=(7, 2.6 * len(names)), squeeze=False)
    for axis, name in zip(axes[:, 0], names, strict=True):
        for label, rows in series.items():
            points = [
                (row["report"] if x_axis == "report" else row["time"] - rows[0]["time"], row[name])
                for row in rows
                if isinstance(row.get(name), (int, float))
            ]
            if points:
                axis.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    label=label,
                    marker="." if len(points) < 50 else None,
                )
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("report" if x_axis == "report" else "seconds since the first report")
    if len(series) > 1:
        axes[0, 0].legend()
    figure.tight_layout()
    figure.savefig(output)
    print(f"wrote {output} ({', '.join(names)})", file=sys.stderr)
    return 0
