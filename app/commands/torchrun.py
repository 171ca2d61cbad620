"""torchrun (torch.distributed.run, same arguments) without the second its interpreter spends ending.

Once its ranks are gone, torchrun's process still takes about 1 s to exit: the interpreter's last garbage
collection over torch's objects (py-spy shows gc_collect_main, after the atexit handlers). Measured with
two trivial ranks on the 2-core CPU machine: 1.06 s from torchrun's failure report to its exit, 0.06 s
when it ends with os._exit. Every Ctrl-C and every failed run of `launch` and `build` waited through it.
So this runs torchrun's own main() and then ends the process with os._exit, once the output is flushed:
by then torchrun has stopped its ranks and closed its rendezvous store, and nothing else is left to do.

A failed run prints torchrun's failure table (which rank, its exit code or signal, when) without the
Python traceback around it; the launcher's next line says that a rank failed.

torchrun keeps its ranks' error files in a log folder, by default a new tempfile.mkdtemp("torchelastic_")
folder per run (torch.distributed.elastic's DefaultLogsSpecs) that nothing ever removes: one more in the
temporary folder for every launch. So its log folder is one of this process's (app.ranks.stopping.temporary_folder),
removed once torchrun's main() has returned or raised: after a normal end, a failed rank, an interrupt.
A torchrun killed outright (SIGKILL) cannot remove its own; the launcher removes it once torchrun has exited
(remove_ended_logs), and otherwise the next run does. A --log-dir given on the command line is used instead.

On one host the rendezvous port is one the launcher found free (free_port); torchrun binds it a
second or two later, once torch is imported, and another program may have taken it in between. Then torchrun's
store fails with EADDRINUSE before any rank has started, and this runs torchrun again on another free port (up to
PORT_ATTEMPTS times). On several hosts the port is the user's (--rdzv-endpoint), so host 0 says it is taken instead.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys
import tempfile
import traceback
from pathlib import Path

from app.ranks.stopping import remove_stale_folders, temporary_folder

PORT_ATTEMPTS = 5
"""Ports tried on one host before a rendezvous port taken by another program ends the run."""

LOGS_PREFIX = "ulysses-studio-torchrun"
"""torchrun's log folders: LOGS_PREFIX-<pid of its process>-XXXX in the temporary folder."""


def run(argv: list[str] | None = None) -> int:
    """torchrun's exit status: 0, 1 where a rank failed, argparse's 2 for a bad command line.
    `argv`: torchrun's arguments (default: this process's)."""
    argv = sys.argv[1:] if argv is None else argv
    log_dir = temporary_folder(LOGS_PREFIX)
    try:
        # First, so that a --log-dir of the caller's (parsed later) wins, and before the script and its arguments.
        return _torchrun([f"--log-dir={log_dir}", *argv])
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def free_port(avoid: int | None = None) -> int:
    """A TCP port nobody listens on right now (for torchrun's rendezvous), below the kernel's ephemeral range, and
    not `avoid` (the port `serve` will listen on, free until its rank 0 binds it, seconds later).

    A port the kernel hands out itself (bind to port 0) is one of its ephemeral ports, which it also gives to the
    outgoing end of every connection: between this choice and the listener's bind, any connection on the machine
    (gloo's, a rank's to the store, a browser's) may take it. Below that range only another program's explicit
    choice can. Where no such port is found, any free one."""
    low = _ephemeral_low()
    for _ in range(64 if low > 2048 else 0):
        port = random.randrange(max(1024, low // 2), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            if port != avoid:
                return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            if probe.getsockname()[1] != avoid:
                return probe.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's ip_local_port_range; its default elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def remove_ended_logs() -> None:
    """Remove the log folders of torchrun processes that have ended without removing them (killed outright)."""
    remove_stale_folders(LOGS_PREFIX, Path(tempfile.gettempdir()))


def _torchrun(argv: list[str]) -> int:
    # torch here, not at the module's top: the launcher imports this module for remove_ended_logs once its ranks have
    # ended, and torch's import (1.5 s on a 2-core CPU) would come between their last output and its exit.
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                torchrun_main(argv)
                break
            except DistNetworkError as error:  # raised by the rendezvous store's bind, before any rank starts
                if "EADDRINUSE" not in str(error):
                    raise
                port = _option(argv, "--master-port")
                if _option(argv, "--nnodes") != "1":
                    print(f"error: the rendezvous port {port} is taken on this host by another program: give "
                          "--rdzv-endpoint a port that is free here", file=sys.stderr)
                    return 1
                if attempt == PORT_ATTEMPTS:
                    raise
                argv = [option for option in argv if not option.startswith("--master-port=")]
                argv.insert(0, f"--master-port={free_port(avoid=_serve_port(argv))}")
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            return exit.code or 0
        print(exit.code, file=sys.stderr)
        return 1
    except ChildFailedError as error:
        print(error, file=sys.stderr)
        return 1
    except SignalException as error:
        # torchrun itself got a stop signal (one sent to every process of the job: pkill, a service manager
        # stopping a server): it has passed it to its ranks and waited for them, which stop as they do on Ctrl-C
        print(f"torchrun: stopped by {error.sigval.name}; its ranks were told to stop", file=sys.stderr)
        return 128 + error.sigval
    except BaseException:  # reported as the interpreter would, then the same fast exit
        traceback.print_exc()
        return 1
    return 0


def _option(argv: list[str], name: str) -> str | None:
    """The value of `name`=VALUE in a torchrun command line (the launcher writes each option so), or None."""
    return next((option.split("=", 1)[1] for option in argv if option.startswith(f"{name}=")), None)


def _serve_port(argv: list[str]) -> int | None:
    """The port of `-m app serve ... --port N` in a torchrun command line, or None."""
    tail = argv[argv.index("serve") + 1:] if "serve" in argv else []
    for option, value in zip(tail, [*tail[1:], ""]):
        if option.startswith("--port="):
            option, value = "--port", option.removeprefix("--port=")
        if option == "--port" and value.isdigit():
            return int(value)
    return None


if __name__ == "__main__":
    status = run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
