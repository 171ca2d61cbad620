"""Ctrl-C and SIGTERM as a request to stop at the next safe point, not an exception mid-collective.

A KeyboardInterrupt raised between two collectives leaves the other ranks waiting for one that never
comes. So every rank turns SIGINT/SIGTERM into an Event; the lockstep service looks at it at its
agreement points (every denoising step and between requests) and all ranks stop there together.
A second signal raises KeyboardInterrupt at once: the way out of a stop that takes too long (a load).
Not one within DUPLICATE_SIGNAL_SECONDS of the first: a signal sent to a process tree reaches a rank
more than once (from its sender, then forwarded by torchrun; `pkill`, or a service manager stopping
every process of a server), and those copies are the same request to stop cleanly.

SIGTERM is also how torchrun tells the surviving ranks that a rank died, and a rank may then be
stuck in a collective with the dead one, where Python never runs a signal handler (the main thread
is inside C++) and torchrun would SIGKILL it 30 s later with nothing said. So a watchdog thread
hears SIGTERM through the signal wakeup fd (written by the C-level handler, whatever the main thread
is doing); if the block has not ended SIGTERM_GRACE_SECONDS later, it runs the stop's abandon
callback (fail the waiting clients, name the lost rank, clean up), prints the one error line and
ends the process with os._exit(1).

Temporary folders (temporary_folder) carry their process's pid, so that the next start can remove
the ones a SIGKILL left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SIGTERM_GRACE_SECONDS = 1.5
"""How long the main thread has to end by itself after SIGTERM before the watchdog ends the process."""
DUPLICATE_SIGNAL_SECONDS = 0.25
"""Signals within this long of the first are copies of it (a process tree's), not a second Ctrl-C."""
_ENDING = threading.Lock()
"""Held by the one thread that ends a process in end_process (the main thread or the watchdog)."""


class StopRequest(threading.Event):
    """Set by SIGINT or SIGTERM. `abandon` gives the message the process ends with when the main thread
    does not end by itself after SIGTERM; it may also tell waiting clients (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.abandon: Callable[[], str] = lambda: "stopped by SIGTERM, and still busy after the grace period"


def end_process(message: str) -> None:
    """Print "error: the job ends: MESSAGE", flush, and end the process now with status 1.

    For a run that lost a rank: the process group cannot be torn down while a collective with a dead
    peer is pending (its gloo threads never return), so the interpreter's normal exit could hang.
    Only the first caller prints; another one waits here for the exit.
    """
    _ENDING.acquire()
    print(f"error: the job ends: {message}", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


@contextmanager
def stop_on_signals(*, grace: float = SIGTERM_GRACE_SECONDS) -> Iterator[StopRequest]:
    """A StopRequest set by SIGINT or SIGTERM while the block runs (a second signal, DUPLICATE_SIGNAL_SECONDS or
    more after the first, raises KeyboardInterrupt), with the SIGTERM watchdog; the previous handlers come back
    after.

    Only the main thread may install signal handlers; elsewhere the event is returned unconnected.
    """
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    stopped_at = float("-inf")  # when a signal set `stop` (set otherwise: long before)

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopped_at
        if not stop.is_set():
            stopped_at = time.monotonic()
            stop.set()
        elif time.monotonic() - stopped_at >= DUPLICATE_SIGNAL_SECONDS:
            raise KeyboardInterrupt

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    done = threading.Event()
    watchdog = threading.Thread(target=_watch, args=(read_fd, stop, done, grace), name="sigterm-watchdog",
                                daemon=True)
    previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watchdog.start()
    try:
        yield stop
    finally:
        done.set()
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.write(write_fd, b"\0")  # wakes the watchdog, which sees `done` and leaves
        watchdog.join()
        os.close(write_fd)
        os.close(read_fd)


def _watch(read_fd: int, stop: StopRequest, done: threading.Event, grace: float) -> None:
    """The watchdog thread: after SIGTERM, end the process if the block is still running after `grace` s."""
    while not done.is_set():
        received = os.read(read_fd, 64)
        if int(signal.SIGTERM) in received and not done.is_set():
            if done.wait(grace):
                return
            try:
                message = stop.abandon()
            except Exception as error:  # the process must end all the same
                message = f"stopped by SIGTERM; telling the clients failed: {error!r}"
            end_process(message)


def temporary_folder(prefix: str, parent: str | Path | None = None) -> Path:
    """A new folder PARENT/PREFIX-<pid>-XXXX (PARENT: the system's temporary folder unless given) for this
    process to remove when it ends; first removes the ones of earlier processes that are gone (a SIGKILL
    leaves its folder behind: nothing runs to remove it)."""
    parent = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_folders(prefix, parent)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=parent))


def remove_stale_folders(prefix: str, parent: Path) -> None:
    """Remove the temporary_folder(prefix) folders in `parent` whose process no longer exists."""
    for folder in parent.glob(f"{prefix}-*-*"):
        owner = folder.name[len(prefix) + 1:].split("-", 1)[0]
        if owner.isdigit() and not process_running(int(owner)) and folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)


def process_running(pid: int) -> bool:
    """Whether process `pid` runs: not gone, and not a zombie (exited, not yet reaped by its parent)."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
