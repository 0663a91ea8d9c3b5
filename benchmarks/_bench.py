"""Shared helpers of the benchmark scripts (driver side only): arguments, statistics, JSON
output, and the check that a script leaves no process of its own behind.

Every process a benchmark starts inherits ``DDPTRAIN_BENCH_TAG`` in its environment, so the
leftover check finds exactly the processes this run started (the ddptrain agent, its forked
workers, spawned processes) and nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TAG_VAR = "DDPTRAIN_BENCH_TAG"
os.environ.setdefault(TAG_VAR, uuid.uuid4().hex)


def parse_args(
    description: str,
    default_repeats: int,
    quick_repeats: int,
    extra: Sequence[tuple[str, str]] = (),
    numbers: Sequence[tuple[str, float, str]] = (),
) -> argparse.Namespace:
    """The common options, plus ``extra`` switches given as (flag, help) and ``numbers`` given
    as (flag, default, help)."""
    parser = argparse.ArgumentParser(description=description)
    for flag, text in extra:
        parser.add_argument(flag, action="store_true", help=text)
    for flag, default, text in numbers:
        parser.add_argument(flag, type=float, default=default, help=f"{text} (default {default:g})")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"measured repeats (default {default_repeats}; {quick_repeats} with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="small, fast run (smoke test)")
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = quick_repeats if args.quick else default_repeats
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def emit(record: dict[str, Any]) -> None:
    """One JSON line on stdout."""
    print(json.dumps(record, sort_keys=False), flush=True)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def summary(values: Sequence[float]) -> dict[str, Any]:
    return {
        "median": median(values),
        "min": float(min(values)),
        "max": float(max(values)),
        "n": len(values),
    }


def _source_digest() -> str:
    """Short digest of the ddptrain sources measured (the package may change between runs)."""
    import hashlib

    import ddptrain

    digest = hashlib.sha256()
    root = Path(ddptrain.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def environment() -> dict[str, Any]:
    import torch

    import ddptrain

    return {
        "ddptrain": ddptrain.__version__,
        "ddptrain_src_sha256": _source_digest(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _cpu_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat. Steal is
    time the hypervisor gave this VM's CPUs to someone else."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    steal = fields[7] if len(fields) > 7 else 0
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - idle - steal) / hz, steal / hz


def _own_cpu_s() -> float:
    """CPU seconds of this process and its reaped descendants (the agent, workers, spawned
    processes: each is waited for by its parent, so their time rolls up to here), and of this
    process's agent fork servers with theirs (they live on, so their time never rolls up)."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    servers = sys.modules.get("ddptrain.launch.forkserver")
    for pid in servers.server_pids() if servers is not None else ():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    return total


class ForeignLoad:
    """How much CPU other processes on the machine used while the benchmark ran.

    Other work on a 2-core machine skews every figure here; this puts a number on it.
    """

    def __init__(self) -> None:
        self._wall = time.monotonic()
        self._busy, self._steal = _cpu_s()
        self._own = _own_cpu_s()

    def result(self) -> dict[str, float]:
        wall = time.monotonic() - self._wall
        busy, steal = _cpu_s()
        foreign = max(0.0, (busy - self._busy) - (_own_cpu_s() - self._own))
        steal -= self._steal
        return {
            "wall_s": round(wall, 2),
            "foreign_cpu_s": round(foreign, 2),
            # Average number of cores other processes kept busy.
            "foreign_cores": round(foreign / wall, 3) if wall > 0 else 0.0,
            # Average number of cores the hypervisor took away.
            "steal_cores": round(steal / wall, 3) if wall > 0 else 0.0,
        }


def tagged_processes() -> list[int]:
    """Live (non-zombie) processes other than this one that carry this run's tag (this
    process's agent fork servers excepted: they live as long as it does, on purpose)."""
    marker = f"{TAG_VAR}={os.environ[TAG_VAR]}".encode()
    servers: set[int] = set()
    if "ddptrain.launch.forkserver" in sys.modules:
        servers = set(sys.modules["ddptrain.launch.forkserver"].server_pids())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), *servers):
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def check_leftovers(bench: str, wait_s: float = 5.0) -> list[int]:
    """Report (and kill) processes this benchmark started that are still alive."""
    deadline = time.monotonic() + wait_s
    left = tagged_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = tagged_processes()
    commands = {pid: _cmdline(pid) for pid in left}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    emit({"bench": bench, "metric": "leftover_processes", "value": len(left), "pids": left, "commands": commands})
    if left:
        print(
            f"WARNING: {len(left)} process(es) of this benchmark were still alive and were killed: {left}",
            file=sys.stderr,
        )
    return left
