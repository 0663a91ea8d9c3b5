"""SLURM start latency: ``fit()`` to the first line of the training function on 2 nodes of a
SLURM allocation (``hosts="slurm"``, one agent per node started with ``srun``), against the same
through 2 SSH hosts, and against the floor: ``srun --overlap -N2 python -c 'import torch'``
(starting a job step on each node and importing torch, without ddptrain) in the same allocation.

The cluster is the tests' real SLURM test bed (``tests/slurm.py``: slurmctld and one slurmd per
node, each in its own network namespace, on this machine); the SSH hosts are the tests'
loopback sshd servers (``tests/sshd.py``). One worker per node or host.

    python benchmarks/slurm_start.py [--repeats N] [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from slurm import SlurmCluster, why_no_slurm  # noqa: E402
from sshd import SSHServers, why_no_sshd  # noqa: E402

BENCH = "slurm_start"


def first_line() -> float:
    return time.time()


def timed(hosts: object, storage: str) -> float:
    import ddptrain as train

    start = time.time()
    result = train.DataParallelTrainer(
        first_line,
        scaling_config=train.ScalingConfig(num_workers=2, hosts=hosts),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    return min(result.return_values) - start


def floor() -> float:
    start = time.time()
    subprocess.run(
        ["srun", "--overlap", "-N2", "--ntasks-per-node=1", sys.executable, "-c", "import torch"],
        check=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    return time.time() - start


def inner(repeats: int, storage: str) -> None:
    """Inside the allocation: the srun figures, as one JSON line."""
    timed("slurm", storage)  # warm-up
    times: dict[str, list[float]] = {"srun": [], "floor": []}
    for repeat in range(repeats):
        for kind in ("srun", "floor") if repeat % 2 == 0 else ("floor", "srun"):
            times[kind].append(timed("slurm", storage) if kind == "srun" else floor())
    print("INNER " + json.dumps(times), flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--inner"]:
        inner(int(sys.argv[2]), sys.argv[3])
        return
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=5, quick_repeats=2)
    reason = why_no_slurm() or why_no_sshd()
    if reason:
        raise SystemExit(reason)
    load = _bench.ForeignLoad()
    work = Path(tempfile.mkdtemp(prefix="ddptrain_bench_slurm_"))
    storage = str(work / "runs")
    times: dict[str, list[float]] = {}
    servers = SSHServers(work / "sshd", count=2)
    try:
        os.environ["DDPTRAIN_SSH_KNOWN_HOSTS"] = str(servers.known_hosts)
        os.environ["DDPTRAIN_SSH_CONFIG"] = str(servers.ssh_config)
        hosts = ["h0 slots=1", "h1 slots=1"]
        timed(hosts, storage)  # warm-up
        times["ssh"] = [timed(hosts, storage) for _ in range(args.repeats)]
    finally:
        servers.close()
    cluster = SlurmCluster(work / "slurm", nodes=2, cpus=2, tag_var=_bench.TAG_VAR)
    try:
        done = cluster.run(
            ["salloc", "-N2", "--ntasks-per-node=1", sys.executable, __file__, "--inner", str(args.repeats), storage],
            timeout_s=600,
        )
        line = [s for s in done.stdout.splitlines() if s.startswith("INNER ")]
        if done.returncode != 0 or not line:
            raise SystemExit(f"the run inside the allocation failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        times.update(json.loads(line[0][len("INNER ") :]))
    finally:
        cluster.close()
    for kind in ("srun", "ssh", "floor"):
        _bench.emit({"bench": BENCH, "metric": f"first_line_s_{kind}", "nodes": 2, **_bench.summary(times[kind])})
    srun, ssh, low = (_bench.median(times[k]) for k in ("srun", "ssh", "floor"))
    _bench.emit({"bench": BENCH, "metric": "ratio_srun_vs_ssh", "value": round(srun / ssh, 3)})
    _bench.emit({"bench": BENCH, "metric": "ratio_srun_vs_floor", "value": round(srun / low, 3)})
    _bench.emit({"bench": BENCH, "metric": "environment", **_bench.environment(), **load.result()})
    left = _bench.check_leftovers(BENCH)
    print(f"\n{BENCH}: fit() to the first line on 2 nodes, one worker each, medians of {args.repeats} runs")
    print(f"  srun (hosts='slurm')          {srun:.3f} s  ({srun / ssh:.2f}x SSH, {srun / low:.2f}x the floor)")
    print(f"  SSH hosts                     {ssh:.3f} s")
    print(f"  floor: srun -N2 import torch  {low:.3f} s")
    if left:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
