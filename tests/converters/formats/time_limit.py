"""A wall-clock limit for one block of a hostile-input test: SIGALRM raises TimeoutError inside it (main thread)."""

from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def time_limit(seconds: float, what: str = "the block"):
    """Raises TimeoutError(f"{what} took over {seconds} s") in the block once `seconds` of wall time have passed;
    the previous SIGALRM handler and a cleared interval timer are restored after."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"{what} took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
