"""JAX data-parallel samples/s: ``JaxTrainer`` against the same processes started by hand.

The same step runs two ways, 2 processes on CPU, each with one JAX CPU device:

* (a) ``ddptrain``: ``JaxTrainer`` with 2 workers (``jax.distributed`` started by ddptrain,
  gloo collectives), ``ddptrain.report`` every ``report_every`` steps;
* (b) ``by_hand``: 2 processes of this script started here, each calling
  ``jax.distributed.initialize(coordinator_address="127.0.0.1:<port>", num_processes=2,
  process_id=rank)`` itself with the same CPU-collectives setting: the baseline.

The step: an MLP (``features`` -> hidden -> hidden -> 1, float32) on a global batch built
from each process's local batch with ``jax.make_array_from_process_local_data``, loss and
gradients in one jitted function with replicated parameters (XLA all-reduces the gradients
across the processes), an optax Adam update. Measured: ``samples_per_s``, global samples of
the timed steps over the time from the end of the last warm-up step to the end of the last
timed step, on the slowest process; and ``cpu_ms_per_1k_samples``, the CPU time all processes
(every thread) used in the timed steps per 1000 samples, which other load skews least. The
order of the variants alternates across repeats.
Ratios: median(a) / median(b); best run of (a) / best run of (b); and the ratio of the
medians of the runs no other process disturbed (other processes kept < 0.05 cores busy: on a
shared 2-core machine the medians of all runs mostly measure the neighbours).

    python benchmarks/jax_data_parallel.py [--repeats N] [--quick]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import _bench

BENCH = "jax_data_parallel"
WORLD = 2
_CHILD_VAR = "DDPTRAIN_BENCH_JAX_CHILD"  # set in the hand-started processes: their settings
_QUIET_CORES = 0.05  # a run during which other processes kept fewer cores busy is "undisturbed"


def steps(config: dict[str, Any]) -> dict[str, Any]:
    """The measured loop, in a process whose jax.distributed is running: the end time of every
    step, and the CPU time the whole process (every thread) used in the timed steps."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    rank = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    replicated, by_row = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(0)
    sizes = [config["features"], config["hidden"], config["hidden"], 1]
    params = [
        {
            "w": (rng.normal(size=(m, n)) / np.sqrt(m)).astype("float32"),
            "b": np.zeros(n, "float32"),
        }
        for m, n in zip(sizes[:-1], sizes[1:])
    ]
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)

    def replicate(tree: Any) -> Any:
        return jax.tree.map(lambda a: jax.make_array_from_process_local_data(replicated, np.asarray(a)), tree)

    params, opt_state = replicate(params), replicate(opt_state)

    def loss_fn(params: Any, x: Any, y: Any) -> Any:
        for layer in params[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        return (((x @ params[-1]["w"] + params[-1]["b"])[:, 0] - y) ** 2).mean()

    @jax.jit
    def step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    data = np.random.default_rng(1 + rank)
    batches = [
        (
            data.normal(size=(config["batch"], config["features"])).astype("float32"),
            data.normal(size=config["batch"]).astype("float32"),
        )
        for _ in range(4)
    ]
    report = None
    if config.get("report_every"):
        import ddptrain

        report = ddptrain.report
    ends, cpu_start = [], 0.0
    for i in range(config["warmup"] + config["steps"]):
        if i == config["warmup"]:
            cpu_start = time.process_time()
        x, y = batches[i % len(batches)]
        params, opt_state, loss = step(
            params,
            opt_state,
            jax.make_array_from_process_local_data(by_row, x),
            jax.make_array_from_process_local_data(by_row, y),
        )
        loss.block_until_ready()
        ends.append(time.perf_counter())
        if report is not None and (i + 1) % config["report_every"] == 0:
            report({"step": i, "loss": float(np.asarray(loss.addressable_data(0)))})
    return {"ends": ends, "cpu_s": time.process_time() - cpu_start}


def rate(config: dict[str, Any], per_rank: list[dict[str, Any]]) -> tuple[float, float]:
    """Global samples per second of the timed steps, on the slowest process; and the CPU
    milliseconds all processes used per 1000 samples (what other load on the machine skews
    least)."""
    warmup, count = config["warmup"], config["steps"]
    seconds = max(r["ends"][warmup + count - 1] - r["ends"][warmup - 1] for r in per_rank)
    samples = count * config["batch"] * WORLD
    return samples / seconds, 1e6 * sum(r["cpu_s"] for r in per_rank) / samples


# ----------------------------------------------------------------- (a) JaxTrainer
def run_ddptrain(config: dict[str, Any], storage: str, name: str) -> tuple[float, float]:
    import ddptrain
    from ddptrain.jax import JaxTrainer

    result = JaxTrainer(
        steps,
        train_loop_config=config,
        scaling_config=ddptrain.ScalingConfig(num_workers=WORLD),
        run_config=ddptrain.RunConfig(name=name, storage_path=storage),
    ).fit()
    return rate(config, result.return_values)


# ----------------------------------------------------------------- (b) jax.distributed by hand
def child(settings: dict[str, Any]) -> None:
    """A hand-started process: jax.distributed as ddptrain starts it, then the same loop."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{settings['port']}", num_processes=WORLD, process_id=settings["rank"]
    )
    measured = steps({**settings["config"], "report_every": 0})
    with open(settings["out"], "w") as f:
        json.dump(measured, f)
    jax.distributed.shutdown()  # together: JAX's shutdown barrier is met at once
    sys.stdout.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_by_hand(config: dict[str, Any], folder: str) -> tuple[float, float]:
    port = _free_port()
    outs = [os.path.join(folder, f"rank{rank}.json") for rank in range(WORLD)]
    children = []
    try:
        for rank in range(WORLD):
            settings = {"config": config, "rank": rank, "port": port, "out": outs[rank]}
            env = {**os.environ, _CHILD_VAR: json.dumps(settings)}
            children.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env))
        for proc in children:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"a hand-started process exited with code {proc.returncode}")
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    per_rank = []
    for out in outs:
        with open(out) as f:
            per_rank.append(json.load(f))
    return rate(config, per_rank)


def main() -> int:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=5, quick_repeats=1)
    config = {
        "features": 256,
        "hidden": 512,
        "batch": 256,  # per process
        "warmup": 10,
        "steps": 40 if args.quick else 300,
        "report_every": 50,
    }
    import jax
    import optax

    import ddptrain  # noqa: F401

    env = _bench.environment()
    env.update(jax=jax.__version__, optax=optax.__version__)
    _bench.emit({"bench": BENCH, "metric": "environment", **env, "repeats": args.repeats, "processes": WORLD, **config})
    load = _bench.ForeignLoad()
    variants = ["ddptrain", "by_hand"]
    measured: dict[str, list[float]] = {v: [] for v in variants}
    quiet: dict[str, list[float]] = {v: [] for v in variants}  # runs no other process disturbed
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    folder = tempfile.mkdtemp(prefix="ddptrain-bench-jax-")
    try:
        for repeat in range(args.repeats):
            order = variants if repeat % 2 == 0 else variants[::-1]
            for variant in order:
                window = _bench.ForeignLoad()
                if variant == "ddptrain":
                    value, cpu_ms = run_ddptrain(config, folder, f"run{repeat}")
                else:
                    value, cpu_ms = run_by_hand(config, folder)
                measured[variant].append(value)
                cpu[variant].append(cpu_ms)
                disturbed = window.result()
                if disturbed["foreign_cores"] < _QUIET_CORES:
                    quiet[variant].append(value)
                _bench.emit(
                    {
                        "bench": BENCH,
                        "metric": "samples_per_s",
                        "variant": variant,
                        "repeat": repeat,
                        "position": order.index(variant),
                        "value": value,
                        "cpu_ms_per_1k_samples": cpu_ms,
                        **disturbed,
                    }
                )
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        left = _bench.check_leftovers(BENCH)

    _bench.emit({"bench": BENCH, "metric": "foreign_load", **load.result()})
    stats = {variant: _bench.summary(values) for variant, values in measured.items()}
    for variant, st in stats.items():
        _bench.emit({"bench": BENCH, "metric": "samples_per_s", "variant": variant, "summary": True, **st})
    cpu_stats = {variant: _bench.summary(values) for variant, values in cpu.items()}
    for variant, st in cpu_stats.items():
        _bench.emit({"bench": BENCH, "metric": "cpu_ms_per_1k_samples", "variant": variant, "summary": True, **st})
    ratio = stats["ddptrain"]["median"] / stats["by_hand"]["median"]
    cpu_ratio = cpu_stats["ddptrain"]["median"] / cpu_stats["by_hand"]["median"]
    best = stats["ddptrain"]["max"] / stats["by_hand"]["max"]
    quiet_ratio = (
        _bench.median(quiet["ddptrain"]) / _bench.median(quiet["by_hand"])
        if quiet["ddptrain"] and quiet["by_hand"]
        else None
    )
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "ratios",
            "ddptrain_over_by_hand": ratio,
            "best_over_best": best,
            "quiet_medians": quiet_ratio,
            "quiet_runs": {v: len(values) for v, values in quiet.items()},
            "cpu_ddptrain_over_by_hand": cpu_ratio,
        }
    )
    labels = {
        "ddptrain": "(a) JaxTrainer, 2 workers",
        "by_hand": "(b) jax.distributed.initialize by hand, 2 processes",
    }
    lines = [
        f"jax data parallel: MLP {config['features']}-{config['hidden']}-{config['hidden']}-1, "
        f"{config['batch']} rows per process per step, {config['steps']} timed steps after {config['warmup']}, "
        f"{args.repeats} repeats, medians ({env['cpus']} CPUs, jax {env['jax']})",
    ]
    for variant, label in labels.items():
        st = stats[variant]
        lines.append(
            f"  {label}: {st['median']:.0f} samples/s (min {st['min']:.0f}, max {st['max']:.0f}), "
            f"{cpu_stats[variant]['median']:.1f} CPU ms per 1000 samples"
        )
    lines.append(f"  ratio (a)/(b): medians {ratio:.3f}, best runs {best:.3f}; CPU per sample {cpu_ratio:.3f}")
    if quiet_ratio is not None:
        counts = "/".join(str(len(quiet[v])) for v in variants)
        lines.append(f"  ratio of the medians of undisturbed runs ({counts}): {quiet_ratio:.3f}")
    print("\n".join(lines), file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    child_settings = os.environ.pop(_CHILD_VAR, None)
    if child_settings is not None:
        child(json.loads(child_settings))
    else:
        sys.exit(main())
