"""Probe: how does each rank's CUDA graph run a local device-to-device copy (copy engine or kernel)?

    torchrun --nproc-per-node 2 scripts/probe_graph_copies.py OUT_DIR

In FLUX ring-2 profiles the copy-engine exchange's local copies ran as copy-engine "Memcpy DtoD" on
rank 0 but as `memcpy128` kernels on rank 1. This captures the same kinds of copies (side stream,
14 MB, plain and into symmetric memory) on every rank, profiles three replays, and writes which
ran how, with the processes each GPU shows (a stray context on another GPU would show there).
"""

from __future__ import annotations

import collections
import ctypes
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from engines import init_parallel, shutdown
from engines.copy_engine import prepare


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (cuda.h, CUDA >= 12.8)."""
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]


def batch_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) (contiguous, same size) by cuMemcpyBatchAsync with the driver hint
    CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE ("try to overlap the copy with compute on the SMs")."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    device = dst.device.index
    attrs = _MemcpyAttributes(1, _Location(1, device), _Location(1, device), 1)  # stream order, devices, hint
    dsts, srcs = (ctypes.c_uint64 * 1)(dst.data_ptr()), (ctypes.c_uint64 * 1)(src.data_ptr())
    sizes, idxs = (ctypes.c_size_t * 1)(dst.numel() * dst.element_size()), (ctypes.c_size_t * 1)(0)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    v2 = getattr(libcuda, "cuMemcpyBatchAsync_v2", None)
    if v2 is not None:  # CUDA 13: no failIdx
        result = v2(dsts, srcs, sizes, ctypes.c_size_t(1), ctypes.byref(attrs), idxs, ctypes.c_size_t(1), stream)
    else:
        fail = ctypes.c_size_t(0)
        result = libcuda.cuMemcpyBatchAsync(dsts, srcs, sizes, ctypes.c_size_t(1), ctypes.byref(attrs), idxs,
                                            ctypes.c_size_t(1), ctypes.byref(fail), stream)
    if result != 0:
        raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {result}")


def copies(prof: torch.profiler.profile) -> dict[str, int]:
    """How many events of each copy kind (copy engine "Memcpy ..." or kernel "memcpy...") ran."""
    return dict(collections.Counter(e.name for e in prof.events() if "emcpy" in e.name))


def probe(step, group) -> dict:
    """Copy kinds of `step` run eagerly and replayed (3 times) from a CUDA graph; mean ms of a replay."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as eager:
        step()
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    if group is not None:
        dist.barrier(group)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as replays:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    return {"eager": copies(eager), "graph": copies(replays), "replay_ms": start.elapsed_time(end) / 20}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    ctx = init_parallel()
    device = ctx.device
    n = 2304 * 3072
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    sym = None
    if ctx.is_distributed:  # one process: no symmetric memory (its rendezvous needs a group)
        from torch.distributed import _symmetric_memory as symm_mem

        prepare(ctx.group)
        sym = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(sym, ctx.group.group_name)
    side = torch.cuda.Stream(device=device, priority=-1)
    a = torch.randn(2304, 3072, device=device, dtype=torch.bfloat16)
    w = torch.randn(3072, 12288, device=device, dtype=torch.bfloat16)
    holder = {}
    variants = {
        "no copy (the GEMM alone)": lambda: None,
        "plain copy on side stream": lambda: dst.copy_(src),
        "copy into symmetric memory": lambda: sym.copy_(src),
        "copy out of symmetric memory": lambda: dst.copy_(sym),
        "batch copy, prefer overlap": lambda: batch_copy(dst, src),
        "batch copy into symmetric memory, prefer overlap": lambda: batch_copy(sym, src),
    }
    result = {"rank": ctx.rank, "device": str(device), "current_device": torch.cuda.current_device()}
    for name, copy in variants.items():
        if sym is None and "symmetric" in name:
            continue

        def step(copy=copy) -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copy()
            holder["g"] = a @ w
            torch.cuda.current_stream().wait_stream(side)

        try:
            result[name] = probe(step, ctx.group)
        except Exception as error:  # noqa: BLE001 - reported with the other variants
            result[name] = {"error": repr(error)}
    if ctx.rank == 0:
        result["nvidia_smi_apps"] = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory", "--format=csv"],
            capture_output=True, text=True).stdout
    everyone = [result]
    if ctx.is_distributed:
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, result, group=ctx.control_group)
    if ctx.rank == 0:
        (out / "probe.json").write_text(json.dumps(everyone, indent=2))
        print(json.dumps(everyone, indent=2))
    shutdown(ctx)


if __name__ == "__main__":
    main()
