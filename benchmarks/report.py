"""Cost of a metrics-only ``train.report({"loss": float, "step": i})``, and how many reports a
second the driver takes in.

**Per call.** Each measured ``fit()`` (2 workers) runs one training function that, on every rank,
after a short warm-up:

1. times a loop of N ``report()`` calls with one ``perf_counter`` around the loop
   (``report_loop_per_call_ms`` = loop time / N);
2. times N further ``report()`` calls one by one (``report_per_call_median_ms``, ``..._p99_ms``);
3. baselines, in the same process and the same way: the loop calling a no-op Python function
   (``noop_per_call_ms``), and the loop making the store calls a report is (two
   ``TCPStore.append``: the bytes of one sealed report message, and the wake key) on the run's
   own store connection, to keys nobody reads (``raw_store_push_per_call_ms``): the transport
   with none of ddptrain's Python around it.

Per fit the worst rank counts; the figures quoted are medians over the fits. The target is a
median of <= 0.2 ms per ``report()``. The script also checks that the driver recorded every
report (``metrics.jsonl`` has one line per rank-0 report) and how long after rank 0's last
report the driver wrote it (``driver_lag_s``: whether the driver keeps up).

**The driver's report path.** Each measured ``fit()`` (2 workers) also holds the driver's
channel thread before its next read of the store (the benchmark wraps it, the only place it
reaches into ddptrain), while every rank calls ``report()`` B times as fast as it can; then it
lets go, and times how long the driver takes to read all of them off the store, open them,
gather them into rounds and write rank 0's lines to ``metrics.jsonl``: from the release to the
time recorded in the last line (``drain_reports_per_s``: rank-0 reports, one round of both
ranks' reports each; ``drain_messages_per_s``: messages). Target: >= 10,000 reports/s.

**The issue's scenario** (``--paced``, not part of the default run): 4 workers, each calling
``report()`` 2,000 times a second for ``--paced-seconds`` (30): how far behind rank 0's last
report the driver wrote it, and how long ``fit()`` ran on after the workers' last report.

    python benchmarks/report.py [--repeats N] [--quick] [--paced] [--paced-seconds S]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import _bench

BENCH = "report"
NUM_WORKERS = 2
WARMUP = 50
DRAIN_TARGET = 10_000  # rank-0 reports a second the driver must take in


def report_loop(config: dict) -> dict:
    import statistics
    import time
    from time import perf_counter

    import ddptrain as train
    from ddptrain import context
    from ddptrain.wire import channel

    n = config["n"]
    rank = train.get_context().get_world_rank()
    for i in range(config["warmup"]):
        train.report({"loss": 1.0 / (i + 1), "step": i})

    # 1. One timer around the loop.
    start = perf_counter()
    for i in range(n):
        train.report({"loss": 1.0 / (i + 1), "step": i})
    loop_s = perf_counter() - start

    # 2. Every call timed on its own.
    per_call = []
    for i in range(n):
        t0 = perf_counter()
        train.report({"loss": 1.0 / (i + 1), "step": i})
        per_call.append(perf_counter() - t0)
    last_report_time = time.time()

    # 3a. Baseline: the same loop calling a no-op Python function.
    def noop(metrics: dict) -> None:
        return None

    start = perf_counter()
    for i in range(n):
        noop({"loss": 1.0 / (i + 1), "step": i})
    noop_s = perf_counter() - start

    # 3b. Baseline: the store calls of one report (the sealed message, the wake key), raw.
    session = context._session
    assert session is not None
    assert session.channel is not None
    ch = session.channel
    message = ("report", rank, 1, {"loss": 0.5, "step": 1}, None, None)
    key, wake = f"{ch.keys.prefix}/benchmark/raw/{rank}", f"{ch.keys.prefix}/benchmark/wake/{rank}"
    data = channel.sign(ch.secret, key, message, plain_pickle=True)
    start = perf_counter()
    for _ in range(n):
        ch.store.append(key, data)
        ch.store.append(wake, b"")
    raw_s = perf_counter() - start

    per_call.sort()
    return {
        "rank": rank,
        "report_loop_per_call_ms": loop_s / n * 1e3,
        "report_per_call_median_ms": statistics.median(per_call) * 1e3,
        "report_per_call_p99_ms": per_call[int(0.99 * (len(per_call) - 1))] * 1e3,
        "report_per_call_max_ms": per_call[-1] * 1e3,
        "noop_per_call_ms": noop_s / n * 1e3,
        "raw_store_push_per_call_ms": raw_s / n * 1e3,
        "message_bytes": len(data),
        "last_report_time": last_report_time,
    }


METRICS = (
    "report_loop_per_call_ms",
    "report_per_call_median_ms",
    "report_per_call_p99_ms",
    "report_per_call_max_ms",
    "noop_per_call_ms",
    "raw_store_push_per_call_ms",
)


def one_fit(n: int, storage: str, name: str) -> tuple[list[dict], dict]:
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    trainer = TorchTrainer(
        report_loop,
        train_loop_config={"n": n, "warmup": WARMUP},
        scaling_config=train.ScalingConfig(num_workers=NUM_WORKERS),
        run_config=train.RunConfig(storage_path=storage, name=name),
    )
    before = time.perf_counter()
    result = trainer.fit()
    fit_s = time.perf_counter() - before
    per_rank = sorted(result.return_values, key=lambda r: r["rank"])
    with open(os.path.join(result.path, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    expected = WARMUP + 2 * n
    extra = {
        "fit_s": fit_s,
        "metrics_lines": len(lines),
        "metrics_lines_expected": expected,
        "history_len": len(result.metrics_history),
        # When the driver wrote rank 0's last report, after rank 0 made it.
        "driver_lag_s": lines[-1]["time"] - per_rank[0]["last_report_time"] if lines else float("nan"),
    }
    return per_rank, extra


def backlog(config: dict) -> dict:
    """Every rank reports ``n`` times while the driver's channel thread is held (rank 0 asks for
    that through a file, the benchmark's gate confirms), then says it is done."""
    import time
    from pathlib import Path

    import ddptrain as train
    from ddptrain.collective import barrier

    rank = train.get_context().get_world_rank()
    gate = Path(config["gate"])
    for i in range(config["warmup"]):
        train.report({"loss": 1.0, "step": -1 - i})
    barrier()
    if rank == 0:
        (gate / "hold").touch()
    deadline = time.monotonic() + 60
    while not (gate / "held").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.perf_counter()
    for i in range(config["n"]):
        train.report({"loss": 1.0 / (i + 1), "step": i})
    push_s = time.perf_counter() - start
    (gate / f"pushed_{rank}").touch()
    return {"rank": rank, "push_s": push_s}


class _Gate:
    """Holds the driver's channel thread before its next read of the store, from when rank 0
    asks until every rank has pushed its backlog; ``opened_at``: when it let go."""

    def __init__(self, folder: Path, world_size: int) -> None:
        self.folder, self.world_size = folder, world_size
        self.closing, self.blocked, self.release = threading.Event(), threading.Event(), threading.Event()
        self.opened_at = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Gate:
        from ddptrain.wire.driver_channel import DriverChannel

        self._original = original = DriverChannel._drain
        gate = self

        def gated(channel, reader, on_batch):  # noqa: ANN001, ANN202
            if gate.closing.is_set() and not gate.release.is_set():
                gate.blocked.set()
                gate.release.wait(120)
            return original(channel, reader, on_batch)

        DriverChannel._drain = gated  # type: ignore[method-assign]
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        from ddptrain.wire.driver_channel import DriverChannel

        self.release.set()
        DriverChannel._drain = self._original  # type: ignore[method-assign]
        self._thread.join(5)

    def _wait(self, done, timeout_s: float = 120) -> bool:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            time.sleep(0.005)
        return done()

    def _run(self) -> None:
        if not self._wait((self.folder / "hold").exists):
            return
        self.closing.set()
        if not self._wait(self.blocked.is_set):  # the thread wakes for heartbeats at least
            return
        (self.folder / "held").touch()
        pushed = [self.folder / f"pushed_{rank}" for rank in range(self.world_size)]
        self._wait(lambda: all(p.exists() for p in pushed))
        self.opened_at = time.time()
        self.release.set()


def drain_fit(n: int, storage: str, name: str) -> dict:
    """One fit: a backlog of ``n`` reports per rank, and how fast the driver takes it in."""
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    folder = Path(tempfile.mkdtemp(prefix="gate-", dir=storage))
    with _Gate(folder, NUM_WORKERS) as gate:
        result = TorchTrainer(
            backlog,
            train_loop_config={"n": n, "warmup": WARMUP, "gate": str(folder)},
            scaling_config=train.ScalingConfig(num_workers=NUM_WORKERS),
            run_config=train.RunConfig(storage_path=storage, name=name),
        ).fit()
    with open(os.path.join(result.path, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    backlog_lines = [line for line in lines if line["metrics"]["step"] >= 0]
    drain_s = backlog_lines[-1]["time"] - gate.opened_at
    push_s = max(r["push_s"] for r in result.return_values)
    return {
        "reports": n,
        "messages": n * NUM_WORKERS,
        "lines_written": len(backlog_lines),
        "drain_s": drain_s,
        "drain_reports_per_s": n / drain_s,
        "drain_messages_per_s": n * NUM_WORKERS / drain_s,
        "push_reports_per_s": n / push_s,  # how fast the slowest rank pushed its backlog
    }


def paced(config: dict) -> dict:
    """``rate`` reports a second for ``seconds``, on every rank."""
    import time

    import ddptrain as train

    rate, count = config["rate"], int(config["rate"] * config["seconds"])
    start = time.perf_counter()
    for i in range(count):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        train.report({"loss": 1.0 / (i + 1), "step": i})
    return {
        "rank": train.get_context().get_world_rank(),
        "last_report_time": time.time(),
        "behind_own_pace_s": time.perf_counter() - (start + count / rate),
    }


def paced_fit(storage: str, seconds: float, rate: float = 2000.0, workers: int = 4) -> dict:
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    before = os.times()
    result = TorchTrainer(
        paced,
        train_loop_config={"rate": rate, "seconds": seconds},
        scaling_config=train.ScalingConfig(num_workers=workers),
        run_config=train.RunConfig(storage_path=storage, name="paced"),
    ).fit()
    ended = time.time()
    after = os.times()
    with open(os.path.join(result.path, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    last = max(r["last_report_time"] for r in result.return_values)
    rank0 = next(r for r in result.return_values if r["rank"] == 0)
    return {
        "workers": workers,
        "rate_per_rank": rate,
        "seconds": seconds,
        "lines": len(lines),
        "lines_expected": int(rate * seconds),
        "driver_lag_s": lines[-1]["time"] - rank0["last_report_time"],
        "fit_ended_after_workers_s": ended - last,
        "workers_behind_their_pace_s": max(r["behind_own_pace_s"] for r in result.return_values),
        # CPU seconds of the driver process (its threads and the store's server), and of the
        # agent and workers (reaped children).
        "driver_cpu_s": after.user + after.system - before.user - before.system,
        "workers_cpu_s": after.children_user + after.children_system - before.children_user - before.children_system,
    }


def main() -> int:
    args = _bench.parse_args(
        __doc__.splitlines()[0],
        default_repeats=5,
        quick_repeats=2,
        extra=[("--paced", "also run the issue's scenario: 4 workers reporting 2,000 times a second each")],
        numbers=[("--paced-seconds", 30.0, "how long the --paced workers report")],
    )
    n = 300 if args.quick else 1000
    backlog_n = 2000 if args.quick else 20_000
    import ddptrain  # noqa: F401

    env = _bench.environment()
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "environment",
            **env,
            "repeats": args.repeats,
            "calls_per_loop": n,
            "backlog_reports": backlog_n,
            "workers": NUM_WORKERS,
        }
    )
    load = _bench.ForeignLoad()
    storage = tempfile.mkdtemp(prefix="ddptrain-bench-report-")
    worst: dict[str, list[float]] = {m: [] for m in METRICS}
    lags: list[float] = []
    drains: list[dict] = []
    scenario: dict | None = None
    lost = 0
    try:
        for repeat in range(args.repeats):
            window = _bench.ForeignLoad()
            per_rank, extra = one_fit(n, storage, f"run{repeat}")
            extra["foreign_cores"] = window.result()["foreign_cores"]
            for r in per_rank:
                _bench.emit(
                    {
                        "bench": BENCH,
                        "metric": "per_rank",
                        "repeat": repeat,
                        **{k: v for k, v in r.items() if k != "last_report_time"},
                    }
                )
            for m in METRICS:
                worst[m].append(max(r[m] for r in per_rank))
            lags.append(extra["driver_lag_s"])
            lost += extra["metrics_lines_expected"] - extra["metrics_lines"]
            _bench.emit({"bench": BENCH, "metric": "fit", "repeat": repeat, **extra})

            window = _bench.ForeignLoad()
            drain = drain_fit(backlog_n, storage, f"drain{repeat}")
            drain["foreign_cores"] = window.result()["foreign_cores"]
            lost += drain["reports"] - drain["lines_written"]
            drains.append(drain)
            _bench.emit({"bench": BENCH, "metric": "driver_drain", "repeat": repeat, **drain})
        if args.paced:
            window = _bench.ForeignLoad()
            scenario = paced_fit(storage, args.paced_seconds)
            scenario["foreign_cores"] = window.result()["foreign_cores"]
            lost += scenario["lines_expected"] - scenario["lines"]
            _bench.emit({"bench": BENCH, "metric": "paced_scenario", **scenario})
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        left = _bench.check_leftovers(BENCH)

    foreign = load.result()
    _bench.emit({"bench": BENCH, "metric": "foreign_load", **foreign})
    stats = {m: _bench.summary(v) for m, v in worst.items()}
    for m, st in stats.items():
        _bench.emit({"bench": BENCH, "metric": m, "summary": True, "worst_rank": True, **st})
    for m in ("drain_reports_per_s", "drain_messages_per_s", "push_reports_per_s"):
        _bench.emit({"bench": BENCH, "metric": m, "summary": True, **_bench.summary([d[m] for d in drains])})
    med = {m: st["median"] for m, st in stats.items()}
    drain_med = _bench.median([d["drain_reports_per_s"] for d in drains])
    ratios = {
        "report_vs_raw_store_push": med["report_per_call_median_ms"] / med["raw_store_push_per_call_ms"],
        "report_vs_noop": med["report_per_call_median_ms"] / med["noop_per_call_ms"],
        "drain_vs_target": drain_med / DRAIN_TARGET,
    }
    target_met = med["report_per_call_median_ms"] <= 0.2
    drain_met = drain_med >= DRAIN_TARGET
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "ratios",
            **ratios,
            "target_median_ms": 0.2,
            "meets_target": target_met,
            "drain_target_reports_per_s": DRAIN_TARGET,
            "meets_drain_target": drain_met,
            "driver_lag_s_median": _bench.median(lags),
            "lost_reports": lost,
        }
    )
    lines = [
        f"report: {NUM_WORKERS} workers, {n} calls per loop, {args.repeats} fits, worst rank per fit, "
        f"medians over fits ({env['cpus']} CPUs, torch {env['torch']})",
        f"  report() per call: median {med['report_per_call_median_ms']:.4f} ms "
        f"(target <= 0.2 ms: {'met' if target_met else 'NOT met'}), "
        f"p99 {med['report_per_call_p99_ms']:.4f} ms, loop mean {med['report_loop_per_call_ms']:.4f} ms",
        f"  raw store calls of one report ({per_rank[0]['message_bytes']} bytes and the wake key): "
        f"{med['raw_store_push_per_call_ms']:.4f} ms per call "
        f"-> report() is {ratios['report_vs_raw_store_push']:.2f}x the raw calls",
        f"  no-op Python call: {med['noop_per_call_ms'] * 1e3:.3f} us per call",
        f"  driver's report path, backlog of {backlog_n} reports per rank: median {drain_med:,.0f} reports/s "
        f"({_bench.median([d['drain_messages_per_s'] for d in drains]):,.0f} messages/s; target >= "
        f"{DRAIN_TARGET:,} reports/s: {'met' if drain_met else 'NOT met'}); the ranks pushed theirs at "
        f"{_bench.median([d['push_reports_per_s'] for d in drains]):,.0f} reports/s",
        f"  driver recorded every report: {'yes' if lost == 0 else f'NO, {lost} missing'}; "
        f"driver lag behind rank 0's last report: median {_bench.median(lags) * 1e3:.1f} ms",
    ]
    if scenario is not None:
        lines.append(
            f"  paced: {scenario['workers']} workers x {scenario['rate_per_rank']:,.0f} reports/s for "
            f"{scenario['seconds']:g} s: the driver wrote rank 0's last report {scenario['driver_lag_s']:.2f} s "
            f"after it was made; fit() ended {scenario['fit_ended_after_workers_s']:.2f} s after the workers' "
            f"last report (workers {scenario['workers_behind_their_pace_s']:.2f} s behind their own pace)"
        )
    lines.append(
        f"  leftover processes: {len(left)}; other processes kept {foreign['foreign_cores']:.2f} "
        f"of {env['cpus']} cores busy during the run"
    )
    print("\n".join(lines))
    return 1 if left or lost else 0


if __name__ == "__main__":
    sys.exit(main())
