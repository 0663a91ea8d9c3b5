"""Cost of a metrics-only ``train.report({"loss": float, "step": i})`` in a 2-worker run.

Each measured ``fit()`` (2 workers) runs one training function that, on every rank, after a
short warm-up:

1. times a loop of N ``report()`` calls with one ``perf_counter`` around the loop
   (``report_loop_per_call_ms`` = loop time / N);
2. times N further ``report()`` calls one by one (``report_per_call_median_ms``, ``..._p99_ms``);
3. baselines, in the same process and the same way: the loop calling a no-op Python function
   (``noop_per_call_ms``), and the loop calling ``TCPStore.queue_push`` on the run's own store
   connection with the bytes of one signed report message, pushed to a key nobody reads
   (``raw_queue_push_per_call_ms``): the transport with none of ddptrain's Python around it.

Per fit the worst rank counts; the figures quoted are medians over the fits. The target is a
median of <= 0.2 ms per ``report()``. The script also checks that the driver recorded every
report (``metrics.jsonl`` has one line per rank-0 report) and how long after rank 0's last
report the driver wrote it (``driver_lag_s``: whether the driver keeps up).

    python benchmarks/report.py [--repeats N] [--quick]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import _bench

BENCH = "report"
NUM_WORKERS = 2
WARMUP = 50


def report_loop(config: dict) -> dict:
    import statistics
    import time
    from time import perf_counter

    import ddptrain as train
    from ddptrain import channel, context

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

    # 3b. Baseline: raw TCPStore.queue_push of the bytes of one signed report message.
    session = context._session
    assert session is not None
    assert session.channel is not None
    ch = session.channel
    message = ("report", rank, 1, {"loss": 0.5, "step": 1}, None, None)
    key = f"{ch.keys.prefix}/benchmark/raw/{rank}"
    data = channel.sign(ch.secret, key, message, plain_pickle=True)
    start = perf_counter()
    for _ in range(n):
        ch.store.queue_push(key, data)
    raw_s = perf_counter() - start

    per_call.sort()
    return {
        "rank": rank,
        "report_loop_per_call_ms": loop_s / n * 1e3,
        "report_per_call_median_ms": statistics.median(per_call) * 1e3,
        "report_per_call_p99_ms": per_call[int(0.99 * (len(per_call) - 1))] * 1e3,
        "report_per_call_max_ms": per_call[-1] * 1e3,
        "noop_per_call_ms": noop_s / n * 1e3,
        "raw_queue_push_per_call_ms": raw_s / n * 1e3,
        "message_bytes": len(data),
        "last_report_time": last_report_time,
    }


METRICS = (
    "report_loop_per_call_ms",
    "report_per_call_median_ms",
    "report_per_call_p99_ms",
    "report_per_call_max_ms",
    "noop_per_call_ms",
    "raw_queue_push_per_call_ms",
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


def main() -> int:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=5, quick_repeats=2)
    n = 300 if args.quick else 1000
    import ddptrain  # noqa: F401

    env = _bench.environment()
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "environment",
            **env,
            "repeats": args.repeats,
            "calls_per_loop": n,
            "workers": NUM_WORKERS,
        }
    )
    load = _bench.ForeignLoad()
    storage = tempfile.mkdtemp(prefix="ddptrain-bench-report-")
    worst: dict[str, list[float]] = {m: [] for m in METRICS}
    lags: list[float] = []
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
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        left = _bench.check_leftovers(BENCH)

    foreign = load.result()
    _bench.emit({"bench": BENCH, "metric": "foreign_load", **foreign})
    stats = {m: _bench.summary(v) for m, v in worst.items()}
    for m, st in stats.items():
        _bench.emit({"bench": BENCH, "metric": m, "summary": True, "worst_rank": True, **st})
    med = {m: st["median"] for m, st in stats.items()}
    ratios = {
        "report_vs_raw_queue_push": med["report_per_call_median_ms"] / med["raw_queue_push_per_call_ms"],
        "report_vs_noop": med["report_per_call_median_ms"] / med["noop_per_call_ms"],
    }
    target_met = med["report_per_call_median_ms"] <= 0.2
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "ratios",
            **ratios,
            "target_median_ms": 0.2,
            "meets_target": target_met,
            "driver_lag_s_median": _bench.median(lags),
            "lost_reports": lost,
        }
    )
    print(
        "\n".join(
            [
                f"report: {NUM_WORKERS} workers, {n} calls per loop, {args.repeats} fits, worst rank per fit, "
                f"medians over fits ({env['cpus']} CPUs, torch {env['torch']})",
                f"  report() per call: median {med['report_per_call_median_ms']:.4f} ms "
                f"(target <= 0.2 ms: {'met' if target_met else 'NOT met'}), "
                f"p99 {med['report_per_call_p99_ms']:.4f} ms, loop mean {med['report_loop_per_call_ms']:.4f} ms",
                f"  raw TCPStore.queue_push of the same {per_rank[0]['message_bytes']} bytes: "
                f"{med['raw_queue_push_per_call_ms']:.4f} ms per call "
                f"-> report() is {ratios['report_vs_raw_queue_push']:.2f}x the raw push",
                f"  no-op Python call: {med['noop_per_call_ms'] * 1e3:.3f} us per call",
                f"  driver recorded every report: {'yes' if lost == 0 else f'NO, {lost} missing'}; "
                f"driver lag behind rank 0's last report: median {_bench.median(lags) * 1e3:.1f} ms",
                f"  leftover processes: {len(left)}; other processes kept {foreign['foreign_cores']:.2f} "
                f"of {env['cpus']} cores busy during the run",
            ]
        )
    )
    return 1 if left or lost else 0


if __name__ == "__main__":
    sys.exit(main())
