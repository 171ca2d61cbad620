"""All-to-all on the GPUs' copy engines: peer copies through symmetric memory, no SM kernels.

Why not NCCL here (measured, docs/benchmarks.md, FLUX.1-dev 1024² on 2x H200): NCCL's all-to-all
is a kernel, and a kernel needs SMs. Ulysses issues each all-to-all just before a big GEMM meant to
hide it; the GEMM's CTAs take every SM, so NCCL's kernel waits for the GEMM to finish and nothing
overlaps (and when they do share SMs, both slow down). A copy engine is a DMA unit beside the SMs:
a peer copy over NVLink runs while a GEMM has every SM, and does not slow it.

How: every rank of the group maps one buffer of every other rank (torch symmetric memory, CUDA
IPC); the buffer starts with flags, then data. For `x` of shape (size, ...), slice p going to peer p:
1. caller's stream: wait until every peer has pulled the previous exchange out of this rank's
   buffer (its "done" flag), then copy `x` into it;
2. side stream: set "ready" in every peer's flags, wait for every peer's "ready", pull slice
   `rank` of every peer's data into the output, set "done" in every peer's flags, copy this rank's
   own slice, record an event;
3. funcol's wait_tensor (engines.collectives.finish) makes the caller's stream wait for that event.
Copies are plain tensor copies (cudaMemcpyAsync: copy engines; flags are 4-byte copies too) and
waits are cuStreamWaitValue32 (the GPU's front end polls memory): nothing runs on an SM. That
matters: torch's own low-contention collectives synchronize with one-CTA barrier kernels, and
measured here a barrier queued beside a GEMM waits for the whole GEMM, which ends the overlap.
Everything is stream-ordered, so it records into CUDA graphs; the flags end every exchange as they
began it, so graphs replay.

Measured (docs/benchmarks.md, 2x H200): bit-identical to NCCL; 0.1-2.2% faster per FLUX step at
1024², level at 2048² and on Cosmos-14B. The pull still waits for both ranks to have staged their
data, so rank skew pushes it past the GEMM; the benchmarks note says what would hide more.

Needs: CUDA, and every rank of the group on one host with peer access (NVLink or PCIe P2P).
Unlike NCCL there is no watchdog: if a rank dies inside a step, the others' streams wait on its
flags until the job is stopped (NCCL, the default transport, aborts after its timeout).
On CPU the op runs the group's own all-to-all (gloo) at once: there are no copy engines, but the
compiled graphs and the waits are the same, so CPU tests cover everything but the transfers.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from collections.abc import Callable
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

FLAGS_BYTES = 4096
"""Head of each rank's symmetric buffer: int32 flags "ready[peer]" at 0 and "done[peer]" at
FLAGS_BYTES // 2 (an 8-GPU host uses 32 bytes of each); the exchanged data follows."""
CU_STREAM_WAIT_VALUE_EQ = 0x1

# Per-process state: the op is called from compiled graphs with only a tensor and a group name, so
# what lasts between calls (one side stream per GPU, one buffer per group) is kept here, as torch
# keeps its own symmetric-memory workspaces.
_side_streams: dict[int, torch.cuda.Stream] = {}
_exchanges: dict[str, _Exchange] = {}


class _Done(Work):
    """The work handle funcol's wait_tensor waits on: an event on the side stream."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        super().__init__()
        self.event = event

    def wait(self, timeout: timedelta = timedelta(seconds=0)) -> bool:
        if self.event is not None:
            self.event.wait()  # the current stream waits; the host does not
        return True


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        # only copies and waits run on it; priority as measured
        _side_streams[index] = torch.cuda.Stream(device=index, priority=-1)
    return _side_streams[index]


@functools.cache
def _stream_wait_value32() -> Callable[..., int]:
    """The CUDA driver's cuStreamWaitValue32 (torch does not expose it)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    function = getattr(libcuda, "cuStreamWaitValue32_v2", None) or libcuda.cuStreamWaitValue32
    function.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _wait_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """`stream` waits until the int32 at `address` equals `value` (cuStreamWaitValue32: the GPU's
    front end polls; no kernel, no SM)."""
    result = _stream_wait_value32()(stream.cuda_stream, address, value, CU_STREAM_WAIT_VALUE_EQ)
    if result != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {result}")


class _Exchange:
    """One group's symmetric buffer (flags + data) and the tensors that name its parts."""

    def __init__(self, group_name: str, data_bytes: int, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = group_name
        group = c10d._resolve_process_group(group_name)
        self.buffer = symm_mem.empty(FLAGS_BYTES + data_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group_name)  # collective
        self.rank, self.size, self.data_bytes = self.handle.rank, self.handle.world_size, data_bytes
        if self.size * 4 > FLAGS_BYTES // 2:
            raise ValueError(f"copy-engine all-to-all supports up to {FLAGS_BYTES // 8} ranks per group")
        flags = self.buffer[:FLAGS_BYTES].view(torch.int32)
        flags.zero_()
        flags[FLAGS_BYTES // 8: FLAGS_BYTES // 8 + self.size] = 1  # done[peer] = 1: nothing to wait for
        self.one = torch.ones(1, dtype=torch.int32, device=device)
        self.zero = torch.zeros(1, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's flags are set before anyone signals

    def flag(self, rank: int, kind: str, peer: int) -> torch.Tensor:
        """rank's flag `kind` ("ready" or "done") about `peer`, as a 1-element tensor (maybe remote)."""
        offset = (0 if kind == "ready" else FLAGS_BYTES // 2) + 4 * peer
        return self.handle.get_buffer(rank, (1,), torch.int32, offset // 4)

    def data(self, rank: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """rank's data area seen as `shape`/`dtype` (maybe remote)."""
        return self.handle.get_buffer(rank, shape, dtype, FLAGS_BYTES // dtype.itemsize)

    def release(self) -> None:
        torch.cuda.synchronize(self.buffer.device)
        dist.barrier(group=c10d._resolve_process_group(self.group_name))


def _exchange(group_name: str, nbytes: int, device: torch.device) -> _Exchange:
    exchange = _exchanges.get(group_name)
    if exchange is None or exchange.data_bytes < nbytes:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("copy-engine all-to-all: its buffer must grow, which cannot happen during "
                               "CUDA graph capture; run the shape once before capturing")
        if exchange is not None:
            exchange.release()  # every rank is past its last use of the old buffer
        size = max(nbytes, exchange.data_bytes if exchange is not None else 0)
        exchange = _exchanges[group_name] = _Exchange(group_name, size, device)
    return exchange


@torch.library.impl(_lib, "copy_engine_all_to_all", "Meta")
def _all_to_all_meta(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.impl(_lib, "copy_engine_all_to_all", "CUDA")
def _all_to_all_cuda(x: torch.Tensor, group_name: str) -> torch.Tensor:
    x = x.contiguous()
    # Allocated at the first call (the warm-up, never inside a CUDA graph capture), grown if a later
    # call is bigger: every rank makes the same calls, so they stay in step.
    ex = _exchange(group_name, x.numel() * x.element_size(), x.device)
    rank, size = ex.rank, ex.size
    compute = torch.cuda.current_stream()
    peers = [p for p in range(size) if p != rank]
    # 1. (caller's stream) every peer has pulled the last exchange out of this buffer; refill it.
    for p in peers:
        mine = ex.flag(rank, "done", p)
        _wait_value(compute, mine.data_ptr(), 1)
        mine.copy_(ex.zero)
    local = ex.data(rank, x.shape, x.dtype)
    local.copy_(x)  # on the caller's stream: x may be freed or reused as soon as this op returns
    out = torch.empty_like(x)  # on the caller's stream: its memory belongs to that stream
    # 2. (side stream) tell every peer the data is there, wait for theirs, pull, tell them we are done.
    stream = _side_stream(x.device)
    stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        for p in peers:
            ex.flag(p, "ready", rank).copy_(ex.one)
        for p in peers:
            mine = ex.flag(rank, "ready", p)
            _wait_value(stream, mine.data_ptr(), 1)
            mine.copy_(ex.zero)
        for p in peers:  # over NVLink first: the longest copies, and they free the peers' buffers
            out[p].copy_(ex.data(p, x.shape, x.dtype)[rank])
        for p in peers:
            ex.flag(p, "done", rank).copy_(ex.one)
        out[rank].copy_(local[rank])
        event = torch.cuda.Event()
        event.record(stream)
    torch._C._distributed_c10d._register_work(out, _Done(event))
    return out


@torch.library.impl(_lib, "copy_engine_all_to_all", "CPU")
def _all_to_all_cpu(x: torch.Tensor, group_name: str) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=c10d._resolve_process_group(group_name))
    torch._C._distributed_c10d._register_work(out, _Done(None))
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
