"""``Trial``: one config of a sweep, its state and its reports (driver side)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.storage.layout import to_jsonable

__all__ = ["Trial", "RESULT_FILE", "PARAMS_FILE"]

RESULT_FILE = "result.json"  # one line per report, with the sweep's own fields (as Ray's)
PARAMS_FILE = "params.json"


def _latest_checkpoint_dir(path: str) -> str | None:
    """The highest-numbered ``checkpoint_<n>`` folder of a trial (written whole, then renamed)."""
    try:
        names = [n for n in os.listdir(path) if n.startswith("checkpoint_") and n.removeprefix("checkpoint_").isdigit()]
    except OSError:
        return None
    if not names:
        return None
    return os.path.join(path, max(names, key=lambda n: int(n.removeprefix("checkpoint_"))))


@dataclass
class Trial:
    """One trial of a sweep.

    Attributes:
        trial_id: Unique id, ``<sweep id>_<index>``.
        config: The trial's resolved config.
        path: The trial's folder under the sweep's folder (also its run directory when the
            trainable is a trainer).
        status: ``"PENDING"``, ``"RUNNING"``, ``"TERMINATED"`` or ``"ERROR"``, as in Ray.
        stopped_early: A scheduler or the ``stop=`` criteria ended it before it finished.
        last_result: Its last report, with the sweep's fields (``training_iteration``...).
        error: The exception it failed with (``status == "ERROR"``).
        error_msg: That error as text (kept across a restore).
        checkpoint: Its latest checkpoint.
    """

    trial_id: str
    config: dict[str, Any]
    path: str
    status: str = "PENDING"
    stopped_early: bool = False
    stop_reason: str | None = None
    last_result: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    error_msg: str | None = None
    checkpoint: Checkpoint | None = None
    iteration: int = 0
    start_time: float | None = None
    end_time: float | None = None
    return_value: Any = None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    num_failures: int = 0

    @property
    def local_path(self) -> str:
        """The trial's folder (Ray's name)."""
        return self.path

    @property
    def logdir(self) -> str:
        """The trial's folder (Ray's older name)."""
        return self.path

    @property
    def trial_name(self) -> str:
        return os.path.basename(self.path)

    @property
    def display_status(self) -> str:
        """The state shown in the status table: ``STOPPED`` for a trial ended early."""
        return "STOPPED" if self.status == "TERMINATED" and self.stopped_early else self.status

    def __str__(self) -> str:
        return self.trial_name

    # ----------------------------------------------------------------- on disk
    def write_params(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, PARAMS_FILE), "w") as f:
            json.dump(to_jsonable(self.config), f, indent=2)

    def append_result(self, result: dict[str, Any]) -> None:
        with open(os.path.join(self.path, RESULT_FILE), "a") as f:
            f.write(json.dumps(to_jsonable(result)) + "\n")

    def read_results(self) -> list[dict[str, Any]]:
        """Every report of this trial (``result.json``), oldest first; a cut line is skipped."""
        results = []
        try:
            with open(os.path.join(self.path, RESULT_FILE)) as f:
                for line in f:
                    try:
                        results.append(json.loads(line))
                    except ValueError:
                        continue
        except FileNotFoundError:
            pass
        return results

    def truncate_results(self, iteration: int) -> None:
        """Drop the reports after ``iteration`` (a trial resumed from an earlier checkpoint)."""
        kept = [r for r in self.read_results() if int(r.get("training_iteration", 0)) <= iteration]
        with open(os.path.join(self.path, RESULT_FILE), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self.last_result = kept[-1] if kept else {}

    def state(self) -> dict[str, Any]:
        """What the sweep's state file keeps of this trial (restore rebuilds the rest)."""
        return {
            "trial_id": self.trial_id,
            "config": self.config,
            "path": self.path,
            "status": self.status,
            "stopped_early": self.stopped_early,
            "stop_reason": self.stop_reason,
            "last_result": self.last_result,
            "error_msg": self.error_msg,
            "iteration": self.iteration,
            "checkpoint": self.checkpoint.path if self.checkpoint is not None else None,
            "num_failures": self.num_failures,
            "start_time": self.start_time,
            "end_time": self.end_time,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Trial:
        checkpoint = state.get("checkpoint")
        trial = cls(
            trial_id=state["trial_id"],
            config=state["config"],
            path=state["path"],
            status=state["status"],
            stopped_early=state.get("stopped_early", False),
            stop_reason=state.get("stop_reason"),
            last_result=state.get("last_result") or {},
            error_msg=state.get("error_msg"),
            iteration=state.get("iteration", 0),
            num_failures=state.get("num_failures", 0),
            start_time=state.get("start_time"),
            end_time=state.get("end_time"),
        )
        latest = _latest_checkpoint_dir(trial.path)  # newer than the state file when killed right after it
        if latest is not None:
            checkpoint = latest
        if checkpoint and os.path.isdir(checkpoint):
            trial.checkpoint = Checkpoint.from_directory(checkpoint)
        return trial
