"""How an agent process starts on a host, and what must match between it and the driver.

Both launchers (a local subprocess, an SSH channel) start an agent with :func:`agent_command`;
the agent checks the driver's :func:`versions` against its own before it unpickles anything
of the driver's (``protocol.decode_bootstrap``).
"""

from __future__ import annotations

import os
import socket
import sys

import ddptrain
from ddptrain.protocol import VERSION

__all__ = ["agent_command", "check_versions", "import_roots", "versions"]

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


def versions() -> dict[str, str]:
    """Versions that must match between the driver and every host."""
    # Imported here: the CLI imports this module for `import_roots` and must start fast.
    import cloudpickle
    import torch

    major_minor = ".".join(sys.version.split()[0].split(".")[:2])
    return {
        "python": major_minor,
        "ddptrain": ddptrain.__version__,
        "protocol": str(VERSION),
        "torch": torch.__version__.split("+")[0],
        "cloudpickle": cloudpickle.__version__,
    }


def check_versions(expected: dict[str, str]) -> None:
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
