"""Ctrl-C and SIGTERM as a request to stop at the next safe point, not an exception mid-collective.

A KeyboardInterrupt raised between two collectives leaves the other ranks waiting for one that never
comes. So every rank turns SIGINT/SIGTERM into an Event; the lockstep service looks at it at its
agreement points (every denoising step and between requests) and all ranks stop there together.
A second signal raises KeyboardInterrupt at once: the way out of a stop that takes too long (a load).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An Event set by SIGINT or SIGTERM while the block runs (a second signal raises KeyboardInterrupt);
    the previous handlers come back after.

    Only the main thread may install signal handlers; elsewhere the Event is returned unconnected.
    """
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request_stop(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
