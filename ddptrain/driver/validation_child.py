"""The validation process: a plain ``python`` that runs :func:`main` on a folder.

Started by :class:`ddptrain.driver.validation.Validations` in a private folder (mode 0700)
that holds ``task.pkl``: the cloudpickled request (the trainer's ``ValidationConfig`` function
and keyword arguments, the report's own request, the ``Checkpoint``, the driver's
``sys.path``, whether ``import ray`` is ddptrain's; on another host, the working directory
there).
It pins itself to ``DDPTRAIN_VALIDATION_CPUS`` if set, calls the function, and writes
``result.json`` (``{"metrics": ...}`` or ``{"error": traceback}``) atomically. It imports
neither torch nor the driver: only what the function itself needs.

It ends with what it started. On the driver's host the driver stops its process group; it
stops the group itself once the driver's pid is gone (a driver killed with SIGKILL). On an SSH
host (``remote=True``) it is in a session of its own, stops its group once its stdin (the SSH
channel) ends or the driver's heartbeats on it stop for ``DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S`` (a
link that went down), as the agent does, and kills it when it is done. A stop is SIGTERM, then
SIGKILL after ``DDPTRAIN_SHUTDOWN_GRACE_S``, whoever stops it; the SIGTERM raises ``SystemExit``
in the function (``finally`` blocks and ``with`` exits run), and its folder is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any

import cloudpickle

from ddptrain import _env, ray_compat
from ddptrain.storage.layout import to_jsonable
from ddptrain.wire.boot import check_versions, worker_sys_path

__all__ = ["main"]


def _call(request: dict[str, Any]) -> dict[str, Any]:
    cpus = _env.validation_cpus()
    if cpus:
        os.sched_setaffinity(0, cpus)
    if request.get("cwd") is not None:  # another host: as its workers, the driver's path merged with its own
        sys.path[:] = worker_sys_path(list(request["sys_path"]), request["cwd"], list(sys.path))
    else:
        sys.path[:] = list(request["sys_path"])
    if request["ray_compat"]:  # under `ddptrain run`: the function may use `ray.train`, as the workers do
        ray_compat.install()
    fn, kwargs = cloudpickle.loads(request["default"]) if request["default"] is not None else (None, {})
    own_fn, args, own_kwargs = cloudpickle.loads(request["spec"])
    if own_fn is not None:  # Ray's earlier form: report(validate_fn=..., validate_config=...)
        fn, kwargs = own_fn, {}
    elif own_kwargs is not None:  # report(validation=ValidationTaskConfig(fn_kwargs=...))
        kwargs = own_kwargs
    if fn is None:
        raise ValueError("no validation function: give the trainer `validation_config=ValidationConfig(fn)`")
    metrics = fn(request["checkpoint"], *args, **(kwargs or {}))
    if not isinstance(metrics, dict):
        raise TypeError(f"the validation function must return a dict of metrics, got {type(metrics).__name__}")
    return {"metrics": to_jsonable(metrics)}


def _watch_driver(driver_pid: int, folder: str) -> None:
    """End this process's group (it and what the function started) once the driver is gone:
    a driver killed with SIGKILL cannot stop its validation itself."""
    while os.getppid() == driver_pid:
        time.sleep(0.5)
    _end_group(folder)


def _stopped(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(f"the validation was stopped ({signal.Signals(signum).name})")


def _until_driver_gone(heartbeat_s: float) -> None:
    """Return once stdin (the SSH channel, where the driver sends a heartbeat byte every half
    second) ends or stays silent for ``heartbeat_s``."""
    try:
        while select.select([0], [], [], heartbeat_s)[0] and os.read(0, 4096):
            pass
    except OSError:
        pass


def _watch_stdin(folder: str) -> None:
    """On an SSH host: end this process's group once the driver is gone (it killed the
    validation, or died, or the connection dropped or went silent), as :func:`_end_group` does."""
    _until_driver_gone(_env.ssh_heartbeat_timeout_s())
    _end_group(folder)


def _end_group(folder: str) -> None:
    """The driver is gone: SIGTERM to this process's group (``SystemExit`` in the function, whose
    ``finally`` blocks and handlers run), SIGKILL after ``DDPTRAIN_SHUTDOWN_GRACE_S``; ``folder``
    (it holds the pickled function) is removed once the group is gone."""
    grace_s = _env.shutdown_grace_s()
    try:  # in a session of its own, once the group is gone (`main` may end it first)
        remove = 'sleep "$1"; rm -rf -- "$2"'
        subprocess.Popen(
            ["sh", "-c", remove, "sh", str(grace_s + 1.0), folder], start_new_session=True, stdout=subprocess.DEVNULL
        )
    finally:
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGTERM)  # here, SystemExit in the main thread (`_stopped`)
        time.sleep(grace_s)  # a function that ends in time ends the group itself (`main`)
        os.killpg(0, signal.SIGKILL)


def _remove_if_unread(driver: int, folder: str) -> None:
    """Once the result is written the driver reads it and removes ``folder``; a driver killed
    before it could would leave it (and the pickled function in it) behind. A process of its
    own removes it then: it ends once the folder is gone, or the driver is."""
    wait = 'while [ -d "$2" ] && kill -0 "$1" 2>/dev/null; do sleep 0.2; done; rm -rf -- "$2"'
    with contextlib.suppress(OSError):
        subprocess.Popen(
            ["sh", "-c", wait, "sh", str(driver), folder],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )


def main(folder: str, remote: bool = False, expected: dict[str, str] | None = None, driver: int | None = None) -> int:
    """Run the validation of ``folder``'s request; its result (or error) goes to ``result.json``.
    ``remote``: on an SSH host (see the module docstring). ``expected``: the driver's versions
    (``wire.boot.versions``), which must be this host's for the request to unpickle. ``driver``:
    the driver's pid, for a local validation (not this process's parent when the driver died
    while it started: it then ends at once)."""
    signal.signal(signal.SIGTERM, _stopped)  # a stop unwinds the function: its cleanup runs
    if remote:
        try:
            os.setsid()  # its own session and group: what the function starts is killed with it
        except OSError:  # a group leader already (sshd starts each command in a session of its own)
            if os.getpgid(0) != os.getpid():
                os.setpgid(0, 0)
        threading.Thread(target=_watch_stdin, args=(folder,), daemon=True, name="stdin-watch").start()
    if driver is None:
        driver = os.getppid()
    if not remote:
        threading.Thread(target=_watch_driver, args=(driver, folder), daemon=True, name="driver-watch").start()
    try:
        if expected is not None:
            check_versions(expected)
        with open(os.path.join(folder, "task.pkl"), "rb") as f:
            request = cloudpickle.load(f)
        result = _call(request)
    except BaseException as exc:  # the function's error is the result: the driver reports it
        text = "".join(traceback.format_exception(exc))
        print(text, file=sys.stderr, flush=True)
        result = {"error": text}
    part = os.path.join(folder, "result.json.part")
    with open(part, "w") as f:
        json.dump(result, f)
    os.replace(part, os.path.join(folder, "result.json"))
    if not remote:
        _remove_if_unread(driver, folder)
    if remote or os.getppid() != driver:  # what the function left behind (else the driver kills it)
        sys.stdout.flush()
        sys.stderr.flush()
        os.killpg(0, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
