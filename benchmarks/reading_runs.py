"""Reading long runs: ``ddptrain runs`` over 100 runs of 1.5 M reports each, ``show`` of one,
and the dashboard's requests, against the same runs written by an older ddptrain (no metrics
summary) and, with ``--baseline SRC``, against another ddptrain source tree (e.g. main's).

Each run's ``metrics.jsonl`` has 1.5 M reports of four metrics (about 190 MB; written once in
the driver's format and hard-linked into every run folder: readers see 100 files). Each run's
``metrics_summary.json`` is what the driver keeps (:class:`ddptrain.storage.metrics.MetricsSummary`,
built here by one full read, as a driver resuming the run would).

Measured, each a median over ``--repeats``:

* ``runs_100_s``: ``ddptrain runs STORAGE`` over the 100 runs, as a command (Python's start
  and imports included); the target is under 1 s;
* ``show_s``: ``ddptrain show RUN`` of one of them;
* ``dashboard_runs_s`` / ``dashboard_run_s`` / ``dashboard_poll_s``: the dashboard's
  ``/api/runs`` (what the page polls every 2 s), a run's page (its latest 10 000 reports) and
  a poll for new reports; ``dashboard_peak_rss_mib``: the server's peak memory;
* the same ``runs`` and ``show`` on 10 of the runs without their summaries (``old_*``: runs of
  an older ddptrain are counted and read from their tail);
* ``--baseline SRC``: ``ddptrain runs`` and ``show`` on one run, with ``PYTHONPATH=SRC``.

    python benchmarks/reading_runs.py [--repeats N] [--quick] [--baseline SRC]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _bench

from ddptrain.storage import metrics as run_metrics
from ddptrain.storage.layout import RunLayout

BENCH = "reading_runs"
ROOT = str(Path(__file__).resolve().parent.parent)


def write_history(path: Path, reports: int) -> None:
    """``reports`` lines as the driver writes them (``Run.record_metrics``)."""
    start = time.time() - reports * 0.01
    with open(path, "w") as f:
        for i in range(reports):
            metrics = {"loss": 1.0 / (i + 1), "step": i, "lr": 0.001, "epoch": i // 1000}
            f.write(json.dumps({"time": start + i * 0.01, "attempt": 0, "metrics": metrics}) + "\n")


def make_runs(storage: Path, history: Path, count: int, summaries: bool) -> None:
    summary = run_metrics.read_metrics_summary(history.parent, full=True) if summaries else None
    for n in range(count):
        run = storage / f"run_{n:03d}"
        run.mkdir(parents=True)
        info = {"name": run.name, "status": "FINISHED", "started": time.time() - 3600, "ended": time.time()}
        (run / RunLayout.RUN_JSON).write_text(json.dumps(info))
        os.link(history, run / RunLayout.METRICS)
        if summary is not None:
            summary.write(run)


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    # Run from "/": a ddptrain/ folder in the working directory would come first on sys.path.
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd="/")
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed: {done.stderr[-2000:]}")
    return elapsed


def cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from ddptrain.cli.main import main; sys.exit(main())", *args]


def dashboard(storage: Path, env: dict[str, str], repeats: int) -> dict[str, Any]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddptrain", "dashboard", str(storage), "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        url = re.search(r"(http://\S+)", proc.stdout.readline()).group(1)  # type: ignore[union-attr]
        port, token = int(url.split(":")[2].split("/")[0]), url.split("token=")[1]

        def get(path: str) -> tuple[float, Any]:
            started = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("GET", path, headers={"Authorization": f"Token {token}"})
            response = conn.getresponse()
            body = json.loads(response.read())
            conn.close()
            assert response.status == 200, body
            return time.perf_counter() - started, body

        times: dict[str, list[float]] = {"dashboard_runs_s": [], "dashboard_run_s": [], "dashboard_poll_s": []}
        for _ in range(repeats):
            elapsed, runs = get("/api/runs")
            times["dashboard_runs_s"].append(elapsed)
            elapsed, run = get(f"/api/runs/{runs[0]['name']}")
            times["dashboard_run_s"].append(elapsed)
            elapsed, _ = get(f"/api/runs/{run['name']}/metrics?offset={run['next']}&after={run['reports']}")
            times["dashboard_poll_s"].append(elapsed)
        peak = int(re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{proc.pid}/status").read_text()).group(1))  # type: ignore[union-attr]
        return {**times, "dashboard_peak_rss_mib": peak / 1024, "reports": run["reports"], "rows": len(run["rows"])}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        proc.stdout.close()  # type: ignore[union-attr]


def main() -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--baseline", metavar="SRC", help="a ddptrain source tree to compare with (PYTHONPATH)")
    known, sys.argv[1:] = parser.parse_known_args()
    baseline = known.baseline
    args = _bench.parse_args(
        __doc__.splitlines()[0], default_repeats=5, quick_repeats=2, extra=[("--keep", "keep the runs' folder")]
    )
    reports, count = (50_000, 10) if args.quick else (1_500_000, 100)
    folder = Path(tempfile.mkdtemp(prefix="ddptrain_bench_reading_"))
    env = {**os.environ, "PYTHONPATH": ROOT}
    results: dict[str, Any] = {}

    def record(metric: str, measure: Any) -> None:
        """Measure ``metric`` ``--repeats`` times (``measure()``: seconds); print it at once."""
        load = _bench.ForeignLoad()
        results[metric] = [measure() for _ in range(args.repeats)]
        _bench.emit(
            {"bench": BENCH, "metric": metric, "summary": True, **_bench.summary(results[metric]), **load.result()}
        )

    def in_process(storage: Path) -> float:
        """``list_runs`` alone, in a fresh process."""
        code = "import sys, time; from ddptrain.cli.runs import list_runs; t = time.perf_counter(); "
        code += "list_runs(sys.argv[1]); print(time.perf_counter() - t)"
        done = subprocess.run(
            [sys.executable, "-c", code, str(storage)], env=env, capture_output=True, text=True, cwd="/"
        )
        return float(done.stdout)

    try:
        history = folder / "history" / RunLayout.METRICS
        history.parent.mkdir()
        write_history(history, reports)
        new, old = folder / "new", folder / "old"
        make_runs(new, history, count, summaries=True)
        make_runs(old, history, min(count, 10), summaries=False)
        # Python's start and ddptrain's imports: the part of each command that is not reading runs.
        record("startup_s", lambda: timed([sys.executable, "-c", "import ddptrain.cli.main"], env))
        record("runs_100_s", lambda: timed(cli("runs", str(new)), env))
        record("list_runs_100_s", lambda: in_process(new))
        record("show_s", lambda: timed(cli("show", str(new / "run_000")), env))
        record("old_runs_10_s", lambda: timed(cli("runs", str(old)), env))
        record("old_show_s", lambda: timed(cli("show", str(old / "run_000")), env))
        served = dashboard(new, env, args.repeats)
        for metric in ("dashboard_runs_s", "dashboard_run_s", "dashboard_poll_s"):
            results[metric] = served[metric]
            _bench.emit({"bench": BENCH, "metric": metric, "summary": True, **_bench.summary(served[metric])})
        _bench.emit(
            {"bench": BENCH, "metric": "dashboard_peak_rss_mib", "value": round(served["dashboard_peak_rss_mib"])}
        )
        if baseline:
            one = folder / "one"
            make_runs(one, history, 1, summaries=False)
            base_env = {**os.environ, "PYTHONPATH": baseline}
            record("baseline_runs_1_s", lambda: timed(cli("runs", str(one)), base_env))
            record("baseline_show_s", lambda: timed(cli("show", str(one / "run_000")), base_env))
        _bench.emit(
            {
                "bench": BENCH,
                "setup": {"runs": count, "reports_per_run": reports, "metrics_mb": round(history.stat().st_size / 1e6)},
                "environment": _bench.environment(),
            }
        )
        med = {metric: _bench.median(values) for metric, values in results.items()}
        lines = [
            f"{count} runs of {reports} reports ({history.stat().st_size / 1e6:.0f} MB of metrics each):",
            f"  ddptrain runs: {med['runs_100_s']:.2f} s (reading {med['list_runs_100_s']:.2f} s; "
            f"Python and imports {med['startup_s']:.2f} s); ddptrain show: {med['show_s']:.2f} s",
            f"  without summaries (an older ddptrain's runs), 10 runs: runs {med['old_runs_10_s']:.2f} s, "
            f"show {med['old_show_s']:.2f} s",
            f"  dashboard: /api/runs {med['dashboard_runs_s']:.3f} s, a run's page {med['dashboard_run_s']:.3f} s, "
            f"a poll {med['dashboard_poll_s']:.3f} s, peak memory {served['dashboard_peak_rss_mib']:.0f} MiB",
        ]
        if baseline:
            lines.append(
                f"  {baseline}, 1 run: runs {med['baseline_runs_1_s']:.2f} s, show {med['baseline_show_s']:.2f} s"
            )
        print("\n" + "\n".join(lines), file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return 1 if _bench.check_leftovers(BENCH) else 0


if __name__ == "__main__":
    sys.exit(main())
