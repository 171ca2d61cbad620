"""Ctrl-C and SIGTERM as a request to stop at the next safe point, not an exception mid-collective.

A KeyboardInterrupt raised between two collectives leaves the other ranks waiting for one that never
comes. So every rank turns SIGINT/SIGTERM into an Event; the lockstep service looks at it at its
agreement points (every denoising step and between requests) and all ranks stop there together.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An Event set by SIGINT or SIGTERM while the block runs; the previous handlers come back after.

    Only the main thread may install signal handlers; elsewhere the Event is returned unconnected.
    """
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
