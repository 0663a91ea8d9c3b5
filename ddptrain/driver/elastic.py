"""An elastic run's watch on the hosts it left out: do they answer again?

While an attempt is healthy, a :class:`HostWatch` looks at each host the run left out (lost in
an earlier attempt) every ``ScalingConfig.elastic_resize_monitor_interval_s``: a TCP connect to
its SSH port within the SSH connect timeout. The attempt polls :meth:`HostWatch.back`; once a
host answers, it stops at the next committed checkpoint and the controller starts a larger
group (a resize, not a failure). The watch decides nothing itself.
"""

from __future__ import annotations

import logging
import socket
import threading

from ddptrain import _env
from ddptrain.launch.hosts import HostSpec

__all__ = ["HostWatch", "answering"]

_logger = logging.getLogger(__name__)


def answering(hosts: list[HostSpec], timeout_s: float) -> list[str]:
    """The names of ``hosts`` whose SSH port accepts a connection within ``timeout_s``."""
    return [h.name for h in hosts if _answers(h, timeout_s)]


def _answers(host: HostSpec, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host.address or host.name, host.port or 22), timeout=timeout_s):
            return True
    except OSError:
        return False


class HostWatch:
    """Looks at the hosts ``left_out`` every ``interval_s`` in a thread of its own.

    Args:
        left_out: The hosts to watch.
        interval_s: Between two looks (the first after one interval).
    """

    def __init__(self, left_out: list[HostSpec], interval_s: float) -> None:
        self.left_out = left_out
        self.interval_s = interval_s
        self._back: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HostWatch:
        if self.left_out and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ddptrain-host-watch", daemon=True)
            self._thread.start()
        return self

    def back(self) -> list[str]:
        """The hosts left out that answered at the last look (empty until one does)."""
        return list(self._back)

    def stop(self) -> None:
        """Stop looking (safe to call twice; waits at most one connect timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_env.ssh_connect_timeout_s() + 1.0)
            self._thread = None

    def _run(self) -> None:
        timeout_s = min(_env.ssh_connect_timeout_s(), self.interval_s)
        while not self._stop.wait(self.interval_s):
            back = [h.name for h in self.left_out if _answers(h, timeout_s)]
            if back:
                _logger.info("ddptrain: host(s) %s answer again", ", ".join(back))
                self._back = back
                return
