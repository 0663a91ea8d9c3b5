"""Checkpoint upload to S3: ``report(checkpoint=...)`` on a run with ``storage_path="s3://..."``
against a plain ``s3fs`` upload of the same file.

A local S3 server (moto's standalone server, started by this script) stands in for the store.
Inside the training function of a 1-worker run, each round writes a 50 MB checkpoint (not
timed) and then, in alternating order, times

* ``report(checkpoint=...)`` until it returns: the worker uploads the file straight to the
  store, the driver commits it (uploads the index) and acknowledges, and
* the baseline: ``S3FileSystem.put_file`` of the same file to another key of the same bucket,
  in the same process.

Ratio = report MB/s / put MB/s, medians over all rounds (target >= 0.9).

    python benchmarks/remote_checkpoint.py [--repeats N] [--quick]

Needs ``pip install ddptrain[s3] moto[server]``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import _bench

BENCH = "remote_checkpoint"
MB = 1024 * 1024


def upload_loop(config: dict) -> list[tuple[float, float]]:
    import s3fs

    import ddptrain as train

    fs = s3fs.S3FileSystem()
    rounds = []
    for i in range(config["rounds"] + 1):  # the first round is a warm-up
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "weights.bin"), "wb") as f:
                block = os.urandom(MB)
                for _ in range(config["size"] // MB):
                    f.write(block)
            timed = {}
            for what in ("put", "report") if i % 2 else ("report", "put"):
                start = time.perf_counter()
                if what == "report":
                    train.report({"round": i}, checkpoint=train.Checkpoint.from_directory(d))
                else:
                    fs.put_file(os.path.join(d, "weights.bin"), f"{config['bucket']}/baseline/{i}/weights.bin")
                timed[what] = time.perf_counter() - start
        rounds.append((timed["put"], timed["report"]))
    return rounds[1:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=3, quick_repeats=1)
    size = (10 if args.quick else 50) * MB
    rounds = 2 if args.quick else 6
    load = _bench.ForeignLoad()
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cache = tempfile.mkdtemp(prefix="ddptrain_bench_s3_")
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        DDPTRAIN_CACHE_DIR=cache,
    )
    pairs: list[tuple[float, float]] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("moto's S3 server did not start") from None
                time.sleep(0.1)
        import s3fs

        import ddptrain as train

        s3fs.S3FileSystem().mkdir("bench")
        for repeat in range(args.repeats):
            result = train.DataParallelTrainer(
                upload_loop,
                train_loop_config={"size": size, "rounds": rounds, "bucket": "bench"},
                scaling_config=train.ScalingConfig(num_workers=1),
                run_config=train.RunConfig(name=f"upload_{repeat}", storage_path="s3://bench/runs"),
            ).fit()
            pairs.extend(result.return_value)
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(cache, ignore_errors=True)
    mb = size / MB
    put_s = [p for p, _ in pairs]
    report_s = [r for _, r in pairs]
    put_rate, report_rate = mb / _bench.median(put_s), mb / _bench.median(report_s)
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "report_vs_put",
            "mb": mb,
            "put_seconds": _bench.summary(put_s),
            "report_seconds": _bench.summary(report_s),
            "put_mb_per_s": round(put_rate, 1),
            "report_mb_per_s": round(report_rate, 1),
            "ratio": round(report_rate / put_rate, 3),
        }
    )
    _bench.emit({"bench": BENCH, "metric": "environment", **_bench.environment(), **load.result()})
    left = _bench.check_leftovers(BENCH)
    print(f"\n{BENCH}: {mb:.0f} MB checkpoint to a local S3 server, medians of {len(pairs)} rounds")
    print(
        f"  report() {report_rate:7.1f} MB/s, s3fs put_file {put_rate:7.1f} MB/s: "
        f"{report_rate / put_rate:.2f}x (target >= 0.9x)"
    )
    if left:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
