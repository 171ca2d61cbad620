"""Process groups of one run: the tensor group (NCCL on GPUs, gloo on CPU) and a CPU control group.

Environment (set by torchrun): WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Without
them, or with WORLD_SIZE=1, the run is a single plain process and nothing is initialised. The
variables a run itself sets (cuBLAS without a workspace, ...) are the entry points' to set, before
torch is imported: engines.options.run_environment.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from engines.levers.compile_teardown import drop_graph_trees, stop_compile_workers


@dataclass(kw_only=True)
class ParallelContext:
    """Where this rank runs and how it talks to the others of its group.

    A run's ranks form one group, or `replicas` equal groups of consecutive ranks (split_replicas), each
    running its own requests: rank and world_size are then this rank's place in its group and the group's
    size, and the groups below are the group's.
    """

    rank: int
    """Rank in the group (the global rank when the run is one group; 0 in a single process)."""
    world_size: int
    """Number of ranks of the group (1 in a single process)."""
    local_rank: int
    """Rank on this host; picks the GPU."""
    device: torch.device
    """Device holding this rank's tensors."""
    group: dist.ProcessGroup | None
    """Group for tensor collectives (NCCL for CUDA tensors, gloo for CPU); None in a single process."""
    control_group: dist.ProcessGroup | None
    """gloo group for CPU objects (requests, errors) from the app layer; None in a single process."""
    replica: int = 0
    """Which group this rank belongs to."""
    replicas: int = 1
    """How many groups the run's ranks form."""

    @property
    def is_distributed(self) -> bool:
        """True when the group has more than one rank."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on the group's leader (its lowest rank), which runs the group's requests; with one group,
        rank 0, which talks to the user."""
        return self.rank == 0

    @property
    def global_rank(self) -> int:
        return self.replica * self.world_size + self.rank


def cpu_group(ranks: list[int]) -> dist.ProcessGroup | None:
    """A gloo group of `ranks` (collective: every rank calls it, in the same order; not a member: no group).

    With NCCL's default group bound to a device, torch (2.11 to 2.13) has every non-member of ANY new group, gloo
    ones included, take part in an ncclCommSplit of the default group (NCCL_SPLIT_NOCOLOR), which the members of a
    gloo group never join: ranks then disagree on how many splits they made, and on 4x H200 the non-members of the
    rank-0 channels (app.ranks.groups) waited in it forever. Here the members make that empty split too, so every rank
    makes one per group. (use_local_synchronization does not help: its group names count the groups each rank
    holds, which differ between the members of a channel.)
    """
    group = dist.new_group(ranks, backend="gloo")
    default = c10d._get_default_group()
    split_source = getattr(c10d, "_get_split_source", None)  # what torch's own non-members call, as they call it
    if (dist.get_rank() in ranks and len(set(ranks)) < dist.get_world_size()
            and getattr(default, "bound_device_id", None) is not None and split_source is not None):
        source = split_source(default)
        if source is not None:
            source.perform_nocolor_split(default.bound_device_id)
    return group


def split_replicas(ctx: ParallelContext, replicas: int) -> ParallelContext:
    """This rank's group when the run's ranks form `replicas` equal groups of consecutive ranks (collective:
    every rank calls it with the same number; groups of consecutive ranks keep a group's context parallelism
    and tp inside a host, as torchrun numbers a host's ranks consecutively).

    Each group gets its own tensor group and gloo control group, created by every rank in the same order.
    """
    if replicas == 1:
        return ctx
    if replicas < 1 or ctx.world_size % replicas:
        raise ValueError(f"{ctx.world_size} ranks cannot form {replicas} equal groups")
    size = ctx.world_size // replicas
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    mine = ctx.rank // size
    groups = {}
    for replica in range(replicas):
        ranks = list(range(replica * size, (replica + 1) * size))
        groups[replica] = (dist.new_group(ranks, backend=backend), cpu_group(ranks))
    tensor_group, control_group = groups[mine]
    return ParallelContext(rank=ctx.rank % size, world_size=size, local_rank=ctx.local_rank, device=ctx.device,
                           group=tensor_group if size > 1 else None, control_group=control_group if size > 1 else None,
                           replica=mine, replicas=replicas)


def init_parallel(device: str | torch.device | None = None) -> ParallelContext:
    """Join the torchrun job (env:// rendezvous) or, without one, return a single-process context.

    Args:
        device: "cuda", "cuda:1", "cpu" or None (this rank's GPU if there is one, else CPU).
            The tensor group uses NCCL for CUDA and gloo for CPU.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {dev} requested but CUDA is not available")
        torch.cuda.set_device(dev)

    if world_size == 1 and not dist.is_initialized():
        return ParallelContext(rank=0, world_size=1, local_rank=0, device=dev, group=None, control_group=None)

    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        # device_id binds NCCL to this GPU at init, so the first collective does not guess it.
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    # A separate gloo group keeps CPU control traffic (request broadcasts, error agreement) out of
    # the tensor group's stream, so the app can talk while tensors are in flight.
    control_group = dist.new_group(backend="gloo")
    return ParallelContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=dev,
        group=dist.group.WORLD,
        control_group=control_group,
    )


TEARDOWN_SECONDS = 5.0
"""How long a rank waits for its process group's teardown before it ends without it (and says so)."""


def shutdown(ctx: ParallelContext, timeout: float = TEARDOWN_SECONDS) -> bool:
    """Tear down the process groups created by init_parallel (no-op in a single process); False where the
    teardown did not finish within `timeout` seconds (the caller's process should then end at once, with
    os._exit: its interpreter's exit would wait on the same communicators).

    Drop every CUDA graph that captured this group's collectives first: the engines' own graphs are dropped by
    Engine.release, inductor's graph trees (`+blockgraph`) here (engines.levers.compile_teardown.drop_graph_trees).
    Measured on 2x H200 (torch 2.11, NCCL 2.28), destroy_process_group() never returns while such a graph is alive,
    and 100 s after SIGKILL the rank still held its GPU memory. Graphs only reachable through reference cycles are
    collected here. Then inductor's compile workers are stopped, so that the process's exit does not wait on
    them (engines.levers.compile_teardown.stop_compile_workers), in one process too.
    """
    finished = True
    # The compile workers stop beside the teardown: each waits on other processes (the pool's, the peers').
    stopping = threading.Thread(target=stop_compile_workers, name="stop-compile-workers", daemon=True)
    stopping.start()
    drop_graph_trees()
    if ctx.is_distributed and dist.is_initialized():
        if ctx.device.type == "cuda":  # no graphs on CPU ranks: a collection there costs seconds on a busy machine
            gc.collect()
            torch.cuda.synchronize(ctx.device)
        finished = _bounded(dist.destroy_process_group, timeout)
        if not finished:
            print(f"warning: rank {ctx.global_rank}: the process group's teardown did not finish within "
                  f"{timeout:g} s; this rank ends without it", file=sys.stderr, flush=True)
    stopping.join()
    return finished


def _bounded(fn: Callable[[], object], timeout: float) -> bool:
    """Run `fn()` on a daemon thread for at most `timeout` seconds; whether it returned (an error it raises is
    printed: a teardown's failure must not hide the command's result)."""
    errors: list[BaseException] = []

    def call() -> None:
        try:
            fn()
        except BaseException as error:  # reported below, on the caller's thread
            errors.append(error)

    thread = threading.Thread(target=call, name="teardown", daemon=True)
    thread.start()
    thread.join(timeout)
    if errors:
        print(f"warning: teardown: {errors[0]}", file=sys.stderr, flush=True)
    return not thread.is_alive()
