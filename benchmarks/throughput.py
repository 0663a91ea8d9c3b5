"""Training throughput through ``TorchTrainer`` against plain ``torch.multiprocessing.spawn``.

The same DDP training loop (a small MLP on synthetic data: 32 features -> 256 hidden -> 10
classes, batch 64 per process, SGD, ``torch.set_num_threads(1)``, 2 processes, gloo) runs

* (a) as the training function of ``TorchTrainer`` with ``ScalingConfig(num_workers=2)``;
* (b) under ``torch.multiprocessing.spawn`` with ``init_process_group("gloo")`` and
  ``DistributedDataParallel``, in this script.

Only the training steps are timed, inside the loop, after the warm-up steps: the timed steps
run in windows (5 by default) that each start at a ``barrier()``. A window's throughput is
``processes * batch * steps / slowest process's time``; a run's is the median over its
windows (a hiccup of the machine spoils one window, not the run); the whole timed run is
reported too. Startup and teardown are excluded. Both variants get the same seeds and data,
so their final parameters must match (checked). The order of (a) and (b) alternates across
repeats (an even repeat count gives each the first slot equally often). Ratio:
median(a) / median(b), the issue's target being >= 0.99; also the median of the per-repeat
ratios a/b (each pair ran back to back, on the same machine state).

    python benchmarks/throughput.py [--repeats N] [--quick]
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile

import _bench

BENCH = "throughput"
WORLD = 2
BATCH = 64


def mlp_loop(rank: int, world: int, config: dict) -> dict:
    """The training loop both variants run; the process group already exists."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(config["seed"] + rank)
    pool = 16  # synthetic batches, cycled
    xs = torch.randn(pool, config["batch"], 32, generator=generator)
    ys = torch.randint(0, 10, (pool, config["batch"]), generator=generator)

    def step(i: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(xs[i % pool]), ys[i % pool])
        loss.backward()  # gradients are all-reduced (and waited for) here
        optimizer.step()

    for i in range(config["warmup"]):
        step(i)
    # The timed steps, in windows that each start at a barrier.
    per_window = config["steps"] // config["windows"]
    windows = []
    i = config["warmup"]
    for _ in range(config["windows"]):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(per_window):
            step(i)
            i += 1
        windows.append(time.perf_counter() - start)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {
        "rank": rank,
        "world": world,
        "window_s": windows,
        "steps_per_window": per_window,
        "batch": config["batch"],
        "param_checksum": checksum,
    }


# ----------------------------------------------------------------------------- (a) ddptrain
def ddptrain_train_fn(config: dict) -> dict:
    import ddptrain as train

    context = train.get_context()
    return mlp_loop(context.get_world_rank(), context.get_world_size(), config)


def run_ddptrain(config: dict, storage: str, name: str) -> list[dict]:
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    trainer = TorchTrainer(
        ddptrain_train_fn,
        train_loop_config=config,
        scaling_config=train.ScalingConfig(num_workers=WORLD),
        run_config=train.RunConfig(storage_path=storage, name=name),
    )
    return list(trainer.fit().return_values)


# ----------------------------------------------------------------------------- (b) plain spawn
def _plain_worker(rank: int, world: int, port: int, config: dict, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = mlp_loop(rank, world, config)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_plain(config: dict) -> list[dict]:
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix="ddptrain-bench-plain-")
    try:
        mp.spawn(_plain_worker, args=(WORLD, _free_port(), config, out_dir), nprocs=WORLD, join=True)
        results = []
        for rank in range(WORLD):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _stop_resource_tracker() -> None:
    """``spawn`` started multiprocessing's resource tracker; it would only exit with this
    process, so stop it now, before the check for leftover processes."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()


def samples_per_s(per_rank: list[dict]) -> tuple[float, float]:
    """(median over windows, whole timed run) of the samples/s of all processes together;
    each window counts at its slowest process's time."""
    samples = sum(r["steps_per_window"] * r["batch"] for r in per_rank)
    windows = [max(times) for times in zip(*(r["window_s"] for r in per_rank))]
    return _bench.median([samples / w for w in windows]), samples * len(windows) / sum(windows)


def main() -> int:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=6, quick_repeats=2)
    config = {
        "steps": 400 if args.quick else 3000,
        "windows": 2 if args.quick else 5,
        "warmup": 20 if args.quick else 50,
        "batch": BATCH,
        "seed": 1234,
    }
    # ddptrain gives its workers OMP_NUM_THREADS=1; give the spawned processes the same.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ddptrain  # noqa: F401

    env = _bench.environment()
    _bench.emit({"bench": BENCH, "metric": "environment", **env, "repeats": args.repeats, "processes": WORLD, **config})
    load = _bench.ForeignLoad()
    storage = tempfile.mkdtemp(prefix="ddptrain-bench-throughput-")
    measured: dict[str, list[float]] = {"ddptrain": [], "plain": []}
    whole_run: dict[str, list[float]] = {"ddptrain": [], "plain": []}
    checksums: dict[str, set[float]] = {"ddptrain": set(), "plain": set()}
    try:
        for repeat in range(args.repeats):
            order = ["ddptrain", "plain"] if repeat % 2 == 0 else ["plain", "ddptrain"]
            for variant in order:
                window = _bench.ForeignLoad()
                if variant == "ddptrain":
                    per_rank = run_ddptrain(config, storage, f"run{repeat}")
                else:
                    per_rank = run_plain(config)
                value, whole = samples_per_s(per_rank)
                measured[variant].append(value)
                whole_run[variant].append(whole)
                checksums[variant].update(round(r["param_checksum"], 6) for r in per_rank)
                _bench.emit(
                    {
                        "bench": BENCH,
                        "metric": "samples_per_s",
                        "variant": variant,
                        "repeat": repeat,
                        "position": order.index(variant),
                        "value": value,
                        "whole_run": whole,
                        "window_s": [r["window_s"] for r in per_rank],
                        **window.result(),
                    }
                )
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        _stop_resource_tracker()
        left = _bench.check_leftovers(BENCH)

    foreign = load.result()
    _bench.emit({"bench": BENCH, "metric": "foreign_load", **foreign})
    stats = {variant: _bench.summary(values) for variant, values in measured.items()}
    for variant, st in stats.items():
        _bench.emit(
            {
                "bench": BENCH,
                "metric": "samples_per_s",
                "variant": variant,
                "summary": True,
                **st,
                "whole_run_median": _bench.median(whole_run[variant]),
            }
        )
    ratio = stats["ddptrain"]["median"] / stats["plain"]["median"]
    # Each repeat runs both variants back to back: the ratio within a repeat sees the same
    # machine state, so its median is a second, drift-resistant estimate.
    paired = [a / b for a, b in zip(measured["ddptrain"], measured["plain"])]
    whole_ratio = _bench.median(whole_run["ddptrain"]) / _bench.median(whole_run["plain"])
    same_params = checksums["ddptrain"] == checksums["plain"] and len(checksums["plain"]) == 1
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "ratio_ddptrain_over_plain",
            "value": ratio,
            "paired_median": _bench.median(paired),
            "paired": paired,
            "whole_run_ratio": whole_ratio,
            "target": 0.99,
            "meets_target": ratio >= 0.99,
            "same_final_params": same_params,
        }
    )
    print(
        "\n".join(
            [
                f"throughput: MLP 32-256-10, batch {BATCH} x {WORLD} processes, {config['steps']} timed steps in "
                f"{config['windows']} windows after {config['warmup']} warm-up, {args.repeats} repeats, "
                f"medians ({env['cpus']} CPUs, torch {env['torch']})",
                f"  ddptrain TorchTrainer: {stats['ddptrain']['median']:,.0f} samples/s "
                f"(min {stats['ddptrain']['min']:,.0f}, max {stats['ddptrain']['max']:,.0f})",
                f"  plain mp.spawn + DDP:  {stats['plain']['median']:,.0f} samples/s "
                f"(min {stats['plain']['min']:,.0f}, max {stats['plain']['max']:,.0f})",
                f"  ratio ddptrain/plain: {ratio:.3f} (target >= 0.99: {'met' if ratio >= 0.99 else 'NOT met'}); "
                f"median of per-repeat ratios {_bench.median(paired):.3f} "
                f"(range {min(paired):.3f}-{max(paired):.3f}); whole timed run {whole_ratio:.3f}",
                f"  same final parameters in both: {'yes' if same_params else 'NO'}",
                f"  leftover processes: {len(left)}; other processes kept {foreign['foreign_cores']:.2f} "
                f"of {env['cpus']} cores busy during the run",
            ]
        )
    )
    return 1 if left or not same_params else 0


if __name__ == "__main__":
    sys.exit(main())
