"""Another Unix user of the machine, for the tests of what ddptrain exposes to one.

The test process is the victim (the user who runs ddptrain); :class:`OtherUser` is a real,
unprivileged second account that runs small Python programs of the attacker's: plants files,
reads files, holds locks. Creating an account needs root and ``useradd``: without them the
fixture skips the test, naming why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["OtherUser", "other_user", "shared_folder"]

# Interpreters the other user may be able to run (the test's own may sit under root's home).
_PYTHONS = (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3")


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to add a second Unix user"
    if not (shutil.which("useradd") and shutil.which("userdel")):
        return "needs useradd and userdel"
    return None


class OtherUser:
    """A second Unix account (``name``, ``uid``) and a Python it can run (``python``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.uid = int(subprocess.run(["id", "-u", name], capture_output=True, text=True, check=True).stdout)
        self.python = next((p for p in _PYTHONS if self._can_run(p)), None)

    def _can_run(self, python: str) -> bool:
        try:
            done = subprocess.run([python, "-I", "-c", "pass"], user=self.name, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    def _command(self, code: str, args: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
        if self.python is None:
            pytest.skip(f"user {self.name} can run none of {_PYTHONS}")
        env = {"PATH": "/usr/bin:/bin", "DDPTRAIN_TEST_TAG": os.environ.get("DDPTRAIN_TEST_TAG", "")}
        return [self.python, "-I", "-c", textwrap.dedent(code), *args], env

    def run(self, code: str, *args: str, timeout_s: float = 60) -> str:
        """Run ``code`` (``python -I -c``) as this user in ``/``; its stdout. Fails the test if it fails."""
        command, env = self._command(code, args)
        done = subprocess.run(
            command, user=self.name, group=self.name, extra_groups=[], env=env, cwd="/",
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        assert done.returncode == 0, f"{self.name}'s program failed:\n{done.stderr}"
        return done.stdout

    def start(self, code: str, *args: str) -> subprocess.Popen[str]:
        """Start ``code`` as this user, its stdout a pipe (the caller ends it)."""
        command, env = self._command(code, args)
        return subprocess.Popen(
            command, user=self.name, group=self.name, extra_groups=[], env=env, cwd="/",
            stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True,
        )  # fmt: skip


@pytest.fixture(scope="session")
def other_user() -> Iterator[OtherUser]:
    """A second Unix user for the whole session (removed at its end)."""
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    name = f"ddpt{uuid.uuid4().hex[:10]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield OtherUser(name)
    finally:
        subprocess.run(["userdel", name], check=False)


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder in /tmp that every user may write (mode 1777, like /tmp itself or a team's
    scratch folder), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="ddptrain-test-shared-"))
    folder.chmod(0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
