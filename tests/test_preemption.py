"""Preemption notices with real processes: a SIGTERM to the driver (run as a script, as a spot
instance's or a scheduler's notice reaches it) or to a host's agent. The workers see a
``PreemptionInfo``, their final checkpoint is committed, ``run.json`` says PREEMPTED, ``fit()``
raises ``RunPreemptedError``, and a rerun by name continues from that checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, tempfile, time
    import ddptrain as train

    def loop(config):
        ctx = train.get_context()
        rank = ctx.get_world_rank()
        start = 0
        checkpoint = train.get_checkpoint()
        if checkpoint is not None:
            with open(os.path.join(checkpoint.path, "state.json")) as f:
                start = json.load(f)["step"] + 1
        for step in range(start, config["steps"]):
            info = train.get_preemption_info()
            if info is None:
                train.report({"step": step})
            else:  # the final checkpoint: every rank reports, rank 0 with the files
                with tempfile.TemporaryDirectory() as folder:
                    with open(os.path.join(folder, "state.json"), "w") as f:
                        json.dump({"step": step}, f)
                    seen = {"ranks": info.preempted_ranks, "reason": info.reason, "deadline_ms": info.deadline_ms}
                    saved = train.Checkpoint.from_directory(folder) if rank == 0 else None
                    train.report({"step": step, "notice": seen}, checkpoint=saved)
                if rank == 0:  # the driver stops the group once the checkpoint is committed
                    time.sleep(30)
                # The other ranks go on: one that got the notice a step before rank 0 reaches the
                # round of rank 0's checkpoint all the same (a sleep here could hold it back).
            if step == 2 and rank == 0:
                with open(config["ready"], "w") as f:
                    f.write(str(os.getppid()))  # the agent's pid
            time.sleep(0.1)

    if __name__ == "__main__":
        storage, steps, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        result = train.DataParallelTrainer(
            loop,
            train_loop_config={"steps": steps, "ready": ready},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="spot", storage_path=storage),
        ).fit()
        print("steps", [m["step"] for m in result.metrics_history], flush=True)
    """
)


def _start(tmp_path: Path, storage: str, steps: int) -> tuple[subprocess.Popen[str], Path]:
    script = tmp_path / "driver.py"
    script.write_text(SCRIPT)
    ready = tmp_path / "ready"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "DDPTRAIN_PREEMPTION_WINDOW_S": "20"}
    proc = subprocess.Popen(
        [sys.executable, str(script), storage, str(steps), str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    return proc, ready


def _wait_ready(proc: subprocess.Popen[str], ready: Path, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not ready.exists() or not ready.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, _ = proc.communicate()
            raise AssertionError(f"the run never reached step 2:\n{out}")
        time.sleep(0.05)
    return int(ready.read_text())


def _preempted_then_resumed(tmp_path: Path, storage: str, send_sigterm: str) -> None:
    proc, ready = _start(tmp_path, storage, steps=1000)
    agent = _wait_ready(proc, ready)
    sent = time.monotonic()
    os.kill(proc.pid if send_sigterm == "driver" else agent, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode != 0, out
    assert "RunPreemptedError: Run 'spot' was preempted" in out, out
    assert took < 15, f"the run took {took:.1f} s to stop after its final checkpoint"  # not the 20 s window, not 30 s
    run_dir = Path(storage) / "spot"
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "PREEMPTED"
    checkpoint = run["preempted"]["checkpoint"]
    assert checkpoint is not None and os.path.isdir(checkpoint)
    final = json.loads(Path(checkpoint, "state.json").read_text())["step"]
    reports = [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    notice = next(r["notice"] for r in reports if "notice" in r)
    assert notice["ranks"] == [0, 1] and notice["deadline_ms"] > time.time() * 1000 - 60_000
    assert ("driver" if send_sigterm == "driver" else "agent") in notice["reason"]

    shown = subprocess.run(
        [sys.executable, "-m", "ddptrain", "show", str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert "PREEMPTED" in shown.stdout and "preempted: SIGTERM" in shown.stdout, shown.stdout + shown.stderr

    # A rerun by name continues from the final checkpoint: the step after it comes next.
    proc, ready = _start(tmp_path, storage, steps=final + 4)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    steps = json.loads(out.split("steps", 1)[1].strip().splitlines()[0])
    resumed = steps[len(reports) :]
    assert resumed == list(range(final + 1, final + 4)), (steps, final)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "FINISHED"


@pytest.mark.timeout(240)
def test_sigterm_to_the_driver_commits_a_final_checkpoint_and_a_rerun_resumes_from_it(
    tmp_path: Path, storage: str
) -> None:
    _preempted_then_resumed(tmp_path, storage, "driver")


@pytest.mark.timeout(240)
def test_sigterm_to_a_hosts_agent_is_a_preemption_notice_too(tmp_path: Path, storage: str) -> None:
    _preempted_then_resumed(tmp_path, storage, "agent")
