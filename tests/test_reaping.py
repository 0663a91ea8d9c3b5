"""A process group's id is its leader's pid: the launchers must not reap a leader before they
signal its group for the last time, or the pid (and a ``killpg`` on it) could belong to a
stranger by then (``ddptrain.launch.reaping``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


_TRACER = """
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
seized = libc.ptrace(0x4206, int(sys.argv[1]), None, None)  # PTRACE_SEIZE: it runs on, traced
print("seized" if seized == 0 else f"errno {ctypes.get_errno()}", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # a debugger that was stopped (Ctrl-Z) with its tracee
"""


def _stopped_debugger(pid: int) -> subprocess.Popen[str]:
    """A process that traces ``pid`` and is stopped: once ``pid`` ends it stays a zombie that
    its parent cannot reap until the tracer lets it go (ends, or waits for it)."""
    import pytest

    tracer = subprocess.Popen(
        [sys.executable, "-c", _TRACER, str(pid)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert tracer.stdout is not None
    said = tracer.stdout.readline().strip()
    if said != "seized":
        tracer.kill()
        tracer.wait()
        pytest.skip(f"ptrace is not allowed here ({said})")
    return tracer


@pytest.mark.slow  # waits out the 5 s bound on reaping
def test_a_validation_process_a_stopped_debugger_holds_does_not_hang_the_driver(tmp_path: Path, caplog) -> None:
    # Its SIGKILL could not let the driver reap it, and outcome() waited for good: fit() hung.
    from ddptrain.driver.validation import _LocalProcess

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    tracer = _stopped_debugger(proc.pid)
    log = tmp_path / "log"
    (tmp_path / "folder").mkdir()
    process = _LocalProcess(proc, str(tmp_path / "folder"), open(log, "ab"), str(log))  # noqa: SIM115
    try:
        started = time.monotonic()
        process.kill(0.2)
        result, why = process.outcome()
        assert time.monotonic() - started < 20
        assert result is None and f"(pid {proc.pid}) did not end when killed" in why, why
        warning = caplog.text
        assert f"the validation process (pid {proc.pid}) was not reaped within 5 s of its SIGKILL" in warning
        assert f"traced by pid {tracer.pid}" in warning and f"kill -CONT {tracer.pid}" in warning, warning
    finally:
        tracer.kill()
        tracer.wait()
        proc.wait(30)  # let go: reaped now


@pytest.mark.slow  # waits out the 5 s bound on reaping
@pytest.mark.parametrize("forkserver", ["0", "1"])
def test_an_agent_a_stopped_debugger_holds_does_not_hang_close(forkserver: str, monkeypatch, caplog) -> None:
    import os

    from ddptrain.launch.launcher import LocalConnection

    monkeypatch.setenv("DDPTRAIN_AGENT_FORKSERVER", forkserver)
    connection = LocalConnection(dict(os.environ))
    connection.open()
    pid = connection._proc.pid
    assert pid is not None
    tracer = _stopped_debugger(pid)
    try:
        started = time.monotonic()
        connection.close(0.2)
        assert time.monotonic() - started < 20
        assert f"the ddptrain agent (pid {pid}) was not reaped within 5 s of its SIGKILL" in caplog.text
        assert f"traced by pid {tracer.pid}" in caplog.text
    finally:
        tracer.kill()
        tracer.wait()
    deadline = time.monotonic() + 30
    while _state(pid) is not None and time.monotonic() < deadline:  # reaped once let go
        if forkserver == "0":
            connection._proc.poll()
        time.sleep(0.05)
    assert _state(pid) is None
