"""How an agent process starts on a host, and what must match between it and the driver.

Both launchers (a local subprocess, an SSH channel) start an agent with :func:`agent_command`;
the agent checks the driver's :func:`versions` against its own before it unpickles anything
of the driver's (``protocol.decode_bootstrap``). Where it imports from: ddptrain and its runtime
dependencies from the driver's folders (``PIN``), the rest through the driver's ``sys.path``
(:func:`worker_sys_path`).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
from typing import Any

from ddptrain._version import __version__
from ddptrain.wire.protocol import VERSION

__all__ = [
    "FORKSERVER_FD_VAR",
    "PIN",
    "agent_command",
    "check_versions",
    "import_pins",
    "load_user",
    "versions",
    "worker_sys_path",
    "write_all",
]

# What the agent, and `ddptrain check`'s probe, run first: ``python -c`` puts the working
# directory first on ``sys.path``; it is taken off before anything is imported. Each ``NAME=FOLDER``
# argument pins a package: ddptrain, torch, numpy and cloudpickle are imported from the folders
# the driver imported them from, and only from there, whatever the path says (so a ``ddptrain/`` or
# ``torch/`` that someone planted in a shared working directory is never imported). The path
# itself keeps Python's order (``PYTHONPATH`` before the installed packages, as in the driver):
# a folder that shadows an installed package wins in the agent as it does in the driver. The
# user's own modules resolve once the bootstrap has arrived, through the driver's ``sys.path``.
PIN = (
    # `sys` is always loaded; `types` and `importlib` are not on every installation (Python 3.10,
    # 3.12, Debian's 3.11 without a .pth that loads them): the path is cleaned before they are imported.
    "import sys; sys.path[:] = [p for p in sys.path if p]; "
    "import os, types, importlib.machinery; "
    "pins = dict(arg.split('=', 1) for arg in sys.argv[1:]); del sys.argv[1:]; "
    "sys.meta_path.insert(0, types.SimpleNamespace(find_spec=lambda name, path=None, target=None: "
    "importlib.machinery.PathFinder.find_spec(name, [pins[name]]) if name in pins else None)); "
)
# The agent's program. numpy's OpenBLAS starts a thread pool when it is loaded (ddptrain imports
# torch and numpy), and the agent must stay single-threaded to fork safely: it is loaded with one
# thread, the user's setting is restored at once, and each worker applies it
# (``worker.restore_blas_threads``).
_BOOT = (
    PIN + "blas = os.environ.get('OPENBLAS_NUM_THREADS'); os.environ['OPENBLAS_NUM_THREADS'] = '1'; "
    "import ddptrain.agent.main; ddptrain.agent.main.entry(blas)"
)


def import_pins() -> list[str]:
    """``NAME=FOLDER`` for ddptrain and its runtime dependencies: the folders this process
    imported them from (see ``PIN``)."""
    pins: list[str] = []
    for name in ("ddptrain", "torch", "numpy", "cloudpickle"):
        module = sys.modules.get(name)
        location = getattr(module, "__file__", None)
        if location:
            pins.append(f"{name}={os.path.dirname(os.path.dirname(os.path.abspath(location)))}")
    return pins


# Set in the environment of an agent fork server (``ddptrain.agent.forkserver``): the file
# descriptor of its end of the driver's socket pair.
FORKSERVER_FD_VAR = "DDPTRAIN_AGENT_FORKSERVER_FD"


def agent_command(python: str, pins: list[str] | None = None) -> list[str]:
    """The command line of an agent: ``python -c BOOT NAME=FOLDER...`` (see ``PIN``)."""
    return [python, "-c", _BOOT, *(pins or [])]


def worker_sys_path(driver: list[str], cwd: str, own: list[str]) -> list[str]:
    """The ``sys.path`` of the workers: the driver's, in the driver's order ('' meant the
    driver's working directory, ``cwd``), so that they import what the driver imports (a folder on
    ``PYTHONPATH`` that shadows an installed package included). Entries only this process has
    (``own``: a ``PYTHONPATH`` of the workers' environment, a host's own installation) go where
    Python put them here: before the next entry that the driver has too, else last."""
    driver = [p or cwd for p in driver]
    known = set(driver)
    before: dict[str, list[str]] = {}
    pending: list[str] = []
    for entry in own:
        if entry in known:
            before.setdefault(entry, []).extend(pending)
            pending = []
        elif entry:
            pending.append(entry)
    merged: list[str] = []
    for entry in [e for d in driver for e in (*before.get(d, ()), d)] + pending:
        if entry not in merged:
            merged.append(entry)
    return merged


def versions(with_torch: bool = True) -> dict[str, str]:
    """Versions that must match between the driver and every host (``with_torch=False``:
    for a process that unpickles no torch objects and must not pay torch's import)."""
    # Imported here: the CLI imports this module for `import_roots` and must start fast.
    import cloudpickle

    major_minor = ".".join(sys.version.split()[0].split(".")[:2])
    found = {
        "python": major_minor,
        "ddptrain": __version__,
        "protocol": str(VERSION),
        "cloudpickle": cloudpickle.__version__,
    }
    if with_torch:
        import torch

        found["torch"] = torch.__version__.split("+")[0]
    return found


def check_versions(expected: dict[str, str]) -> None:
    """Raise ``RuntimeError`` naming each of ``expected``'s versions (the driver's) that this
    host's differ from."""
    here = versions(with_torch="torch" in expected)
    wrong = [
        f"{name} {here[name]} here, {want} on the driver" for name, want in expected.items() if here.get(name) != want
    ]
    if wrong:
        raise RuntimeError(
            f"version mismatch on {socket.gethostname()} ({sys.executable}): "
            + "; ".join(wrong)
            + ". Install the same versions on every host (pickled functions only load reliably then)."
        )


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a file descriptor."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def load_user(payload: bytes) -> Any:
    """Unpickle the user's function and config (importing the modules they come from)."""
    os.environ["DDPTRAIN_UNPICKLING"] = "1"
    try:
        return pickle.loads(payload)
    finally:
        del os.environ["DDPTRAIN_UNPICKLING"]
