"""A process group's id is its leader's pid: the launchers must not reap a leader before they
signal its group for the last time, or the pid (and a ``killpg`` on it) could belong to a
stranger by then (``ddptrain.launch.reaping``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from ddptrain.launch.reaping import exit_status, exited, wait_exited


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_an_ended_leader_is_seen_without_being_reaped_so_its_group_id_stays_ours() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    assert wait_exited(proc, 30)
    assert exited(proc) and proc.returncode is None
    assert _state(proc.pid) == "Z"  # still holds its pid: no new process can lead a group by that id
    assert exit_status(proc, 0) == 3 and _state(proc.pid) == "Z"
    assert proc.wait(5) == 3 and _state(proc.pid) is None


def test_a_signal_death_reads_as_popen_gives_it_and_a_live_process_is_not_ended() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert not exited(proc) and exit_status(proc, 0.1) is None
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert exit_status(proc, 30) == -signal.SIGTERM
        assert time.monotonic() - started < 30
    finally:
        proc.kill()
        proc.wait()


def test_a_validation_process_that_ended_is_not_reaped_before_its_group_is_killed(tmp_path: Path) -> None:
    from ddptrain.driver.validation import _LocalProcess

    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    log = tmp_path / "log"
    process = _LocalProcess(proc, str(tmp_path / "folder"), open(log, "ab"), str(log))  # noqa: SIM115
    deadline = time.monotonic() + 30
    while not process.ended():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert _state(proc.pid) == "Z"  # ended() looked; outcome() kills the group, then reaps
    result, why = process.outcome()
    assert result is None and "exited with code 0" in why and _state(proc.pid) is None


def test_a_plain_agent_that_exited_is_reaped_only_after_its_session_is_killed(monkeypatch) -> None:
    import os

    from ddptrain.launch.launcher import LocalConnection

    monkeypatch.setenv("DDPTRAIN_AGENT_FORKSERVER", "0")  # a plain process, not a forked agent
    connection = LocalConnection(dict(os.environ))
    connection.open()
    pid = connection._proc.pid
    try:
        assert connection.stdin is not None
        connection.stdin.close()  # the driver is gone: the agent ends
        connection.stdin = None
        deadline = time.monotonic() + 60
        while connection.probe():
            assert time.monotonic() < deadline, "the agent did not end without its driver"
            time.sleep(0.05)
        assert connection.exit_code() is not None and _state(pid) == "Z"  # seen, not reaped
    finally:
        connection.close(0)
    assert _state(pid) is None


def test_a_closed_plain_agent_is_never_signalled_again(monkeypatch) -> None:
    """Once ``close`` reaped the agent, its pid may be a new process's: a second ``close`` or an
    ``abort`` sends nothing to that group."""
    import os

    from ddptrain.launch.launcher import LocalConnection

    monkeypatch.setenv("DDPTRAIN_AGENT_FORKSERVER", "0")
    connection = LocalConnection(dict(os.environ))
    connection.open()
    pid = connection._proc.pid
    assert connection.stdin is not None
    connection.stdin.close()  # the driver is gone: the agent ends
    connection.stdin = None
    connection.close(30)
    assert _state(pid) is None  # reaped
    signalled: list[int] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: signalled.append(pgid))  # recorded, never sent
    connection.abort()
    connection.close(0)
    assert pid not in signalled
