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
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ddptrain import _env
from ddptrain.driver.progress import format_duration, format_metrics
from ddptrain.storage import layout as storage
from ddptrain.storage.lock import driver_is_alive
from ddptrain.storage.read import RunNotFound, RunView, find_run, list_views, open_run, read_run
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


def run_summary(run: Path | RunView) -> dict[str, Any]:
    """What ``runs`` and ``show`` print of one run (a run directory, or a view of any run),
    as plain data, of the types ddptrain writes whatever the run's files hold
    (:func:`ddptrain.storage.read.read_run`).

    A run whose files cannot be read (not JSON, of other types, a link, a FIFO...) is
    ``UNREADABLE``, and ``problem`` says why; what could be read is shown as usual. Reading it
    does not grow with its reports (see :func:`ddptrain.storage.metrics.read_metrics_summary`): for a
    long run of an older ddptrain, ``metric_stats`` (each metric's last, min, max) is ``None``.
    """
    record = read_run(run if isinstance(run, RunView) else RunView(run, str(run)))
    info, metrics = record.info, record.metrics
    return {
        "name": record.view.name,
        "path": record.view.shown,
        "status": "UNREADABLE" if record.problems else record.status,
        "problem": "; ".join(record.problems) or None,
        "attempts": info.get("attempt", 0) + 1,
        "started": record.started,
        "duration_s": record.duration_s,
        "reports": metrics.reports,
        "last_metrics": metrics.last["metrics"] if metrics.last else None,
        "metric_stats": metrics.stats,
        "best_checkpoint": record.best_checkpoint,
        "latest_checkpoint": record.latest_checkpoint,
        "checkpoints": record.checkpoints,
        "checkpoint_status": record.checkpoint_status,
        "score_attribute": record.score_attribute,
        "error": info.get("error"),
        "upload_error": info.get("upload_error"),  # training ended, its last uploads to remote storage failed
        "attempt_errors": info.get("attempt_errors", []),
        "validation_errors": info.get("validation_errors", []),
        "preempted": info.get("preempted"),
        "resizes": info.get(
            "resizes", []
        ),  # an elastic run's world size changes  # {"reason", "checkpoint"}: a rerun by name resumes it
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
    folder = os.path.expanduser(root.removeprefix("file://"))
    if storage_path is not None and not on_remote_storage(storage_path) and not os.path.isdir(folder):
        # --json: a folder not made yet holds no runs yet (scripts poll for a run's start)
        what = "not a folder" if os.path.exists(folder) else None if as_json else "no such folder"
        if what is not None:
            print(f"ddptrain runs: {root}: {what} (give the storage path the runs were saved under)", file=sys.stderr)
            return 1
    runs = list_runs(root)
    if as_json:
        _print_json(runs)
        return 0
    if not runs and os.path.isfile(os.path.join(folder, "run.json")):  # one run's own folder
        hint = f"see it with `ddptrain show {root}`"
        print(f"ddptrain runs: {root} is a run, not a folder of runs: {hint}", file=sys.stderr)
        return 1
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
    for entry in s["validation_errors"]:
        print(
            f"  validation of {entry['checkpoint']} failed: {entry['error']}"
            + (f" (log: {entry['log']})" if entry.get("log") else "")
        )
    if s["error"] and not s["attempt_errors"]:
        print(f"  error: {s['error']}")
    if s["upload_error"]:
        print(f"  upload failed: {s['upload_error']}")
    for entry in s["resizes"]:
        print(f"  world size {entry['from']} -> {entry['to']} at attempt {entry.get('attempt')}: {entry['why']}")
    if s["preempted"]:
        resume = s["preempted"]["checkpoint"] or "scratch (no checkpoint was reported)"
        print(f"  preempted: {s['preempted']['reason']}; run it again with the same name to resume from {resume}")
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
        status = s["checkpoint_status"].get(path)
        if status in ("PENDING_VALIDATION", "VALIDATED"):
            marks.append("validating" if status == "PENDING_VALIDATION" else "validated")
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


_ROW_COLUMNS = ("report", "time", "attempt")  # ddptrain's own, before the metrics


def report_row(index: int, line: dict[str, Any]) -> dict[str, Any]:
    """Report number ``index`` as a row: index, time, attempt, then every metric (nested ones as
    JSON). A metric named like one of the first three (``time``, say) is ``metrics/<name>``: it
    replaced ddptrain's column, so the report numbers and times were lost (and plots drawn
    against them wrong)."""
    row: dict[str, Any] = {"report": index, "time": line["time"], "attempt": line["attempt"]}
    for key, value in line["metrics"].items():
        column = f"metrics/{key}" if key in _ROW_COLUMNS else key
        row[column] = json.dumps(value) if isinstance(value, (dict, list)) else value
    return row


def export_rows(run: Path | RunView) -> list[dict[str, Any]]:
    """One row per report (:func:`report_row`) of a run directory or a view of any run, oldest first."""
    view = run if isinstance(run, RunView) else RunView(run, str(run))
    return [report_row(index, line) for index, line in enumerate(view.metric_lines(), start=1)]


def main_export(run: str, fmt: str, output: str | None) -> int:
    rows = export_rows(open_run(run))
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
        series[view.name] = export_rows(view)
    if not series:
        raise not_runs[0][1]
    known = {k for rows in series.values() for row in rows for k in row if k not in _ROW_COLUMNS}
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
            if k not in _ROW_COLUMNS and isinstance(v, (int, float))
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
