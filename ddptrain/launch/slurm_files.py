"""Checkpoint files of a SLURM node that does not see the run directory (driver side).

SSH hosts copy through SFTP (``ssh_files``); SLURM nodes have no SSH, so each copy is a job step
of its own: a tar stream over the step's stdout (node to driver) or stdin (driver to node).
Both ends accept regular files and folders with plain relative names only, so a node cannot
write outside the folder the driver copies into (nor the driver outside the node's). The node's
folder is deleted only after the copy is whole on this machine.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import threading
from collections.abc import Callable
from typing import IO

from ddptrain import _env
from ddptrain.errors import LaunchError
from ddptrain.launch.host_scripts import one_line

__all__ = ["NodeFiles"]

# Writes the tar stream of a folder's contents to stdout.
_TAR_OUT = r"""
import os, sys, tarfile
src = sys.argv[1]
with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
    for name in sorted(os.listdir(src)):
        tar.add(os.path.join(src, name), arcname=name)
"""

# Reads a tar stream from stdin into a folder: regular files and folders with plain names only.
_TAR_IN = r"""
import os, sys, tarfile
dest = sys.argv[1]
os.makedirs(dest, exist_ok=True)
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
    for m in tar:
        parts = m.name.split("/")
        if m.name.startswith("/") or ".." in parts or "" in parts or not (m.isfile() or m.isdir()):
            sys.exit("refused %r" % m.name)
        if hasattr(tarfile, "data_filter"):
            tar.extract(m, dest, filter="data")
        else:
            tar.extract(m, dest)
"""

_REMOVE = "import shutil, sys; shutil.rmtree(sys.argv[1], ignore_errors=True)"


def _plain(name: str) -> bool:
    parts = name.split("/")
    return not name.startswith("/") and ".." not in parts and "" not in parts and "\0" not in name


def _files_command(node: str, program: list[str]) -> list[str]:
    """A one-task step on ``node`` whose stdin and stdout are plain pipes (no ``--unbuffered``:
    that gives the task a terminal, which would rewrite bytes)."""
    return [
        "srun",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--kill-on-bad-exit=1",
        "--input=all",
        "--job-name=ddptrain-files",
        *program,
    ]


class NodeFiles:
    """Copies between this machine and one node's folders, each copy a job step.

    Args:
        node: The node's name.
        python: Python executable on the node.
    """

    def __init__(self, node: str, python: str) -> None:
        self._node = node
        self._python = python

    def _program(self, code: str, *args: str) -> list[str]:
        return _files_command(self._node, [self._python, "-I", "-S", "-c", one_line(code), *args])

    def _bound_s(self) -> float:
        # A copy without progress for this long is a node that stopped answering.
        return max(_env.storage_timeout_s(), 60.0)

    def _failed(self, what: str, proc: subprocess.Popen[bytes], err: bytes) -> LaunchError:
        tail = err.decode(errors="replace").strip()[-500:]
        return LaunchError(
            f"node {self._node!r}: {what} failed (srun exit status {proc.returncode}){': ' + tail if tail else ''}",
            hosts=[self._node],
        )

    def fetch_dir(self, remote: str, local: str) -> None:
        """Copy the folder ``remote`` of the node to ``local``, then delete it on the node.

        Raises:
            LaunchError: The copy failed, or the node sent a name that is not a plain relative
                file or folder name (it names the node).
        """
        os.makedirs(local, exist_ok=True)
        proc = subprocess.Popen(
            self._program(_TAR_OUT, remote),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        err = _drain(proc.stderr)
        watchdog = threading.Timer(self._bound_s(), proc.kill)  # a stalled stream ends here
        watchdog.start()
        try:
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                for member in tar:
                    if not _plain(member.name) or not (member.isfile() or member.isdir()):
                        proc.kill()
                        raise LaunchError(
                            f"node {self._node!r} sent {member.name!r} from {remote}, which is not a plain file "
                            "or folder name: nothing was copied past it.",
                            hosts=[self._node],
                        )
                    if hasattr(tarfile, "data_filter"):
                        tar.extract(member, local, filter="data")
                    else:  # pragma: no cover (Python < 3.10.12)
                        tar.extract(member, local)
        except tarfile.TarError:
            proc.wait()
            raise self._failed(f"copying {remote} back to this machine", proc, err()) from None
        finally:
            watchdog.cancel()
        if proc.wait() != 0:
            raise self._failed(f"copying {remote} back to this machine", proc, err())
        self.remove(remote)

    def push_dir(self, local: str, remote: str) -> None:
        """Copy the folder ``local`` of this machine to ``remote`` on the node.

        Raises:
            LaunchError: The copy failed (it names the node).
        """
        proc = subprocess.Popen(
            self._program(_TAR_IN, remote),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdin is not None and proc.stderr is not None
        err = _drain(proc.stderr)
        watchdog = threading.Timer(self._bound_s(), proc.kill)
        watchdog.start()
        try:
            with tarfile.open(fileobj=proc.stdin, mode="w|") as tar:
                for name in sorted(os.listdir(local)):
                    tar.add(os.path.join(local, name), arcname=name)
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # the step ended early: its exit status and stderr say why
        finally:
            watchdog.cancel()
        if proc.wait() != 0:
            raise self._failed(f"copying {local} to it", proc, err())

    def remove(self, remote: str) -> None:
        """Delete the folder ``remote`` on the node (a failure is only logged by the caller)."""
        try:
            subprocess.run(
                self._program(_REMOVE, remote),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=self._bound_s(),
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise LaunchError(f"node {self._node!r}: removing {remote} took too long", hosts=[self._node]) from None


def _drain(stream: IO[bytes]) -> Callable[[], bytes]:
    """Read ``stream`` to its end in a thread (a full stderr pipe would stall the step); the
    returned function gives what was read."""
    chunks: list[bytes] = []
    thread = threading.Thread(target=lambda: chunks.extend(iter(lambda: stream.read(4096), b"")), daemon=True)
    thread.start()

    def read() -> bytes:
        thread.join(5.0)
        return b"".join(chunks)

    return read
