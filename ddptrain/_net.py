"""Which address of this host the other workers reach it at (inside a worker)."""

from __future__ import annotations

import os
import socket

__all__ = ["own_address"]


def own_address() -> str:
    """The address of this host on its route to the driver's store (``MASTER_ADDR``): where the
    other workers, which reach that store too, reach this one (``127.0.0.1`` when every worker
    runs on the driver's machine). Backends that start servers of their own (TensorFlow's,
    JAX's coordinator, XLA's rendezvous) advertise it."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((master, int(os.environ.get("MASTER_PORT", "1"))))  # UDP: nothing is sent
        return str(probe.getsockname()[0])
