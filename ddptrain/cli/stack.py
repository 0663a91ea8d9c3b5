"""``ddptrain stack RUN``: every rank's Python stack and process state of a live run.

It asks the run's driver through a request file in the run folder; the driver's watchdog
(``ddptrain.driver.watchdog``) has the agents signal the workers, whose stacks arrive in their
logs, and writes the process states back.
"""

from __future__ import annotations

import json
import os
import sys
import time

from ddptrain.storage import layout as storage
from ddptrain.storage.layout import RunLayout
from ddptrain.storage.lock import driver_is_alive
from ddptrain.storage.read import RunNotFound, find_run

__all__ = ["stack_command"]


def stack_command(run: str, timeout_s: float = 10.0) -> int:
    """``ddptrain stack RUN``: print every rank's Python stack and process state of a live run."""
    try:
        run_dir = find_run(run)
    except RunNotFound as exc:
        print(f"ddptrain stack: {exc}", file=sys.stderr)
        return 2
    if not driver_is_alive(run_dir):
        print(f"ddptrain stack: no live driver holds {run_dir} (the run is not running)", file=sys.stderr)
        return 1
    layout = RunLayout(run_dir)
    attempts = layout.attempts()
    logs = layout.rank_logs(attempts[-1]) if attempts else {}
    sizes = {log: log.stat().st_size for log in logs.values()}
    states_file = layout.stack_states
    states_file.unlink(missing_ok=True)
    storage.write_json_atomic(layout.stack_request, {"pid": os.getpid()}, private=True)
    deadline = time.monotonic() + timeout_s
    while not states_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not states_file.exists():
        layout.stack_request.unlink(missing_ok=True)
        print(f"ddptrain stack: the driver of {run_dir} did not answer within {timeout_s:.0f} s", file=sys.stderr)
        return 1
    # Stacks arrive through the workers' output: wait until the logs stop growing.
    settled_at, last = time.monotonic(), dict(sizes)
    while time.monotonic() - settled_at < 1.0 and time.monotonic() < deadline + 5:
        time.sleep(0.2)
        now = {log: log.stat().st_size for log in logs.values()}
        if now != last:
            last, settled_at = now, time.monotonic()
    states = json.loads(states_file.read_text())
    states_file.unlink(missing_ok=True)
    for rank, log in logs.items():
        state = states.get(str(rank))
        print(f"=== {state['where'] if state else f'rank {rank}'}: {state['described'] if state else 'not running'}")
        with open(log, "rb") as f:
            f.seek(sizes[log])
            print(f.read().decode("utf-8", errors="replace").rstrip() or "(no stack: the process cannot run)")
    return 0
