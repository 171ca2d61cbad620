"""Context-parallel exchanges on the GPUs' copy engines: peer copies, no SM kernels.

Three exchanges: the Ulysses all-to-all, the ring pass of K/V (to group rank + 1, from rank - 1),
and the all-gather of K/V that FLUX's blocks use with 2 ring ranks (engines.parallel.attention.GatherAttention).
The all-gather lands every rank's K/V in the receiver's exchange buffer, where the attention reads
them (gathered_kv): no copy-out.

Why not NCCL here (measured, docs/benchmarks.md, FLUX.1-dev 1024² on 2x H200): NCCL's collectives
are kernels, and a kernel needs SMs. An exchange is issued just before the compute meant to hide it
(a GEMM, or ring attention's local half); that compute's CTAs take every SM, so NCCL's kernel waits
for it to finish and nothing overlaps (and when they do share SMs, both slow down). A copy engine is
a DMA unit beside the SMs: a peer copy over NVLink runs while a GEMM has every SM.

How: every rank of the group maps one buffer of every other rank (torch symmetric memory, CUDA
IPC); the buffer starts with flags, then one data slot per peer. On a side stream, once the
caller's stream has produced `x`:
1. push: for each peer, wait until that peer has copied out what this rank last wrote there (its
   "free" flag), write the peer's slice of `x` into this rank's slot of the peer's buffer, then set
   the peer's "ready" flag; meanwhile, on a second side stream, copy this rank's own slice locally;
2. collect: for each peer, wait for its "ready" flag, copy its slot out into the result; then set
   "free" in every peer's flags, and record an event;
3. funcol's wait_tensor (engines.parallel.collectives.finish) makes the caller's stream wait for that event.
The K/V all-gather differs in one step: nothing is copied out. Peers write straight into the
gathered layout of the receiver's buffer, the attention reads it there (gathered_kv), and the
receiver sets the peers' "free" flags at its next gather, once its stream has passed that attention.
Its keys may go ahead of its values (FLUX's double blocks: they travel while the values are
projected); the peers then signal "keys_ready" for them, and "ready" for the values.
In FLUX at 1024² on 2 GPUs the copy-outs were 114 copies of 14 MB a step per rank, run as
`memcpy128` kernels inside the CUDA graph on one of the ranks (docs/benchmarks.md).
Each rank pushes as soon as it is ready (no rank waits for the slowest to start), and the caller's
stream does no copy at all. Copies are plain tensor copies (cudaMemcpyAsync: copy engines; a
peer's flag is set by a 4-byte peer copy), waits are cuStreamWaitValue32 (the GPU's front end
polls memory) and this rank's own flags are reset with cuStreamWriteValue32. So no SM is needed
(except that inside CUDA graphs the driver may run a local copy-out as a kernel). That matters:
torch's own low-contention collectives synchronize with one-CTA barrier kernels, and measured here
a barrier queued beside a GEMM waits for the whole GEMM, which ends the overlap. Everything is
stream-ordered, so it records into CUDA graphs; the flags end every exchange as they began it, so
graphs replay.

State: the buffers and side streams belong to a CopyEngineTransport, one per ParallelMesh using
this transport (engines.parallel.mesh.build_mesh makes it, ParallelMesh.close() frees it); the ops, which
traced code calls with only a group name, find it through the one module-level lookup
(_TRANSPORTS_BY_GROUP). A buffer replaced by a bigger one is freed at once, unless a CUDA graph was
captured while it was in use: that graph may replay, so it stays until the mesh closes
(replace_exchange; a group that two open meshes share, until both have).

Measured: see docs/benchmarks.md (bit-identical to NCCL on 2x H200; step times there).

Needs: CUDA, and every rank of the group on one host with peer access (NVLink or PCIe P2P).
Unlike NCCL there is no watchdog: if a rank dies inside a step, the others' streams wait on its
flags until the job is stopped (NCCL, the default transport, aborts after its timeout).
On CPU the ops run the group's own all-to-all (gloo) at once: there are no copy engines, but the
compiled graphs and the waits are the same, so CPU tests cover everything but the transfers.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import Work

from engines.options import TRANSPORTS, check_choice

_lib = torch.library.Library("ulysses_studio", "DEF")
_lib.define("copy_engine_all_to_all(Tensor x, str group_name) -> Tensor")
_lib.define("copy_engine_shift(Tensor x, str group_name) -> Tensor")
_lib.define("copy_engine_gather_kv(Tensor[] keys, Tensor[] values, str group_name, int size, "
            "Tensor? keys_sent=None) -> Tensor")

FLAGS_BYTES = 4096
"""Head of each rank's symmetric buffer: int32 flags "ready[peer]" at 0, "keys_ready[peer]" at
FLAGS_BYTES // 4 and "free[peer]" at FLAGS_BYTES // 2 (an 8-GPU host uses 32 bytes of each), and at
3 * FLAGS_BYTES // 4 an int32 1, the source of every flag this rank sets; the exchanged data follows."""
FLAG_OFFSETS = {"ready": 0, "keys_ready": FLAGS_BYTES // 4, "free": FLAGS_BYTES // 2}
ONE_OFFSET = 3 * FLAGS_BYTES // 4
CU_STREAM_WAIT_VALUE_EQ = 0x1

_TRANSPORTS_BY_GROUP: dict[str, CopyEngineTransport] = {}
"""The only module state: group name -> the CopyEngineTransport that holds that group's exchanges.
The ops are called from compiled graphs with only a tensor and a group name (traced code carries
strings, not objects), so they find their buffers and streams from the name, as torch's own
symmetric memory finds its workspaces. Entries come and go with the meshes: build_mesh registers
(CopyEngineTransport()), ParallelMesh.close() unregisters."""


class _Done(Work):
    """The work handle funcol's wait_tensor waits on: an event on the side stream. It also holds
    the inputs the side stream reads, so that their memory is not reused before the caller waits."""

    def __init__(self, event: torch.cuda.Event | None, keep: object = None) -> None:
        super().__init__()
        self.event = event
        self.keep = keep

    def wait(self, timeout: timedelta = timedelta(seconds=0)) -> bool:
        if self.event is not None:
            self.event.wait()  # the current stream waits; the host does not
        return True


@functools.cache
def _stream_memory_op(name: str) -> Callable[..., int]:
    """The CUDA driver's cuStreamWaitValue32 or cuStreamWriteValue32 (torch exposes neither)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    function = getattr(libcuda, f"{name}_v2", None) or getattr(libcuda, name)
    function.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _wait_value(stream: torch.cuda.Stream, flag: torch.Tensor, value: int) -> None:
    """`stream` waits until the int32 `flag` equals `value` (cuStreamWaitValue32: the GPU's front
    end polls; no kernel, no SM)."""
    result = _stream_memory_op("cuStreamWaitValue32")(stream.cuda_stream, flag.data_ptr(), value,
                                                      CU_STREAM_WAIT_VALUE_EQ)
    if result != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {result}")


def _write_value(stream: torch.cuda.Stream, flag: torch.Tensor, value: int) -> None:
    """`stream` sets the int32 `flag` (this GPU's memory) to `value` (cuStreamWriteValue32: the
    front end writes it). A 4-byte copy would do the same, but inside a CUDA graph the driver runs
    a same-device copy as a kernel, which waits for SMs (measured: ~100 us behind an attention
    kernel, delaying the transfer it gates)."""
    result = _stream_memory_op("cuStreamWriteValue32")(stream.cuda_stream, flag.data_ptr(), value, 0)
    if result != 0:
        raise RuntimeError(f"cuStreamWriteValue32 failed with CUresult {result}")


class _Exchange:
    """One group's symmetric buffer (flags + data) and the tensors that name its parts.

    Data area, as a "slots" exchange (all-to-all, ring pass): `size` slots of one exchange's slice,
    slot p written by peer p (this rank's own slot is unused); as a "gather" exchange (the K/V
    all-gather): the gathered tensor itself, every rank's piece in place. Flags, int32, each
    written by the peer it names: ready[p] ("p has written its part of this buffer"),
    keys_ready[p] (the K/V all-gather with keys ahead: "p has written its keys"), free[p] ("p is
    done with what this rank wrote into p's buffer: this rank may write there again"); offsets in
    FLAG_OFFSETS.
    """

    def __init__(self, group_name: str, data_bytes: int, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = group_name
        group = c10d._resolve_process_group(group_name)
        self.buffer = symm_mem.empty(FLAGS_BYTES + data_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group_name)  # collective
        self.rank, self.size, self.data_bytes = self.handle.rank, self.handle.world_size, data_bytes
        if self.size * 4 > FLAGS_BYTES // 4:
            raise ValueError(f"copy-engine exchanges support up to {FLAGS_BYTES // 16} ranks per group")
        flags = self.buffer[:FLAGS_BYTES].view(torch.int32)
        flags.zero_()
        free = FLAG_OFFSETS["free"] // 4
        flags[free:free + self.size] = 1  # free[peer] = 1: nothing to wait for
        self.one = flags[ONE_OFFSET // 4:ONE_OFFSET // 4 + 1]  # the source of the peers' flag writes
        self.one.fill_(1)
        # a "gather" exchange, once used: the shape and dtype of the data being read where it landed
        self.landed: tuple[tuple[int, ...], torch.dtype] | None = None
        # a "gather" exchange whose keys went ahead of their values, which have not come yet
        self.keys_sent = False
        # used during a CUDA graph capture: that graph holds its addresses (and the peers')
        self.captured = False
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's flags are set before anyone writes

    def flag(self, rank: int, kind: str, peer: int) -> torch.Tensor:
        """rank's flag `kind` ("ready", "keys_ready" or "free") about `peer`, as a 1-element tensor (maybe remote)."""
        offset = FLAG_OFFSETS[kind] + 4 * peer
        return self.handle.get_buffer(rank, (1,), torch.int32, offset // 4)

    def slot(self, rank: int, writer: int, like: torch.Tensor) -> torch.Tensor:
        """The slot of rank's buffer that `writer` fills, seen with `like`'s shape and dtype (maybe remote)."""
        offset = FLAGS_BYTES + writer * like.numel() * like.element_size()
        return self.handle.get_buffer(rank, like.shape, like.dtype, offset // like.element_size())

    def take(self, stream: torch.cuda.Stream, kind: str, peer: int) -> None:
        """`stream` waits until this rank's flag `kind` about `peer` is set, then clears it."""
        flag = self.flag(self.rank, kind, peer)
        _wait_value(stream, flag, 1)
        _write_value(stream, flag, 0)

    def give(self, peer: int, kind: str) -> None:
        """Set peer's flag `kind` about this rank (a 4-byte peer copy on the current stream)."""
        self.flag(peer, kind, self.rank).copy_(self.one)

    def gathered(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """rank's data area seen as one tensor of `shape` and `dtype` (maybe remote)."""
        return self.handle.get_buffer(rank, shape, dtype, FLAGS_BYTES // dtype.itemsize)

    def release(self) -> None:
        """Return once every rank of the group is past its last use of this buffer (collective)."""
        torch.cuda.synchronize(self.buffer.device)
        dist.barrier(group=c10d._resolve_process_group(self.group_name))

    def free(self) -> None:
        """release(), then drop the buffer and its view of the peers' buffers: these were the last
        references, so the symmetric-memory allocator takes the memory back (collective)."""
        self.release()
        del self.buffer, self.handle, self.one


def _outside_graph_pools(make: Callable[[], _Exchange], device: torch.device) -> _Exchange:
    """make() on a thread of its own, so that its memory is not a CUDA graph's. An exchange is made at an engine's
    first call, and with a CUDA graph per block (+blockgraph) that call is inductor's graph-trees warm-up, which puts
    every allocation of the calling thread into the graphs' memory pool: the exchange's tensors (and those that
    symmetric memory's rendezvous allocates) would live on there, and the trees refuse to record a graph while
    memory of their pool is held by anything but a graph's outputs ("tensors in the cudagraph pool not tracked as
    outputs"). The caller waits for the thread: nothing runs beside it."""
    made: list[_Exchange] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # this thread's device
            made.append(make())
        except BaseException as error:  # raised again in the caller
            failed.append(error)

    thread = threading.Thread(target=run, name="copy-engine-exchange")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]


def replace_exchange(old: _Exchange | None, nbytes: int, capturing: bool) -> str:
    """What a group's exchange of one kind needs before a call moving `nbytes`: "use" the current
    one (`old`, big enough), "create" the first, or, when `old` is too small, replace it and "free"
    it, or "retire" it (keep it until close()) if a CUDA graph was captured on it: that graph holds
    its addresses and the peers', and a server replays it whenever a request of its shape comes
    back (engines.levers.compile keeps one graph per input signature). Freed, those addresses would be
    reused, and the replay would wait on flags in someone else's memory. Growing during a capture
    is refused: the rendezvous and barrier it takes cannot be captured."""
    if old is not None and old.data_bytes >= nbytes:
        return "use"
    if capturing:
        raise RuntimeError("copy-engine exchange: its buffer must grow, which cannot happen during "
                           "CUDA graph capture; run the shape once before capturing")
    if old is None:
        return "create"
    return "retire" if old.captured else "free"


class CopyEngineTransport:
    """The copy-engine exchanges of one ParallelMesh: per process group, its symmetric buffers
    (up to two in use, "slots" and "gather", plus those retired while CUDA graphs may replay them)
    and, on CPU, the K/V gathers waiting to be read; per GPU, the two side streams they run on.

    Made by engines.parallel.mesh.build_mesh for a mesh whose all_to_all is "copy-engine"; registered in
    _TRANSPORTS_BY_GROUP under each of its groups' names, for the ops. Buffers are allocated at
    the first exchange that needs them (the warm-up, never inside a CUDA graph capture) and grown
    when a later one is bigger: every rank makes the same calls, so they stay in step.

    Two meshes may share a process group (torch's DeviceMesh gives an axis that spans the whole
    job the default group): the first transport registered under its name keeps that group's
    buffers, the later ones use them, and they are freed when the last of those meshes closes.
    """

    def __init__(self, groups: list[dist.ProcessGroup]) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_names = tuple(dict.fromkeys(group.group_name for group in groups))
        self.closed = False
        self._side_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
        self._exchanges: dict[tuple[str, str], _Exchange] = {}  # (group name, "slots" or "gather")
        self._retired: list[_Exchange] = []  # replaced, but captured in a CUDA graph: see replace_exchange
        self._cpu_gathered: dict[str, torch.Tensor] = {}  # on CPU: the last K/V all-gather of each group
        self._cpu_keys: dict[str, list[torch.Tensor]] = {}  # on CPU: keys sent ahead of their values
        self._holders: dict[str, int] = {}  # group name -> open transports using this one's state for it
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # torch < 2.12 needs it
        for name in self.group_names:
            if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(name):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # deprecated (and unneeded) in newer torch
                    enable(name)  # no collective
            owner = _TRANSPORTS_BY_GROUP.setdefault(name, self)
            owner._holders[name] = owner._holders.get(name, 0) + 1

    def close(self) -> None:
        """Unregister this mesh's groups and free each one's buffers, retired ones included, unless
        another open mesh still uses that group (idempotent). Collective where it frees a buffer:
        every rank closes its meshes in the same order. Drop the CUDA graphs captured on them first
        (engines.levers.compile.Engine.release): a graph replayed on a freed buffer reads and writes
        memory that is no longer its own."""
        if self.closed:
            return
        self.closed = True
        for name in self.group_names:
            owner = _TRANSPORTS_BY_GROUP[name]
            owner._holders[name] -= 1
            if owner._holders[name] == 0:
                del owner._holders[name], _TRANSPORTS_BY_GROUP[name]
                owner._drop_group(name)

    def _drop_group(self, name: str) -> None:
        """Free group `name`'s buffers and forget its CPU results."""
        for key in [key for key in self._exchanges if key[0] == name]:
            self._exchanges.pop(key).free()
        for exchange in [exchange for exchange in self._retired if exchange.group_name == name]:
            self._retired.remove(exchange)
            exchange.free()
        self._cpu_gathered.pop(name, None)
        self._cpu_keys.pop(name, None)

    def side_stream(self, device: torch.device, role: str = "exchange") -> torch.cuda.Stream:
        """The GPU's side stream for `role`: "exchange" (pushes, waits, copy-outs) or "own" (this
        rank's own slices, copied while the pushes travel)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if (index, role) not in self._side_streams:
            # only copies and waits run on it; priority as measured
            self._side_streams[index, role] = torch.cuda.Stream(device=index, priority=-1)
        return self._side_streams[index, role]

    def exchange(self, group_name: str, kind: str, nbytes: int, device: torch.device) -> _Exchange:
        """The group's exchange of `kind` ("slots" or "gather"), with at least `nbytes` of data,
        grown if needed (replace_exchange decides what becomes of the old one), and marked as
        captured if this call runs during a CUDA graph capture."""
        capturing = torch.cuda.is_current_stream_capturing()
        exchange = self._exchanges.get((group_name, kind))
        action = replace_exchange(exchange, nbytes, capturing)
        if action != "use":
            if action == "retire":
                exchange.release()  # every rank is past its last use of the old buffer, for now
                self._retired.append(exchange)  # graphs captured on it may replay it: keep it mapped
            elif action == "free":
                exchange.free()  # released too
            exchange = self._exchanges[group_name, kind] = _outside_graph_pools(
                lambda: _Exchange(group_name, nbytes, device), device)
        exchange.captured = exchange.captured or capturing
        return exchange

    def gathered(self, group_name: str) -> _Exchange:
        """The group's "gather" exchange, as its last K/V gather left it (marked as captured if
        read during a CUDA graph capture)."""
        if (group_name, "gather") not in self._exchanges:
            raise RuntimeError(f"no copy-engine K/V gather of {group_name} has run")
        exchange = self._exchanges[group_name, "gather"]
        exchange.captured = exchange.captured or torch.cuda.is_current_stream_capturing()
        return exchange


def transport_for(group_name: str) -> CopyEngineTransport:
    """The CopyEngineTransport that holds group `group_name`'s exchanges (the ops' one lookup)."""
    transport = _TRANSPORTS_BY_GROUP.get(group_name)
    if transport is None:
        raise RuntimeError(f"process group {group_name!r} has no copy-engine transport: build its mesh with "
                           "all_to_all='copy-engine' (engines.parallel.mesh.build_mesh), and do not use it after "
                           "close()")
    return transport


def _push_and_collect(
    x: torch.Tensor,
    out: torch.Tensor,
    group_name: str,
    sends: list[tuple[int, torch.Tensor]],
    receives: list[tuple[int, list[torch.Tensor]]],
    own: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """On the side stream: write each (peer, slice of x) of `sends` into that peer's buffer, copy
    each (destination, source) of `own` locally, and for each (peer, destinations) of `receives`
    copy the slot that peer wrote here into the destinations (one: the whole slot, seen in its
    shape; several: the slot's pieces along dim 0, in order); then register the work that funcol's
    wait_tensor waits for on `out`. Every sent slice has the same shape.
    """
    like = sends[0][1]
    group_size = c10d._resolve_process_group(group_name).size()
    transport = transport_for(group_name)
    ex = transport.exchange(group_name, "slots", group_size * like.numel() * like.element_size(), x.device)
    rank = ex.rank
    compute = torch.cuda.current_stream()
    stream = transport.side_stream(x.device)
    stream.wait_stream(compute)  # x is ready, out is allocated
    if own:  # on a stream of their own, so that they run while the pushes travel
        own_stream = transport.side_stream(x.device, "own")
        own_stream.wait_stream(compute)
        with torch.cuda.stream(own_stream):
            for destination, source in own:
                destination.copy_(source)
    with torch.cuda.stream(stream):
        for peer, piece in sends:  # push as soon as this rank is ready and the peer's slot is free
            ex.take(stream, "free", peer)
            ex.slot(peer, rank, piece).copy_(piece)  # over NVLink, by a copy engine
            ex.give(peer, "ready")
        for peer, destinations in receives:
            ex.take(stream, "ready", peer)
            slot = ex.slot(rank, peer, like)
            if len(destinations) == 1:
                destinations[0].copy_(slot.view(destinations[0].shape))
            else:
                for destination, source in zip(destinations, slot, strict=True):
                    destination.copy_(source)
        for peer, _ in receives:  # only after every slot is copied out: a slot of one exchange may
            ex.give(peer, "free")  # overlap another peer's slot of the next
        if own:
            stream.wait_stream(own_stream)
        event = torch.cuda.Event()
        event.record(stream)
    # x is read on the side stream: keep it alive until the caller's stream has waited for the event
    torch._C._distributed_c10d._register_work(out, _Done(event, keep=x))


@torch.library.impl(_lib, "copy_engine_all_to_all", "Meta")
@torch.library.impl(_lib, "copy_engine_shift", "Meta")
def _same_shape_meta(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.impl(_lib, "copy_engine_all_to_all", "CUDA")
def _all_to_all_cuda(x: torch.Tensor, group_name: str) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)  # on the caller's stream: its memory belongs to that stream
    group = c10d._resolve_process_group(group_name)
    rank, size = group.rank(), group.size()
    peers = [(rank + i) % size for i in range(1, size)]  # a different first peer on every rank
    _push_and_collect(x, out, group_name, [(p, x[p]) for p in peers], [(p, [out[p]]) for p in peers],
                      own=[(out[rank], x[rank])])
    return out


@torch.library.impl(_lib, "copy_engine_shift", "CUDA")
def _shift_cuda(x: torch.Tensor, group_name: str) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    group = c10d._resolve_process_group(group_name)
    rank, size = group.rank(), group.size()
    _push_and_collect(x, out, group_name, [((rank + 1) % size, x)], [((rank - 1) % size, [out])], own=[])
    return out


def ring_splits(rank: int, size: int, rows: int) -> tuple[list[int], list[int]]:
    """(send, receive) row splits of a ring pass as an all-to-all: every row to group rank + 1,
    every row from rank - 1, nothing to or from anyone else."""
    send, receive = [0] * size, [0] * size
    send[(rank + 1) % size] = rows
    receive[(rank - 1) % size] = rows
    return send, receive


def _kv_pieces(keys: list[torch.Tensor], values: list[torch.Tensor],
               keys_sent: torch.Tensor | None) -> tuple[list[list[torch.Tensor]], int]:
    """keys and values, each this rank's sequence in consecutive parts (S_i, ...) made contiguous,
    or one of them empty (keys sent ahead, or values following them), and the sequence length S."""
    if not keys and not values or (keys_sent is not None) != (not keys):
        raise ValueError("copy-engine K/V gather: send keys and values together, or the keys first and then "
                         "the values with the keys' token")
    parts = [[p.contiguous() for p in keys], [p.contiguous() for p in values]]
    like = (keys or values)[0]
    rows = {sum(p.shape[0] for p in kind) for kind in parts if kind}
    if len(rows) != 1 or any(p.shape[1:] != like.shape[1:] or p.dtype != like.dtype for kind in parts for p in kind):
        raise ValueError("copy-engine K/V gather: keys and values must cover the same sequence, in one shape and dtype")
    return parts, rows.pop()


@torch.library.impl(_lib, "copy_engine_gather_kv", "Meta")
def _gather_kv_meta(keys: list[torch.Tensor], values: list[torch.Tensor], group_name: str, size: int,
                    keys_sent: torch.Tensor | None = None) -> torch.Tensor:
    return (keys or values)[0].new_empty(1)


@torch.library.impl(_lib, "copy_engine_gather_kv", "CUDA")
def _gather_kv_cuda(keys: list[torch.Tensor], values: list[torch.Tensor], group_name: str, size: int,
                    keys_sent: torch.Tensor | None = None) -> torch.Tensor:
    parts, rows = _kv_pieces(keys, values, keys_sent)
    like = (parts[0] or parts[1])[0]
    shape = (2, size * rows, *like.shape[1:])
    transport = transport_for(group_name)
    ex = transport.exchange(group_name, "gather", 2 * size * rows * like[0].numel() * like.element_size(), like.device)
    rank = ex.rank
    peers = [(rank + i) % size for i in range(1, size)]
    opens, completes = bool(keys), bool(values)  # the call with the keys opens the gather, with the values ends it
    if completes and not opens and not ex.keys_sent:
        raise RuntimeError(f"copy-engine K/V gather of {group_name}: values sent, but no keys ahead of them")
    kinds = [i for i, kind in enumerate(parts) if kind]
    mine = slice(rank * rows, (rank + 1) * rows)
    # This rank's own piece lands in its own buffer on the caller's stream, before the call returns, and the peers'
    # copies are pushed from there: nothing reads the parts once the call has returned. A compiled graph plans the
    # reuse of its buffers' memory itself (inductor, CUDA graph trees), not through the caching allocator, and
    # knows nothing of side streams: a part read later on one was overwritten by the graph's next kernels.
    own = ex.gathered(rank, shape, like.dtype)
    for i in kinds:
        start = mine.start
        for part in parts[i]:
            own[i, start:start + part.shape[0]].copy_(part)
            start += part.shape[0]
    compute = torch.cuda.current_stream()
    stream = transport.side_stream(like.device)
    stream.wait_stream(compute)  # the own piece has landed, and the attention that read the last gather has run
    with torch.cuda.stream(stream):
        if opens and ex.landed is not None:  # this rank has read what the peers wrote last time: they may write again
            for peer in peers:
                ex.give(peer, "free")
        for peer in peers:
            if opens:
                ex.take(stream, "free", peer)
            theirs = ex.gathered(peer, shape, like.dtype)
            for i in kinds:  # over NVLink, by a copy engine
                theirs[i, mine].copy_(own[i, mine])
            ex.give(peer, "ready" if completes else "keys_ready")
        if completes:
            for peer in peers:
                if not opens:
                    ex.take(stream, "keys_ready", peer)
                ex.take(stream, "ready", peer)
            event = torch.cuda.Event()
            event.record(stream)
    ex.keys_sent = not completes  # the values follow in another call, which ends the gather
    if not completes:
        return like.new_empty(1)
    ex.landed = (shape, like.dtype)
    token = like.new_empty(1)  # finish() on it waits for the gather
    torch._C._distributed_c10d._register_work(token, _Done(event))
    return token


@torch.library.impl(_lib, "copy_engine_gather_kv", "CPU")
def _gather_kv_cpu(keys: list[torch.Tensor], values: list[torch.Tensor], group_name: str, size: int,
                   keys_sent: torch.Tensor | None = None) -> torch.Tensor:
    parts, _ = _kv_pieces(keys, values, keys_sent)
    transport = transport_for(group_name)
    if not values:  # the values follow in another call, which gathers both
        transport._cpu_keys[group_name] = parts[0]
        return keys[0].new_zeros(1)
    if not keys:
        parts[0] = transport._cpu_keys.pop(group_name)
    x = torch.stack([torch.cat(kind) for kind in parts])
    pieces = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(pieces, x, group=c10d._resolve_process_group(group_name))
    transport._cpu_gathered[group_name] = torch.cat(pieces, dim=1)
    token = x.new_zeros(1)
    torch._C._distributed_c10d._register_work(token, _Done(None))
    return token


@torch.library.impl(_lib, "copy_engine_all_to_all", "CPU")
def _all_to_all_cpu(x: torch.Tensor, group_name: str) -> torch.Tensor:
    transport_for(group_name)  # nothing kept, but refused as on CUDA where no mesh registered the group
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=c10d._resolve_process_group(group_name))
    torch._C._distributed_c10d._register_work(out, _Done(None))
    return out


@torch.library.impl(_lib, "copy_engine_shift", "CPU")
def _shift_cpu(x: torch.Tensor, group_name: str) -> torch.Tensor:
    transport_for(group_name)  # likewise
    x = x.contiguous()
    out = torch.empty_like(x)
    group = c10d._resolve_process_group(group_name)
    send, receive = ring_splits(group.rank(), group.size(), x.shape[0])
    dist.all_to_all_single(out, x, receive, send, group=group)
    torch._C._distributed_c10d._register_work(out, _Done(None))
    return out


def start(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Issue the all-to-all of `x` along dim 0 (slice i to peer i); finish it with wait_tensor."""
    return torch.ops.ulysses_studio.copy_engine_all_to_all(x, group_name)


def start_gather_kv(keys: list[torch.Tensor], values: list[torch.Tensor], group_name: str, size: int,
                    keys_sent: torch.Tensor | None = None) -> torch.Tensor:
    """Issue the all-gather of this rank's keys and values into this group's exchange buffer, as
    one tensor (2, size * S, ...): keys then values, each the group's ranks' S rows in rank order.
    `keys` and `values` are this rank's S rows in consecutive parts (S_i, ...), so that pieces
    made apart (FLUX's text and image streams) need no concatenation first. Returns a token:
    after wait_tensor on it, gathered_kv() gives the result, valid until the group's next gather.
    `size` is the group's size.

    The keys may go ahead, so that they travel while the values are made: call with the keys and
    no values (the token it returns is not waited for), then with no keys, the values, and that
    token as `keys_sent`; the second call's token is the one to wait for."""
    return torch.ops.ulysses_studio.copy_engine_gather_kv(keys, values, group_name, size, keys_sent)


def gathered_kv(group_name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The group's last all-gather (start_gather_kv), of `shape` and `dtype`, where it landed: the
    exchange buffer on CUDA (read it before the group's next gather; do not write it)."""
    transport = transport_for(group_name)
    if device.type == "cpu":
        gathered = transport._cpu_gathered[group_name]
        landed = (tuple(gathered.shape), gathered.dtype)
    else:
        ex = transport.gathered(group_name)
        landed = ex.landed
    if landed != (tuple(shape), dtype):
        raise RuntimeError(f"the last K/V gather of {group_name} landed as {landed}, not as {(tuple(shape), dtype)}")
    return gathered if device.type == "cpu" else ex.gathered(ex.rank, shape, dtype)


def start_shift(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Issue the ring pass of `x`: to group rank + 1, from group rank - 1; finish it with wait_tensor."""
    return torch.ops.ulysses_studio.copy_engine_shift(x, group_name)


def check_transport(transport: str, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Raise ValueError (the same on every rank, before any collective) if `transport` cannot run.

    "copy-engine" needs CUDA and the whole job on one host (torchrun's LOCAL_WORLD_SIZE equal to
    WORLD_SIZE): symmetric memory maps peers' memory through CUDA IPC, which does not cross hosts.
    """
    check_choice("all-to-all transport", transport, TRANSPORTS)
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
