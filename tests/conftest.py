"""Test hygiene: restore the environment, reset worker-global state, and fail any test that
leaves a process of ours behind (found by a tag in the environment every child inherits)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

TAG_VAR = "DDPTRAIN_TEST_TAG"
os.environ[TAG_VAR] = uuid.uuid4().hex
# Quick teardown in tests: a killed group need not wait long for SIGTERM.
os.environ.setdefault("DDPTRAIN_SHUTDOWN_GRACE_S", "2")


def tagged_processes() -> list[int]:
    """Pids of live processes (other than this one) started under this test session."""
    marker = f"{TAG_VAR}={os.environ[TAG_VAR]}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                status = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if status != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5.0
    left = tagged_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = tagged_processes()
    if left:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"the test left processes behind: {left}")


@pytest.fixture(autouse=True)
def _restore_state() -> Iterator[None]:
    env = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(env)
    from ddptrain import context

    context._set_session(None)


@pytest.fixture
def storage(tmp_path: Path) -> str:
    """A storage_path for one test."""
    return str(tmp_path / "runs")
