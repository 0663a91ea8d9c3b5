"""SSH launch latency: ``fit()`` to the first line of the training function for 1, 2 and 4
hosts (loopback sshd servers, one worker per host), next to a local launch of the same number
of workers in the same script. Target: SSH <= 1.3x local.

The hosts are real OpenSSH servers on 127.0.0.2.. started by this script (as the tests do),
so the figure includes connecting, authenticating and starting one agent per host; it does
not include a real network's latency.

    python benchmarks/ssh_launch.py [--repeats N] [--quick]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import _bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sshd import SSHServers, why_no_sshd  # noqa: E402

BENCH = "ssh_launch"


def first_line() -> float:
    return time.time()


def timed(num_workers: int, hosts: list[str] | None, storage: str) -> float:
    import ddptrain as train

    start = time.time()
    result = train.DataParallelTrainer(
        first_line,
        scaling_config=train.ScalingConfig(num_workers=num_workers, hosts=hosts),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    return min(result.return_values) - start


def main() -> None:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=5, quick_repeats=2)
    reason = why_no_sshd()
    if reason:
        raise SystemExit(reason)
    load = _bench.ForeignLoad()
    work = Path(tempfile.mkdtemp(prefix="ddptrain_bench_ssh_"))
    servers = SSHServers(work / "sshd", count=4)
    os.environ["DDPTRAIN_SSH_KNOWN_HOSTS"] = str(servers.known_hosts)
    os.environ["DDPTRAIN_SSH_CONFIG"] = str(servers.ssh_config)
    storage = str(work / "runs")
    counts = (1, 2) if args.quick else (1, 2, 4)
    times: dict[str, list[float]] = {}
    try:
        timed(1, ["h0"], storage)  # warm-up
        for repeat in range(args.repeats):
            for n in counts:
                order = ["local", "ssh"] if repeat % 2 == 0 else ["ssh", "local"]
                for kind in order:
                    hosts = [f"h{i} slots=1" for i in range(n)] if kind == "ssh" else None
                    times.setdefault(f"{kind}_{n}", []).append(timed(n, hosts, storage))
    finally:
        servers.close()
    lines = []
    for n in counts:
        local, ssh = _bench.median(times[f"local_{n}"]), _bench.median(times[f"ssh_{n}"])
        for kind in ("local", "ssh"):
            _bench.emit(
                {"bench": BENCH, "metric": f"first_line_s_{kind}", "hosts": n, **_bench.summary(times[f"{kind}_{n}"])}
            )
        _bench.emit({"bench": BENCH, "metric": "ratio_ssh_vs_local", "hosts": n, "value": round(ssh / local, 3)})
        lines.append(f"  {n} host(s): ssh {ssh:.3f} s, local {local:.3f} s -> {ssh / local:.2f}x (target <= 1.3x)")
    _bench.emit({"bench": BENCH, "metric": "environment", **_bench.environment(), **load.result()})
    left = _bench.check_leftovers(BENCH)
    print(f"\n{BENCH}: fit() to the first line, one worker per host, medians of {args.repeats} runs")
    print("\n".join(lines))
    if left:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
