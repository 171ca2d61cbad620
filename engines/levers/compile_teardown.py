"""What torch.compile leaves in a process that would hold up its end: inductor's CUDA graph trees and its
compile-worker pools. engines.parallel.distributed.shutdown drops both when a rank tears down; both are no-ops in a
process that compiled nothing (they read inductor's modules only where already imported).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path


def drop_graph_trees() -> None:
    """Free inductor's CUDA graph trees of this thread: the graphs of `+blockgraph` engines (a graph per compiled
    block) and the memory pool they replay in; a no-op where none were made.

    The trees live in inductor's thread-local state, not in the Engine, so Engine.release does not reach them, and
    they hold every block's graph (each with the NCCL kernels it captured) as long as the process lives. A graph
    that captured NCCL kernels keeps its communicator from being destroyed: on 2x H200 (torch 2.11) every
    `generate --cache` (whose default engine is `+blockgraph`) wrote its image and then sat in
    destroy_process_group() until killed. Call it on the thread that ran the engines (every rank's main thread)."""
    module = sys.modules.get("torch._inductor.cudagraph_trees")
    if module is not None:
        module.reset_cudagraph_trees()


def stop_compile_workers(wait_s: float = 2.0) -> None:
    """Kill inductor's compile-worker pools now, each pool's process and its workers (SIGKILL), waiting at most
    `wait_s` for them to be gone; a no-op where nothing was compiled. For a process that is ending: nothing is left
    to compile, and asking a pool to stop waits for its workers.

    A pool's own shutdown waits for every worker, and workers still starting (each imports torch) take seconds:
    measured on 4x H200 (torch 2.11), a cold 1-GPU `generate --cache` ended 4.4 s after its video, against 0.3 s on
    the same command warm. torch 2.11's pool can also never end after a cold start (pytorch/pytorch#162199): a cold
    `generate` of tiny-flux on 2x H200 was still in that shutdown 39 s after its image.
    engines.parallel.distributed.shutdown calls this when a process tears down; the interpreter's exit then finds the
    pools stopped."""
    module = sys.modules.get("torch._inductor.async_compile")
    for pool in list(getattr(module, "_pool_set", ())):
        process = getattr(pool, "process", None)  # inductor's SubprocPool: the process its workers run under
        if process is None:  # a plain executor (the fork start method): its workers are this process's children
            pool.shutdown(wait=False, cancel_futures=True)
            continue
        pool.running = False  # its reading thread then ends without a warning, and its own shutdown does nothing
        workers = _children(process.pid)
        for pid in (process.pid, *workers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + wait_s
        while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.02)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc; [] elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, waiting to be reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
