"""A hang becomes a test failure: SIGALRM raises TimeoutError in the main thread after `seconds`."""

from __future__ import annotations

import signal
from contextlib import contextmanager


@contextmanager
def no_hang(seconds: int):
    def hung(*_):
        raise TimeoutError(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
