"""Training throughput while checkpoints upload to S3: ``report(checkpoint_upload_mode=ASYNC)``
against the same loop without checkpoints, and with ``SYNC`` uploads.

A local S3 server (moto's standalone server, started by this script) stands in for the store.
It is pinned to the last CPU (``--no-pin-store``: not pinned): a real store's CPU is not on the
training machine, and moto's (parsing and hashing every 200 MB body) would otherwise be charged
to the training loop. The worker and its upload thread are not pinned.
One worker (``torch.set_num_threads(1)``) runs a training loop of fixed steps (a 384x384
float32 matmul chain, about 20-40 ms here) three ways, in rotating order within each repeat:

* ``none``: no checkpoint,
* ``sync``: every ``--every`` steps, write a checkpoint folder (one ``--mb`` MB file) and
  ``report(..., checkpoint=...)`` with ``SYNC`` (returns once uploaded and committed),
* ``async``: the same with ``ASYNC`` (returns at once; the worker's upload thread uploads).

Throughput = steps / (loop wall time - time spent writing the local checkpoint files), so each
variant is charged for what ``report`` costs the training thread, not for the local save that
every variant would make. After each variant the loop waits (untimed) for its uploads to be
committed, so one variant's upload does not run into the next. Ratios (sync/none,
async/none) are medians over the repeats, each ratio from one repeat (target: async >= 0.95x).

    python benchmarks/async_upload.py [--repeats N] [--quick] [--mb 200] [--every 100] [--steps 400]

Needs ``pip install ddptrain[s3] moto[server]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import _bench

BENCH = "async_upload"
MB = 1024 * 1024


def training_loop(config: dict) -> list[dict[str, float]]:
    import torch

    import ddptrain as train

    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights = torch.randn(384, 384) / 20
    x = torch.randn(384, 384)
    block = os.urandom(MB)
    variants = ["none", "sync", "async"]
    results = []
    for repeat in range(config["repeats"] + 1):  # repeat 0 is a warm-up
        order = variants[repeat % 3 :] + variants[: repeat % 3]
        timed: dict[str, float] = {}
        for variant in order:
            saving = 0.0
            start = time.perf_counter()
            for step in range(1, config["steps"] + 1):
                y = x
                for _ in range(8):
                    y = torch.tanh(y @ weights)
                if variant == "none" or step % config["every"]:
                    continue
                began = time.perf_counter()
                d = tempfile.mkdtemp(prefix="ddptrain_bench_ckpt_")
                with open(os.path.join(d, "weights.bin"), "wb") as f:
                    for _ in range(config["mb"]):
                        f.write(block)
                saving += time.perf_counter() - began
                mode = train.CheckpointUploadMode.ASYNC if variant == "async" else train.CheckpointUploadMode.SYNC
                train.report(
                    {"variant": variant, "step": step}, checkpoint=train.Checkpoint(d), checkpoint_upload_mode=mode
                )
                if variant == "sync":
                    shutil.rmtree(d)
            elapsed = time.perf_counter() - start - saving
            timed[variant] = config["steps"] / elapsed
            train.get_all_reported_checkpoints()  # untimed: this variant's uploads are committed
        if repeat:
            results.append(timed)
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mb", type=int, default=None, help="checkpoint size in MB (200; --quick 20)")
    parser.add_argument("--every", type=int, default=None, help="steps between checkpoints (100; --quick 25)")
    parser.add_argument("--steps", type=int, default=None, help="steps per variant (400; --quick 100)")
    parser.add_argument("--no-pin-store", action="store_true", help="leave the S3 server unpinned")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    config = {
        "mb": args.mb or (20 if args.quick else 200),
        "every": args.every or (25 if args.quick else 100),
        "steps": args.steps or (100 if args.quick else 400),
        "repeats": repeats,
    }
    load = _bench.ForeignLoad()
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pinned = not args.no_pin_store and (os.cpu_count() or 1) > 1
    if pinned:
        os.sched_setaffinity(server.pid, {(os.cpu_count() or 1) - 1})
    cache = tempfile.mkdtemp(prefix="ddptrain_bench_s3_")
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        DDPTRAIN_CACHE_DIR=cache,
    )
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
        result = train.DataParallelTrainer(
            training_loop,
            train_loop_config=config,
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(
                name="async_upload",
                storage_path="s3://bench/runs",
                checkpoint_config=train.CheckpointConfig(num_to_keep=1),  # moto keeps objects in memory
            ),
        ).fit()
        rows: list[dict[str, float]] = result.return_value
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(cache, ignore_errors=True)
    sync_ratio = _bench.median([r["sync"] / r["none"] for r in rows])
    async_ratio = _bench.median([r["async"] / r["none"] for r in rows])
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "throughput_ratio",
            **config,
            "steps_per_s": {v: _bench.summary([r[v] for r in rows]) for v in ("none", "sync", "async")},
            "store_pinned": pinned,
            "sync_vs_none": round(sync_ratio, 3),
            "async_vs_none": round(async_ratio, 3),
        }
    )
    _bench.emit({"bench": BENCH, "metric": "environment", **_bench.environment(), **load.result()})
    left = _bench.check_leftovers(BENCH)
    print(
        f"\n{BENCH}: {config['mb']} MB checkpoint every {config['every']} steps to a local S3 server "
        f"({'pinned to the last CPU' if pinned else 'not pinned'}), "
        f"medians of {len(rows)} repeats"
    )
    print(f"  SYNC  {sync_ratio:.2f}x the loop without checkpoints")
    print(f"  ASYNC {async_ratio:.2f}x the loop without checkpoints (target >= 0.95x)")
    if left:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
