"""Recovery time after a worker crash.

* ``restart_s``: from the moment rank 1 kills itself (SIGKILL) to the first training step of
  the restarted attempt (``FailureConfig(max_failures=1)``, resuming from a checkpoint).
* ``fail_s``: from the same crash to ``fit()`` raising ``TrainingFailedError`` when no
  failure is allowed.

For context, ``launch_s`` is a fresh ``fit()``'s time to the first line of the training
function: a restart cannot beat starting workers, so the difference is what teardown and
recovery cost on top. Target: restart <= 3 s on this kind of machine (<= 0.5 s locally with
warm agents: the restart forks its workers from the failed attempt's agent).

``--ssh``: the same with the 2 workers on one SSH host (a loopback sshd started by this script,
as the tests do). ``DDPTRAIN_WARM_RESTARTS=0`` measures restarts that start new agents.

    python benchmarks/recovery.py [--repeats N] [--quick] [--ssh]
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import _bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sshd import SSHServers, why_no_sshd  # noqa: E402

BENCH = "recovery"


def crash_once(config: dict) -> float | None:
    import ddptrain as train

    now = time.time()  # the first line: on a restart, the first training step
    if train.get_checkpoint() is not None:
        return now
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "state"), "w").close()
        train.report({"step": 0}, checkpoint=train.Checkpoint.from_directory(d))
    if train.get_context().get_world_rank() == 1:
        with open(config["crash_file"], "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # rank 0 waits for the driver to stop it
    return None


def first_line() -> float:
    return time.time()


HOSTS: list[str] | None = None  # --ssh: ["h0 slots=2"]


def measure(storage: str, name: str, max_failures: int) -> float:
    import ddptrain as train

    crash_file = os.path.join(storage, f"{name}.crash")
    trainer = train.DataParallelTrainer(
        crash_once,
        train_loop_config={"crash_file": crash_file},
        scaling_config=train.ScalingConfig(num_workers=2, hosts=HOSTS),
        run_config=train.RunConfig(
            name=name, storage_path=storage, failure_config=train.FailureConfig(max_failures=max_failures)
        ),
    )
    try:
        result = trainer.fit()
        end = min(t for t in result.return_values if t is not None)
    except train.TrainingFailedError:
        end = time.time()
    with open(crash_file) as f:
        return end - float(f.read())


def launch(storage: str, name: str) -> float:
    import ddptrain as train

    start = time.time()
    result = train.DataParallelTrainer(
        first_line,
        scaling_config=train.ScalingConfig(num_workers=2, hosts=HOSTS),
        run_config=train.RunConfig(name=name, storage_path=storage),
    ).fit()
    return min(result.return_values) - start


def main() -> None:
    global HOSTS
    args = _bench.parse_args(
        __doc__.splitlines()[0], default_repeats=5, quick_repeats=2, extra=[("--ssh", "2 workers on one SSH host")]
    )
    load = _bench.ForeignLoad()
    storage = tempfile.mkdtemp(prefix="ddptrain_bench_recovery_")
    servers = None
    if args.ssh:
        reason = why_no_sshd()
        if reason:
            raise SystemExit(reason)
        servers = SSHServers(Path(storage) / "sshd", count=1)
        os.environ["DDPTRAIN_SSH_KNOWN_HOSTS"] = str(servers.known_hosts)
        os.environ["DDPTRAIN_SSH_CONFIG"] = str(servers.ssh_config)
        HOSTS = ["h0 slots=2"]
    times: dict[str, list[float]] = {"restart_s": [], "fail_s": [], "launch_s": []}
    try:
        launch(storage, "warmup")
        for repeat in range(args.repeats):
            times["restart_s"].append(measure(storage, f"restart_{repeat}", 1))
            times["fail_s"].append(measure(storage, f"fail_{repeat}", 0))
            times["launch_s"].append(launch(storage, f"launch_{repeat}"))
    finally:
        if servers is not None:
            servers.close()
        shutil.rmtree(storage, ignore_errors=True)
    for metric, values in times.items():
        _bench.emit({"bench": BENCH, "metric": metric, "ssh": args.ssh, "seconds": _bench.summary(values)})
    _bench.emit({"bench": BENCH, "metric": "environment", **_bench.environment(), **load.result()})
    left = _bench.check_leftovers(BENCH)
    med = {k: _bench.median(v) for k, v in times.items()}
    where = "on one SSH host" if args.ssh else "on this machine"
    warm = "off" if os.environ.get("DDPTRAIN_WARM_RESTARTS", "1").strip() == "0" else "on"
    print(f"\n{BENCH}: medians of {args.repeats} runs, 2 workers {where}, warm restarts {warm}")
    print(f"  crash -> first step of the restarted attempt  {med['restart_s']:.2f} s (target <= 3 s)")
    print(f"  crash -> fit() raises (no failures allowed)    {med['fail_s']:.2f} s")
    print(f"  fresh fit() -> first line (worker start)       {med['launch_s']:.2f} s")
    if left:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
