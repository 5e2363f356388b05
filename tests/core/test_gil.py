"""gil.switching: a thread that lets the GIL go and comes back waits about the interval set, not 5 ms."""

from __future__ import annotations

import statistics
import sys
import threading
import time

from service.core import gil


def _wait_to_come_back(samples: int = 40) -> float:
    """Median ms this thread waits to take the GIL back after a blocking call, while another thread
    runs Python without pause."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.02)  # the spinner holds the GIL from here on
        waits = []
        for _ in range(samples):
            started = time.perf_counter()
            time.sleep(0)  # lets the GIL go; taking it back waits for the spinner to be asked to yield
            waits.append((time.perf_counter() - started) * 1e3)
        return statistics.median(waits)
    finally:
        stop.set()
        spinner.join()


def test_switching_sets_the_interval_and_puts_it_back() -> None:
    before = sys.getswitchinterval()
    with gil.switching(0.5):
        assert sys.getswitchinterval() == 0.0005
    assert sys.getswitchinterval() == before


def test_a_returning_thread_waits_about_the_interval() -> None:
    with gil.switching(gil.PYTHON_DEFAULT_MS):
        slow = _wait_to_come_back()
    with gil.switching(0.5):
        fast = _wait_to_come_back()
    assert slow > 3.0  # Python's 5 ms
    assert fast < 1.5
