"""``each_host``: one call per host at once, outcomes in order, a stuck call bounded."""

from __future__ import annotations

import threading
import time

from ddptrain.launch.fanout import each_host


def test_calls_run_at_once_and_come_back_in_order_with_errors_in_place() -> None:
    started = threading.Barrier(3, timeout=5)  # all three must be running together to pass

    def call(item: int) -> int:
        started.wait()
        if item == 1:
            raise ValueError("host 1 is down")
        return item * 10

    results = each_host(call, [0, 1, 2])
    assert results[0] == 0 and results[2] == 20
    assert isinstance(results[1], ValueError) and str(results[1]) == "host 1 is down"


def test_a_call_that_does_not_end_is_a_timeout_error_after_the_bound() -> None:
    release = threading.Event()

    def call(item: int) -> int:
        if item == 0:
            release.wait(10)
        return item

    began = time.monotonic()
    results = each_host(call, [0, 1], timeout_s=0.3, name="probe")
    took = time.monotonic() - began
    release.set()
    assert isinstance(results[0], TimeoutError) and "probe 0 did not end within 0.3 s" in str(results[0])
    assert results[1] == 1 and took < 5
