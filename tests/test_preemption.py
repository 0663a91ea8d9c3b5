"""Preemption notices with real processes: a SIGTERM to a host's agent, then to the driver (run
as a script, as a spot instance's or a scheduler's notice reaches it). The workers see a
``PreemptionInfo``, their final checkpoint is committed, ``run.json`` says PREEMPTED, ``fit()``
raises ``RunPreemptedError``, and a rerun by name continues from that checkpoint.

One driver process runs the three ``fit()`` calls (preempted through its agent, resumed and
preempted through the driver, resumed to the end), as a script that catches
``RunPreemptedError`` and calls ``fit()`` again would: one interpreter and torch import, and
the local agents come from its fork server, which keeps the test short."""

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
    import contextlib, io, json, os, shutil, sys, tempfile, time
    import ddptrain as train
    from ddptrain.cli.main import main as cli

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
            if step == start + 2 and rank == 0 and config["ready"]:
                with open(config["ready"], "w") as f:
                    f.write(str(os.getppid()))  # the agent's pid
            time.sleep(0.1)

    def fit(storage, steps, ready):
        return train.DataParallelTrainer(
            loop,
            train_loop_config={"steps": steps, "ready": ready},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="spot", storage_path=storage),
        ).fit()

    if __name__ == "__main__":
        storage, out = sys.argv[1], sys.argv[2]
        run_dir = os.path.join(storage, "spot")
        for phase in (0, 1):  # the test sends SIGTERM once `ready-<phase>` exists
            try:
                fit(storage, 1000, os.path.join(out, f"ready-{phase}"))
                raise SystemExit("not preempted")
            except train.RunPreemptedError as exc:
                print(f"phase {phase}: {type(exc).__name__}: {exc}", flush=True)
                with open(os.path.join(exc.checkpoint.path, "state.json")) as f:
                    final = json.load(f)["step"]
            shown = io.StringIO()
            with contextlib.redirect_stdout(shown):
                cli(["show", run_dir])
            with open(os.path.join(out, f"show-{phase}.txt"), "w") as f:
                f.write(shown.getvalue())
            shutil.copy(os.path.join(run_dir, "run.json"), os.path.join(out, f"run-{phase}.json"))
        result = fit(storage, final + 4, "")
        print("steps", json.dumps([m["step"] for m in result.metrics_history]), flush=True)
    """
)


def _wait_for(proc: subprocess.Popen[str], path: Path, what: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, _ = proc.communicate()
            raise AssertionError(f"{what} never happened:\n{out}")
        time.sleep(0.05)
    return path.read_text()


@pytest.mark.timeout(240)
def test_sigterm_to_an_agent_then_to_the_driver_commits_final_checkpoints_and_reruns_resume(
    tmp_path: Path, storage: str
) -> None:
    script = tmp_path / "driver.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "DDPTRAIN_PREEMPTION_WINDOW_S": "20"}
    proc = subprocess.Popen(
        [sys.executable, str(script), storage, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        finals = []
        for phase, target in enumerate(("agent", "driver")):
            agent = int(_wait_for(proc, out / f"ready-{phase}", f"phase {phase}'s step 2"))
            sent = time.monotonic()
            os.kill(agent if target == "agent" else proc.pid, signal.SIGTERM)
            run = json.loads(_wait_for(proc, out / f"run-{phase}.json", f"phase {phase}'s preemption"))
            took = time.monotonic() - sent
            # Not the 20 s window, not the workers' 30 s sleep (the show command is in `took` too).
            assert took < 15, f"the run took {took:.1f} s to stop after its final checkpoint"
            assert run["status"] == "PREEMPTED"
            checkpoint = run["preempted"]["checkpoint"]
            assert checkpoint is not None and os.path.isdir(checkpoint)
            finals.append(json.loads(Path(checkpoint, "state.json").read_text())["step"])
            shown = (out / f"show-{phase}.txt").read_text()
            assert "PREEMPTED" in shown and f"preempted: SIGTERM to the {target}" in shown, shown
        out_text, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out_text
    assert out_text.count("RunPreemptedError: Run 'spot' was preempted") == 2, out_text
    run_dir = Path(storage) / "spot"
    reports = [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    notices = [r["notice"] for r in reports if "notice" in r]
    assert [n["ranks"] for n in notices] == [[0, 1], [0, 1]], notices
    assert "agent" in notices[0]["reason"] and "driver" in notices[1]["reason"], notices
    assert all(n["deadline_ms"] > time.time() * 1000 - 120_000 for n in notices)
    # Each rerun continues from the final checkpoint: every step once, none skipped, none repeated.
    steps = json.loads(out_text.split("steps", 1)[1].strip().splitlines()[0])
    assert finals[0] < finals[1] and steps == list(range(finals[1] + 4)), (steps, finals)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "FINISHED"


def test_notices_from_several_hosts_agents_make_one_notice_and_a_second_own_notice_stops_at_once() -> None:
    from ddptrain.driver import preemption

    preemption.clear()
    try:
        preemption.request_preemption("SIGUSR1 to the agent on host a", hosts=["a"])
        preemption.request_preemption("SIGUSR1 to the agent on host b", hosts=["b"])
        preemption.request_preemption("SIGTERM to the agent on host a", hosts=["a"])  # a again: nothing new
        notice = preemption.pending()
        assert notice is not None and not notice.expired()
        assert notice.hosts == ("a", "b")
        assert notice.reason == "SIGUSR1 to the agent on host a; SIGUSR1 to the agent on host b"
        preemption.request_preemption("SIGTERM to the driver (pid 1)")  # the driver's own: stop now
        assert preemption.pending().at_once  # type: ignore[union-attr]
    finally:
        preemption.clear()


def _steps_until_preempted(config: dict) -> None:
    import ddptrain as train

    for step in range(config["steps"]):
        if train.get_preemption_info() is not None:
            return  # stopped by a notice: the run is preempted, not finished
        train.report({"step": step})
        time.sleep(config["sleep_s"])


class _SigtermAtLastReport:
    """A SIGTERM reaches the driver as the last report is made: the notice comes after the
    workers' last chance to act on it, and their fit() ends as it would have."""

    def after_report(self, run_context: object, metrics: list[dict], checkpoint: object) -> None:
        if metrics[0]["step"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def after_exception(self, run_context: object, worker_exceptions: dict) -> None:
        pass


@pytest.mark.timeout(120)
def test_a_notice_pending_when_fit_ends_does_not_stop_the_next_fit(
    storage: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import ddptrain as train
    from ddptrain.callbacks import UserCallback
    from ddptrain.driver import preemption

    monkeypatch.setenv("DDPTRAIN_PREEMPTION_WINDOW_S", "30")

    class Callback(_SigtermAtLastReport, UserCallback):
        pass

    def fit(name: str, steps: int, callbacks: list) -> object:
        return train.DataParallelTrainer(
            _steps_until_preempted,
            train_loop_config={"steps": steps, "sleep_s": 0.05},
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(name=name, storage_path=storage, callbacks=callbacks),
        ).fit()

    preemption.clear()
    try:
        try:
            fit("first", 2, [Callback()])
            # The notice came too late for it: the user is told it was dropped.
            assert "came as run 'first' ended; it was not acted on" in caplog.text, caplog.text
        except train.RunPreemptedError:
            pass  # the notice was acted on in the fit that got it: that is fine too
        # The next fit() in this process is a new run: nobody preempted it.
        result = fit("second", 8, [])
        assert [m["step"] for m in result.metrics_history] == list(range(8))  # type: ignore[attr-defined]
        status = json.loads((Path(storage) / "second" / "run.json").read_text())["status"]
        assert status == "FINISHED", status
    finally:
        preemption.clear()
