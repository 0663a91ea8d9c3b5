"""The per-host agent process: forks this host's workers and relays their output.

Run as ``python -m ddptrain._agent``. It imports torch once, reads one bootstrap frame from
stdin, forks one worker per local rank, and then relays every worker's stdout/stderr and
exit status to stdout as frames. It kills all its workers when stdin closes (the driver died
or the SSH connection dropped) or when the driver sends a kill frame; every worker dies with
it through ``PR_SET_PDEATHSIG``.
"""

from __future__ import annotations

import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = ["FRAME", "AGENT_RANK", "read_frame", "write_frame", "write_all", "main"]

# kind (1 byte), rank, payload length
FRAME = struct.Struct(">cII")
AGENT_RANK = 0xFFFFFFFF
_POLL_S = 0.05
# After a worker exits, how long its pipes may stay open (held by processes it started,
# such as DataLoader workers) before its exit is reported anyway.
_DRAIN_S = 0.3


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a file descriptor."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_frame(fd: int, kind: bytes, rank: int, payload: bytes) -> None:
    """Write one frame to a file descriptor, in full."""
    write_all(fd, FRAME.pack(kind, rank, len(payload)) + payload)


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    chunks, missing = [], size
    while missing:
        chunk = stream.read(missing)
        if not chunk:
            break
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def read_frame(stream: IO[bytes]) -> tuple[bytes, int, bytes] | None:
    """Read one frame, or ``None`` at end of stream (short reads on pipes are retried)."""
    header = _read_exactly(stream, FRAME.size)
    if len(header) < FRAME.size:
        return None
    kind, rank, length = FRAME.unpack(header)
    payload = _read_exactly(stream, length)
    if len(payload) < length:
        return None
    return kind, rank, payload


@dataclass
class _Child:
    rank: int
    pid: int
    fds: dict[int, bytes] = field(default_factory=dict)  # fd -> frame kind
    status: bytearray = field(default_factory=bytearray)
    status_fd: int = -1
    exitcode: int | None = None
    exited_at: float = 0.0


def _set_pdeathsig(agent_pid: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != agent_pid:  # the agent died before the request took effect
        os._exit(1)


def _fork_worker(spec: dict[str, Any], shared: dict[str, Any], close_fds: list[int]) -> _Child:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    agent_pid = os.getpid()
    pid = os.fork()
    if pid == 0:  # the worker
        code = 1
        try:
            _set_pdeathsig(agent_pid)
            for fd in (*close_fds, out_r, err_r, status_r):
                os.close(fd)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (devnull, out_w, err_w):
                os.close(fd)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            from ddptrain import worker

            worker.reopen_std_streams()
            code = worker.run(spec, shared, status_w)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    for fd in (out_w, err_w, status_w):
        os.close(fd)
    return _Child(rank=spec["rank"], pid=pid, fds={out_r: b"O", err_r: b"E"}, status_fd=status_r)


def versions() -> dict[str, str]:
    """Versions that must match between the driver and every host."""
    import cloudpickle
    import torch

    import ddptrain

    major_minor = ".".join(sys.version.split()[0].split(".")[:2])
    return {
        "python": major_minor,
        "ddptrain": ddptrain.__version__,
        "torch": torch.__version__.split("+")[0],
        "cloudpickle": cloudpickle.__version__,
    }


def _check_versions(expected: dict[str, str]) -> None:
    here = versions()
    wrong = [
        f"{name} {here[name]} here, {want} on the driver" for name, want in expected.items() if here.get(name) != want
    ]
    if wrong:
        raise RuntimeError(
            f"version mismatch on {socket.gethostname()} ({sys.executable}): "
            + "; ".join(wrong)
            + ". Install the same versions on every host (pickled functions only load reliably then)."
        )


def _kill_group_strays() -> None:
    """Kill what is left in the agent's process group (e.g. DataLoader workers of a worker)."""
    group, me = os.getpgid(0), os.getpid()
    if group != me:
        return  # not our own group: leave it alone
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _load_shared(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """Unpickle the user's function once, before forking, so imports are shared."""
    os.environ["DDPTRAIN_UNPICKLING"] = "1"
    try:
        user = pickle.loads(bootstrap["payload"])
    finally:
        del os.environ["DDPTRAIN_UNPICKLING"]
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(
            "Loading the training function initialized CUDA (its config or closure holds CUDA "
            "tensors or modules). Pass CPU objects and move them to the device inside the "
            "training function."
        )
    return {"user": user, "run": bootstrap["run"]}


def _kill_all(children: list[_Child], grace_s: float) -> None:
    alive = [c for c in children if c.exitcode is None]
    for child in alive:
        try:
            os.kill(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        alive = [c for c in alive if not _reaped(c)]
        time.sleep(0.02)
    for child in alive:
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for child in alive:
        try:
            os.waitpid(child.pid, 0)
        except ChildProcessError:
            pass


def _reaped(child: _Child) -> bool:
    try:
        pid, status = os.waitpid(child.pid, os.WNOHANG)
    except ChildProcessError:
        return True
    if pid == 0:
        return False
    child.exitcode = os.waitstatus_to_exitcode(status)
    child.exited_at = time.monotonic()
    return True


def _relay(
    out_fd: int, stdin_fd: int, children: list[_Child], grace_s: float, heartbeat_s: float | None = None
) -> None:
    selector = selectors.DefaultSelector()
    selector.register(stdin_fd, selectors.EVENT_READ, ("stdin", None))
    for child in children:
        for fd in child.fds:
            selector.register(fd, selectors.EVENT_READ, ("out", child))
        selector.register(child.status_fd, selectors.EVENT_READ, ("status", child))

    def forward(key: selectors.SelectorKey) -> None:
        what, child = key.data
        data = os.read(key.fd, 65536)
        if not data:
            selector.unregister(key.fd)
            os.close(key.fd)
            if what == "out":
                del child.fds[key.fd]
            else:
                child.status_fd = -1
        elif what == "out":
            write_frame(out_fd, child.fds[key.fd], child.rank, data)
        else:
            child.status.extend(data)

    pending = list(children)  # children whose exit has not been reported
    last_heard = time.monotonic()
    while pending:
        for key, _ in selector.select(_POLL_S):
            if key.data[0] == "stdin":
                data = os.read(key.fd, 4096)
                if not data or b"K" in data:  # driver gone, or asked us to stop
                    _kill_all(children, grace_s)
                    return
                last_heard = time.monotonic()
            else:
                forward(key)
        if heartbeat_s is not None and time.monotonic() - last_heard > heartbeat_s:
            print(f"ddptrain agent: no heartbeat from the driver for {heartbeat_s:.0f} s; stopping", file=sys.stderr)
            _kill_all(children, grace_s)
            return
        for child in list(pending):
            if child.exitcode is None and not _reaped(child):
                continue
            drained = not child.fds and child.status_fd == -1
            if not drained and time.monotonic() - child.exited_at < _DRAIN_S:
                continue  # give its last output a moment, so it comes before the exit
            if child.status_fd != -1:  # held open by a process it started; its status is in the pipe
                os.set_blocking(child.status_fd, False)
                try:
                    while chunk := os.read(child.status_fd, 65536):
                        child.status.extend(chunk)
                except BlockingIOError:
                    pass
                selector.unregister(child.status_fd)
                os.close(child.status_fd)
                child.status_fd = -1
            payload = pickle.dumps({"exitcode": child.exitcode, "status": bytes(child.status)})
            write_frame(out_fd, b"X", child.rank, payload)
            pending.remove(child)


def main() -> int:
    """Agent entry point."""
    # Frames own the real stdout; stray prints in the agent go to stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    stdin = os.fdopen(0, "rb", buffering=0)
    try:
        # Imported once here, while the driver prepares the run, and shared by every worker.
        import torch  # noqa: F401

        from ddptrain import worker  # noqa: F401

        frame = read_frame(stdin)
        if frame is None:
            return 0
        bootstrap: dict[str, Any] = pickle.loads(frame[2])
        _check_versions(bootstrap.get("versions", {}))
        sys.path[:0] = [p for p in bootstrap["sys_path"] if p not in sys.path]
        if bootstrap.get("cwd"):
            try:
                os.chdir(bootstrap["cwd"])
            except OSError as exc:
                print(f"ddptrain agent: cannot enter {bootstrap['cwd']!r}: {exc}", file=sys.stderr)
        shared = _load_shared(bootstrap)
    except BaseException:
        write_frame(out_fd, b"F", AGENT_RANK, traceback.format_exc().encode())
        return 1
    host = socket.gethostname()
    children: list[_Child] = []
    try:
        for spec in bootstrap["workers"]:
            close = [out_fd, 0] + [fd for c in children for fd in (*c.fds, c.status_fd)]
            child = _fork_worker(spec, shared, close)
            children.append(child)
            info = pickle.dumps({"pid": child.pid, "host": host})
            write_frame(out_fd, b"S", child.rank, info)
        _relay(out_fd, 0, children, bootstrap["grace_s"], bootstrap.get("heartbeat_s"))
    except BrokenPipeError:
        _kill_all(children, bootstrap["grace_s"])
    except BaseException:
        _kill_all(children, bootstrap["grace_s"])
        try:
            write_frame(out_fd, b"F", AGENT_RANK, traceback.format_exc().encode())
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    exit_code = main()
    _kill_group_strays()
    sys.stderr.flush()
    os._exit(exit_code)  # skip interpreter teardown with torch loaded (about half a second)
