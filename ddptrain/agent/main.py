"""The per-host agent process: forks this host's workers and relays their output.

Started with :func:`agent_command`. It imports torch once, reads one
:class:`~ddptrain.protocol.Bootstrap` frame from stdin, forks one worker per local rank, and
then relays every worker's stdout/stderr and exit status to stdout as frames
(``ddptrain.agent.relay``; frames and events: ``ddptrain.wire.protocol``, ``ddptrain.wire.agent_events``).
When the driver restarts the group from warm agents (``Request.RESET``), the agent kills its
workers and what they started, says ``AgentIdle``, and starts the next bootstrap's workers. Once
every worker has exited, it waits for the driver's word (a reset, or a stop) rather than exiting,
so that a restart after all of its workers failed starts from it too.
It kills all its workers when stdin closes (the driver died or the SSH connection dropped), when
the driver sends ``Request.KILL``, or on an SSH host when the driver's heartbeats stop; every
worker dies with it through ``PR_SET_PDEATHSIG``.

How workers start (``Bootstrap.start``):

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

import dataclasses
import os
import pickle
import signal
import socket
import sys
import traceback
from typing import IO, TYPE_CHECKING

from ddptrain import ray_compat
from ddptrain.agent import forkserver
from ddptrain.agent.process import (
    kill_group_strays,
    other_threads,
    resume_when_orphaned,
    set_pdeathsig,
    why_fork_unsafe,
)
from ddptrain.agent.relay import Child, kill_all, relay, wait_for_bootstrap
from ddptrain.wire.agent_events import AgentFailed, WorkerStarted, encode_event
from ddptrain.wire.boot import FORKSERVER_FD_VAR, check_versions, load_user, worker_sys_path, write_all
from ddptrain.wire.protocol import (
    AGENT_RANK,
    Bootstrap,
    Kind,
    WorkerSpec,
    decode_bootstrap,
    read_frame,
)

if TYPE_CHECKING:
    from ddptrain.worker.main import WorkerBoot

__all__ = ["entry", "main"]

# Set by an agent that replaced itself with a clean one: the fd that holds its bootstrap.
_BOOTSTRAP_FD_VAR = "DDPTRAIN_AGENT_BOOTSTRAP_FD"


def _check_single_threaded(when: str) -> None:
    threads = other_threads()
    if threads:
        raise RuntimeError(
            f"the ddptrain agent has {len(threads)} other thread(s) {when}: {', '.join(threads)}. Forking "
            "workers now could deadlock them, so none were started. Please report this with the thread "
            "names; setting DDPTRAIN_WORKER_START=clean may avoid it."
        )


def _fork_worker(spec: WorkerSpec, boot: WorkerBoot, close_fds: list[int]) -> Child:
    _check_single_threaded(f"before starting rank {spec.rank}")
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    agent_pid = os.getpid()
    pid = os.fork()
    if pid == 0:  # the worker
        code = 1
        try:
            set_pdeathsig(agent_pid)
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
            from ddptrain.worker import main as worker  # loaded by main() already: a lookup

            worker.reopen_std_streams()
            code = worker.run(spec, boot, status_w)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                forkserver.send_hints()  # what it imported that the next agent could have
            finally:
                os._exit(code)
    for fd in (out_w, err_w, status_w):
        os.close(fd)
    return Child(rank=spec.rank, pid=pid, fds={out_r: Kind.STDOUT, err_r: Kind.STDERR}, status_fd=status_r)


def _exec_clean(bootstrap: Bootstrap, out_fd: int, reason: str) -> None:
    """Replace this agent with a fresh one that starts the workers the clean way."""
    print(
        f"ddptrain agent: loading the training function before starting the workers was not safe "
        f"({reason}); starting them from a fresh agent instead, where each worker loads it itself.",
        file=sys.stderr,
    )
    data = pickle.dumps(dataclasses.replace(bootstrap, start="clean"))
    fd = os.memfd_create("ddptrain-bootstrap", 0)  # inherited across exec
    write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(out_fd, 1)  # the frames' stdout, as the agent found it
    env = {**_START_ENV, _BOOTSTRAP_FD_VAR: str(fd)}
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


_START_ENV: dict[str, str] = {}


def _read_bootstrap(stdin: IO[bytes]) -> Bootstrap | None:
    fd = os.environ.pop(_BOOTSTRAP_FD_VAR, None)
    if fd is not None:  # this agent replaced one that was not safe to fork from (versions checked)
        with os.fdopen(int(fd), "rb") as f:
            bootstrap: Bootstrap = pickle.load(f)
            return bootstrap
    frame = read_frame(stdin)
    if frame is None:
        return None
    kind, _, payload = frame
    if kind != Kind.BOOTSTRAP:
        raise RuntimeError(f"expected a bootstrap frame from the driver, got kind {kind!r}")
    return decode_bootstrap(payload, check_versions)


def main() -> int:
    """Agent entry point: the workers of one bootstrap, then, each time the driver resets the
    agent for its next attempt (``Request.RESET``), those of the next one."""
    _START_ENV.update(os.environ)
    # Frames own the real stdout; stray prints in the agent go to stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    stdin = os.fdopen(0, "rb", buffering=0)
    own_path = list(sys.path)
    try:
        # Imported once here, while the driver prepares the run, and shared by every worker;
        # here rather than at the top so that a failure to import reaches the driver as a frame.
        import torch  # noqa: F401

        from ddptrain.worker import main as worker  # noqa: F401

        bootstrap = _read_bootstrap(stdin)
    except BaseException:
        write_all(out_fd, encode_event(AgentFailed(AGENT_RANK, traceback.format_exc())))
        return 1
    while bootstrap is not None:
        code, reset = _run(bootstrap, out_fd, own_path)
        if not reset:
            return code
        # Kept for the next attempt: nothing of this one's may be left (its workers were
        # killed and reaped; what they started goes now), and the next bootstrap is new.
        kill_group_strays()
        payload = wait_for_bootstrap(out_fd, 0, bootstrap.heartbeat_s)
        if payload is None:
            return 0
        try:
            bootstrap = decode_bootstrap(payload, check_versions)
        except BaseException:
            write_all(out_fd, encode_event(AgentFailed(AGENT_RANK, traceback.format_exc())))
            return 1
    return 0


def _run(bootstrap: Bootstrap, out_fd: int, own_path: list[str]) -> tuple[int, bool]:
    """Start the workers of ``bootstrap`` and relay them until they exited: the agent's exit
    code, and whether the driver reset it for its next attempt instead."""
    try:
        if bootstrap.ray_compat:  # under `ddptrain run`: the user's code may import ray.*
            ray_compat.install()
        sys.path[:] = worker_sys_path(list(bootstrap.sys_path), bootstrap.cwd or os.getcwd(), own_path)
        if bootstrap.cwd:
            try:
                os.chdir(bootstrap.cwd)
            except OSError as exc:
                print(f"ddptrain agent: cannot enter {bootstrap.cwd!r}: {exc}", file=sys.stderr)
        from ddptrain.worker.main import WorkerBoot  # loaded by main() already: a lookup

        boot = WorkerBoot(bootstrap.run, bootstrap.store, bootstrap.payload)
        if bootstrap.start == "shared" and bootstrap.payload is not None:
            boot = dataclasses.replace(boot, user=load_user(bootstrap.payload))
            reason = why_fork_unsafe()  # after loading the user's code
            if reason is not None:
                _exec_clean(bootstrap, out_fd, reason)
    except BaseException:
        write_all(out_fd, encode_event(AgentFailed(AGENT_RANK, traceback.format_exc())))
        return 1, False
    host = socket.gethostname()
    children: list[Child] = []
    try:
        for spec in bootstrap.workers:
            close = [out_fd, 0] + [fd for c in children for fd in (*c.fds, c.status_fd)]
            child = _fork_worker(spec, boot, close)
            children.append(child)
            write_all(out_fd, encode_event(WorkerStarted(child.rank, child.pid, host)))
        return 0, relay(out_fd, 0, children, bootstrap.grace_s, bootstrap.heartbeat_s)
    except BrokenPipeError:
        kill_all(children, bootstrap.grace_s)
    except BaseException:
        kill_all(children, bootstrap.grace_s)
        try:
            write_all(out_fd, encode_event(AgentFailed(AGENT_RANK, traceback.format_exc())))
        except OSError:
            pass
        return 1, False
    return 0, False


def entry(openblas_threads: str | None = None) -> None:
    """Run the agent and exit the process (``openblas_threads``: the user's
    ``OPENBLAS_NUM_THREADS``, which ``_BOOT`` replaced while importing)."""
    if openblas_threads is None:
        os.environ.pop("OPENBLAS_NUM_THREADS", None)
    else:
        os.environ["OPENBLAS_NUM_THREADS"] = openblas_threads
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    # SLURM's `--signal` (and `scancel --signal`) reaches every process of a job's steps: the
    # agent, its fork server, workers and their upload processes must not die of it. The relay
    # takes SIGUSR1 as a preemption notice; the workers inherit both ignored.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    control_fd = os.environ.pop(FORKSERVER_FD_VAR, None)
    if control_fd is not None:  # a fork server: returns in each agent it forks
        forkserver.serve(int(control_fd))
    resume_when_orphaned()
    exit_code = main()
    kill_group_strays()
    sys.stderr.flush()
    forkserver.send_hints()
    os._exit(exit_code)  # skip interpreter teardown with torch loaded (about half a second)


if __name__ == "__main__":
    entry(os.environ.get("OPENBLAS_NUM_THREADS"))
