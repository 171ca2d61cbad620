"""All-to-all on the GPUs' copy engines: peer copies through symmetric memory, no SM kernels.

Why not NCCL here (measured, docs/benchmarks.md, FLUX.1-dev 1024² on 2x H200): NCCL's all-to-all
is a kernel, and a kernel needs SMs. Ulysses issues each all-to-all just before a big GEMM meant to
hide it; the GEMM's CTAs take every SM, so NCCL's kernel waits for the GEMM to finish and nothing
overlaps (and when they do share SMs, both slow down). A copy engine is a DMA unit beside the SMs:
a peer copy over NVLink runs while a GEMM has every SM, and does not slow it.

How (the pattern of torch's own low-contention all-gather, torch.distributed._symmetric_memory):
every rank of the group maps one workspace buffer of every other rank (symmetric memory, CUDA
IPC), then for `x` of shape (size, ...), slice p going to peer p:
1. on the caller's stream: copy `x` into this rank's workspace;
2. on a side stream: barrier (every rank's workspace holds its `x`), pull slice `rank` of every
   peer's workspace into the output with plain tensor copies (cudaMemcpyAsync: copy engines),
   barrier (every rank has pulled: workspaces may be refilled), record an event;
3. funcol's wait_tensor (engines.collectives.finish) makes the caller's stream wait for that event.
Only the two barriers are kernels, one CTA each, on a high-priority stream. Exchanges on one group
share its workspace, so a new one starts after the last one ended (free in the usual start,
finish, start order).

Needs: CUDA, and every rank of the group on one host with peer access (NVLink or PCIe P2P).
On CPU the op runs the group's own all-to-all (gloo) at once: there are no copy engines, but the
compiled graphs and the waits are the same, so CPU tests cover everything but the transfers.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import Work

TRANSPORTS = ("nccl", "copy-engine")
"""How Ulysses all-to-alls travel: "nccl" = the process group's collective (NCCL on GPUs, gloo on
CPU); "copy-engine" = this module."""

_lib = torch.library.Library("ulysses_studio", "DEF")
_lib.define("copy_engine_all_to_all(Tensor x, str group_name) -> Tensor")

_side_streams: dict[int, torch.cuda.Stream] = {}
_last_exchange: dict[str, torch.cuda.Event] = {}


class _Done(Work):
    """The work handle funcol's wait_tensor waits on: an event on the side stream."""

    def __init__(self, group_name: str, event: torch.cuda.Event | None) -> None:
        super().__init__()
        self.group_name = group_name
        self.event = event

    def wait(self, timeout: timedelta = timedelta(seconds=0)) -> bool:
        if self.event is not None:
            self.event.wait()  # the current stream waits; the host does not
            if _last_exchange.get(self.group_name) is self.event:
                del _last_exchange[self.group_name]  # ordered now: the next start need not wait
        return True


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        # high priority: the barrier CTAs get the next free SM before a queued GEMM's CTAs
        _side_streams[index] = torch.cuda.Stream(device=index, priority=-1)
    return _side_streams[index]


@torch.library.impl(_lib, "copy_engine_all_to_all", "Meta")
def _all_to_all_meta(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.impl(_lib, "copy_engine_all_to_all", "CUDA")
def _all_to_all_cuda(x: torch.Tensor, group_name: str) -> torch.Tensor:
    from torch.distributed import _symmetric_memory as symm_mem

    x = x.contiguous()
    previous = _last_exchange.get(group_name)
    if previous is not None:
        # The workspace is refilled below: the last exchange on it must be over (its result was
        # not waited for, or the wait would have cleared this).
        torch.cuda.current_stream().wait_event(previous)
    # Allocated when first needed (the warm-up call, never inside a CUDA graph capture) and
    # grown if a later call is bigger: every rank makes the same calls, so they stay in step.
    workspace = symm_mem.get_symm_mem_workspace(group_name, min_size=x.numel() * x.element_size())
    rank, size = workspace.rank, workspace.world_size
    local = workspace.get_buffer(rank, x.shape, x.dtype)
    local.copy_(x)  # caller's stream: x may be freed or reused as soon as this op returns
    out = torch.empty_like(x)  # caller's stream: its memory belongs to the caller's stream
    stream = _side_stream(x.device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        workspace.barrier(channel=0)
        for step in range(size):
            peer = (rank + step) % size
            source = local if peer == rank else workspace.get_buffer(peer, x.shape, x.dtype)
            out[peer].copy_(source[rank])
        workspace.barrier(channel=1)
        event = torch.cuda.Event()
        event.record(stream)
    _last_exchange[group_name] = event
    torch._C._distributed_c10d._register_work(out, _Done(group_name, event))
    return out


@torch.library.impl(_lib, "copy_engine_all_to_all", "CPU")
def _all_to_all_cpu(x: torch.Tensor, group_name: str) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=c10d._resolve_process_group(group_name))
    torch._C._distributed_c10d._register_work(out, _Done(group_name, None))
    return out


def start(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Issue the all-to-all of `x` along dim 0 (slice i to peer i); finish it with wait_tensor."""
    return torch.ops.ulysses_studio.copy_engine_all_to_all(x, group_name)


def check_transport(transport: str, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Raise ValueError (the same on every rank, before any collective) if `transport` cannot run.

    "copy-engine" needs CUDA and the whole job on one host (torchrun's LOCAL_WORLD_SIZE equal to
    WORLD_SIZE): symmetric memory maps peers' memory through CUDA IPC, which does not cross hosts.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown all-to-all transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if transport != "copy-engine" or group is None:
        return
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"the copy-engine all-to-all runs on CUDA GPUs, not on {device.type}")
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if device.type == "cuda" and local is not None and world is not None and local != world:
        raise ValueError(
            f"the copy-engine all-to-all needs every rank on one host ({world} ranks, {local} on this "
            "host); use --all-to-all nccl across hosts"
        )


def prepare(group: dist.ProcessGroup) -> None:
    """Register `group` for symmetric memory (once, no collective; torch < 2.12 needs it)."""
    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated (and unneeded) in newer torch
            enable(group.group_name)
