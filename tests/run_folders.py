"""Run folders as someone else may have written them, for the tests of the commands and the
dashboard that read runs."""

from __future__ import annotations

import json
from pathlib import Path


def write_run(folder: Path, run_json: object = None, metrics: list[object] | None = None) -> None:
    """``folder`` with a ``run.json`` (``run_json``: JSON data, or raw bytes; by default a
    finished run's) and, given ``metrics``, a ``metrics.jsonl`` with one line per item (a dict:
    a report's metrics; a str: the line itself)."""
    folder.mkdir(parents=True)
    if run_json is None:
        run_json = {"name": folder.name, "status": "FINISHED", "started": 1e9, "ended": 1e9 + 5}
    (folder / "run.json").write_bytes(run_json if isinstance(run_json, bytes) else json.dumps(run_json).encode())
    if metrics is not None:
        lines = [m if isinstance(m, str) else json.dumps({"time": 1e9, "attempt": 0, "metrics": m}) for m in metrics]
        (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
