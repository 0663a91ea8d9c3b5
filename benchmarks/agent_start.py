"""A ``fit()`` whose agent is forked from the agent fork server against one whose agent is
started as a new process (``DDPTRAIN_AGENT_FORKSERVER=0``: a new interpreter importing torch).

In one process, per repeat, in alternating order: a 2-worker ``fit()`` of a function that
records ``time.time()`` on its first line, with the fork server and without. The server is
started by an unmeasured warm-up fit (as the first ``fit()`` of a driver starts it).

* ``first_line_s``: ``fit()`` to the earliest rank's first line;
* ``fit_s``: the whole ``fit()`` call.

Headline ratio: median(fit_s with the server) / median(fit_s without).

    python benchmarks/agent_start.py [--repeats N] [--quick]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import _bench

BENCH = "agent_start"


def first_line() -> float:
    t = time.time()  # the training function's first line
    return t


def timed_fit(storage: str, name: str, server: bool) -> tuple[float, float]:
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    os.environ["DDPTRAIN_AGENT_FORKSERVER"] = "1" if server else "0"
    trainer = TorchTrainer(
        first_line,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage, name=name),
    )
    before = time.time()
    stamps = trainer.fit().return_values
    return min(stamps) - before, time.time() - before


def main() -> int:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=7, quick_repeats=2)
    _bench.emit({"bench": BENCH, "metric": "environment", **_bench.environment(), "repeats": args.repeats})
    storage = tempfile.mkdtemp(prefix="ddptrain-bench-agent-start-")
    results: dict[bool, dict[str, list[float]]] = {s: {"first_line_s": [], "fit_s": []} for s in (True, False)}
    runs = 0
    try:
        timed_fit(storage, "warmup", server=True)  # starts the server; page cache
        for repeat in range(args.repeats):
            for server in (True, False) if repeat % 2 == 0 else (False, True):
                runs += 1
                first, whole = timed_fit(storage, f"run{runs}", server)
                results[server]["first_line_s"].append(first)
                results[server]["fit_s"].append(whole)
                for metric, value in (("first_line_s", first), ("fit_s", whole)):
                    _bench.emit({"bench": BENCH, "metric": metric, "server": server, "repeat": repeat, "value": value})
    finally:
        os.environ.pop("DDPTRAIN_AGENT_FORKSERVER", None)
        shutil.rmtree(storage, ignore_errors=True)
        left = _bench.check_leftovers(BENCH)
    ratio = _bench.median(results[True]["fit_s"]) / _bench.median(results[False]["fit_s"])
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "summary",
            **{
                f"{metric}_{'server' if server else 'process'}": _bench.summary(values)
                for server, metrics in results.items()
                for metric, values in metrics.items()
            },
            "ratio_fit_server_over_process": ratio,
            "leftover_processes": len(left),
        }
    )
    med = {s: {m: _bench.median(v) for m, v in results[s].items()} for s in results}
    print(
        f"agent_start: 2-worker fit(), agent forked from the server: first line {med[True]['first_line_s']:.3f} s, "
        f"fit {med[True]['fit_s']:.3f} s; agent as a new process: first line {med[False]['first_line_s']:.3f} s, "
        f"fit {med[False]['fit_s']:.3f} s ({ratio:.3f}x); leftover processes: {len(left)}"
    )
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
