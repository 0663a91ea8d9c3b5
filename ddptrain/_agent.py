"""The per-host agent process: forks this host's workers and relays their output.

Started with :func:`agent_command`. It imports torch once, reads one bootstrap frame from
stdin, forks one worker per local rank, and then relays every worker's stdout/stderr and
exit status to stdout as frames. It kills all its workers when stdin closes (the driver died
or the SSH connection dropped) or when the driver sends a kill frame; every worker dies with
it through ``PR_SET_PDEATHSIG``.

How workers start (``bootstrap["start"]``):

- ``"shared"`` (CPU runs): the agent loads the user's function once and then forks, so the
  user's imports are shared by every worker. If loading it started threads or CUDA, a fork
  would not be safe: the agent then replaces itself with a fresh one (``exec``) that starts
  the workers the ``"clean"`` way.
- ``"clean"`` (GPU runs): the agent forks before anything of the user's is loaded, and each
  worker loads the function for itself. CUDA is never touched in the agent, so every worker
  can initialize it.

Either way the agent never forks while it has a second thread.
"""

from __future__ import annotations

import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import IO, Any

from ddptrain import _memory, ray_compat

__all__ = ["FRAME", "AGENT_RANK", "agent_command", "import_roots", "read_frame", "write_frame", "write_all", "main"]

# kind (1 byte), rank, payload length
FRAME = struct.Struct(">cII")
AGENT_RANK = 0xFFFFFFFF
_POLL_S = 0.05
# After a worker exits, how long its pipes may stay open (held by processes it started,
# such as DataLoader workers) before its exit is reported anyway.
_DRAIN_S = 0.3
# Set by an agent that replaced itself with a clean one: the fd that holds its bootstrap.
_BOOTSTRAP_FD_VAR = "DDPTRAIN_AGENT_BOOTSTRAP_FD"

# The agent's program. ``python -c`` puts the working directory first on ``sys.path``; it is
# taken off before anything is imported, and the folders the driver imported ddptrain, torch,
# numpy and cloudpickle from (the arguments) go first. So a ``ddptrain/`` or ``torch/`` that
# someone planted in a shared working directory is never imported. The user's own modules
# resolve once the bootstrap has arrived, through the driver's ``sys.path``.
# numpy's OpenBLAS starts a thread pool when it is loaded (ddptrain imports torch and numpy),
# and the agent must stay single-threaded to fork safely: it is loaded with one thread, the
# user's setting is restored at once, and each worker applies it (``worker.restore_blas_threads``).
_BOOT = (
    "import os, sys; roots = sys.argv[1:]; del sys.argv[1:]; "
    "sys.path[:] = roots + [p for p in sys.path if p and p not in roots]; "
    "blas = os.environ.get('OPENBLAS_NUM_THREADS'); os.environ['OPENBLAS_NUM_THREADS'] = '1'; "
    "import ddptrain._agent; ddptrain._agent.entry(blas)"
)


def import_roots() -> list[str]:
    """The folders this process imported ddptrain and its runtime dependencies from."""
    roots: list[str] = []
    for name in ("ddptrain", "torch", "numpy", "cloudpickle"):
        module = sys.modules.get(name)
        location = getattr(module, "__file__", None)
        if location:
            root = os.path.dirname(os.path.dirname(os.path.abspath(location)))
            if root not in roots:
                roots.append(root)
    return roots


def agent_command(python: str, roots: list[str] | None = None) -> list[str]:
    """The command line of an agent: ``python -c BOOT ROOT...`` (see ``_BOOT``)."""
    return [python, "-c", _BOOT, *(roots or [])]


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
    maxrss_kb: int = 0  # peak RSS, from wait4


def _set_pdeathsig(agent_pid: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != agent_pid:  # the agent died before the request took effect
        os._exit(1)


def other_threads() -> list[str]:
    """Names of this process's threads other than the calling one (empty: safe to fork)."""
    me = str(threading.get_native_id())
    names = []
    for tid in os.listdir("/proc/self/task"):
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f"{f.read().strip()} (tid {tid})")
        except OSError:
            pass  # it ended meanwhile
    return names


def _check_single_threaded(when: str) -> None:
    threads = other_threads()
    if threads:
        raise RuntimeError(
            f"the ddptrain agent has {len(threads)} other thread(s) {when}: {', '.join(threads)}. Forking "
            "workers now could deadlock them, so none were started. Please report this with the thread "
            "names; setting DDPTRAIN_WORKER_START=clean may avoid it."
        )


def _fork_worker(spec: dict[str, Any], shared: dict[str, Any], close_fds: list[int]) -> _Child:
    _check_single_threaded(f"before starting rank {spec['rank']}")
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
    from ddptrain import protocol

    major_minor = ".".join(sys.version.split()[0].split(".")[:2])
    return {
        "python": major_minor,
        "ddptrain": ddptrain.__version__,
        "protocol": str(protocol.VERSION),
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


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first; empty: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _kill_group_strays() -> None:
    """Kill what is left in the agent's process group (e.g. DataLoader workers of a worker)."""
    group, me = os.getpgid(0), os.getpid()
    if group != me:
        return  # not our own group: leave it alone
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        fields = _stat_fields(int(entry))
        if len(fields) > 2 and int(fields[2]) == group:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def load_user(payload: bytes) -> Any:
    """Unpickle the user's function and config (importing the modules they come from)."""
    os.environ["DDPTRAIN_UNPICKLING"] = "1"
    try:
        return pickle.loads(payload)
    finally:
        del os.environ["DDPTRAIN_UNPICKLING"]


def _fork_unsafe_after_loading() -> str | None:
    """Why forking is no longer safe after the user's code was loaded here (``None``: it is)."""
    import torch

    if torch.cuda.is_initialized():  # a flag read; it does not touch the driver
        return "it initialized CUDA"
    threads = other_threads()
    if threads:
        return f"it started {len(threads)} thread(s): {', '.join(threads)}"
    return None


def _exec_clean(bootstrap: dict[str, Any], out_fd: int, reason: str) -> None:
    """Replace this agent with a fresh one that starts the workers the clean way."""
    print(
        f"ddptrain agent: loading the training function before starting the workers was not safe "
        f"({reason}); starting them from a fresh agent instead, where each worker loads it itself.",
        file=sys.stderr,
    )
    data = pickle.dumps({**bootstrap, "start": "clean"})
    fd = os.memfd_create("ddptrain-bootstrap", 0)  # inherited across exec
    write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(out_fd, 1)  # the frames' stdout, as the agent found it
    env = {**_START_ENV, _BOOTSTRAP_FD_VAR: str(fd)}
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


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


def process_state(pid: int) -> dict[str, str]:
    """The kernel's view of a process: its state letter and the kernel function it waits in."""
    fields = _stat_fields(pid)
    state = {"state": fields[0] if fields else "?", "wchan": ""}
    try:
        with open(f"/proc/{pid}/wchan") as f:
            state["wchan"] = f.read().strip()
    except OSError:
        pass
    return state


def _report_states(out_fd: int, children: list[_Child], dump_stacks: bool) -> None:
    """Send the driver each live worker's process state; with ``dump_stacks``, also make each
    worker that can run print its Python stacks (faulthandler on SIGUSR1, see ``worker``)."""
    states = {}
    for child in children:
        if child.exitcode is not None:
            continue
        states[child.rank] = {"pid": child.pid, **process_state(child.pid)}
        if dump_stacks and states[child.rank]["state"] not in ("T", "t", "Z"):
            try:
                os.kill(child.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    write_frame(out_fd, b"P", AGENT_RANK, pickle.dumps(states))


def _reaped(child: _Child) -> bool:
    try:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
    except ChildProcessError:
        return True
    if pid == 0:
        return False
    child.exitcode = os.waitstatus_to_exitcode(status)
    child.maxrss_kb = usage.ru_maxrss
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
    oom_kills = _memory.oom_kills()  # a worker dead of SIGKILL is then checked against it
    last_heard = time.monotonic()
    while pending:
        for key, _ in selector.select(_POLL_S):
            if key.data[0] == "stdin":
                data = os.read(key.fd, 4096)
                if not data or b"K" in data:  # driver gone, or asked us to stop
                    _kill_all(children, grace_s)
                    return
                if b"Q" in data or b"T" in data:  # the driver asks how the workers are
                    _report_states(out_fd, children, dump_stacks=b"T" in data)
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
            exit_info: dict[str, Any] = {"exitcode": child.exitcode, "status": bytes(child.status)}
            if child.exitcode == -signal.SIGKILL:
                exit_info["memory"] = _memory.evidence(oom_kills, child.maxrss_kb)
            payload = pickle.dumps(exit_info)
            write_frame(out_fd, b"X", child.rank, payload)
            pending.remove(child)


_START_ENV: dict[str, str] = {}


def _read_bootstrap(stdin: IO[bytes]) -> dict[str, Any] | None:
    fd = os.environ.pop(_BOOTSTRAP_FD_VAR, None)
    if fd is not None:  # this agent replaced one that was not safe to fork from
        with os.fdopen(int(fd), "rb") as f:
            return pickle.load(f)
    frame = read_frame(stdin)
    return None if frame is None else pickle.loads(frame[2])


def _user_sys_path(bootstrap: dict[str, Any]) -> list[str]:
    """The driver's ``sys.path`` for the user's imports ('' meant the driver's working directory)."""
    cwd = bootstrap.get("cwd") or os.getcwd()
    return [p or cwd for p in bootstrap["sys_path"]]


def main() -> int:
    """Agent entry point."""
    _START_ENV.update(os.environ)
    # Frames own the real stdout; stray prints in the agent go to stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    stdin = os.fdopen(0, "rb", buffering=0)
    try:
        # Imported once here, while the driver prepares the run, and shared by every worker.
        import torch  # noqa: F401

        from ddptrain import worker  # noqa: F401

        bootstrap = _read_bootstrap(stdin)
        if bootstrap is None:
            return 0
        _check_versions(bootstrap.get("versions", {}))
        if os.environ.get(ray_compat.ENV_VAR) == "1":  # under `ddptrain run`: the user's code may import ray.*
            ray_compat.install()
        sys.path[:0] = [p for p in _user_sys_path(bootstrap) if p not in sys.path]
        if bootstrap.get("cwd"):
            try:
                os.chdir(bootstrap["cwd"])
            except OSError as exc:
                print(f"ddptrain agent: cannot enter {bootstrap['cwd']!r}: {exc}", file=sys.stderr)
        shared: dict[str, Any] = {"run": bootstrap["run"], "payload": bootstrap["payload"]}
        if bootstrap.get("start", "shared") == "shared" and bootstrap["payload"] is not None:
            shared["user"] = load_user(bootstrap["payload"])
            reason = _fork_unsafe_after_loading()
            if reason is not None:
                _exec_clean(bootstrap, out_fd, reason)
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


def entry(openblas_threads: str | None = None) -> None:
    """Run the agent and exit the process (``openblas_threads``: the user's
    ``OPENBLAS_NUM_THREADS``, which ``_BOOT`` replaced while importing)."""
    if openblas_threads is None:
        os.environ.pop("OPENBLAS_NUM_THREADS", None)
    else:
        os.environ["OPENBLAS_NUM_THREADS"] = openblas_threads
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    exit_code = main()
    _kill_group_strays()
    sys.stderr.flush()
    os._exit(exit_code)  # skip interpreter teardown with torch loaded (about half a second)


if __name__ == "__main__":
    entry(os.environ.get("OPENBLAS_NUM_THREADS"))
