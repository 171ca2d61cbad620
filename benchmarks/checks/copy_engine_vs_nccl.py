"""GPU check of the copy-engine all-to-all (engines/parallel/copy_engine.py) against NCCL, on one host.

    torchrun --nproc-per-node 2 -m benchmarks.checks.copy_engine_vs_nccl [--out result.json]

1. Correctness: the all-to-all, the ring pass, and the K/V all-gather (in one call, and with the
   keys sent ahead of the values) with the attention that reads it in the exchange buffer, equal
   NCCL's (and the same attention), bit for bit, called directly and replayed from a CUDA graph; a
   random-weight FLUX.1-dev (1024², bf16, eager) under Ulysses, ring and all-gather gives the same
   output with either transport (and, on rank 0, its difference from the one-GPU model).
2. Speed of the exchange alone and under a GEMM (the FLUX single block's q/k/v exchange, 21 MB a
   rank, beside its MLP GEMM, 2304x3072 @ 3072x12288): CUDA-graph replays, CUDA events, median;
   and a bare 21 MB peer pull alone and beside the GEMM (the floor for any copy-engine design).
Every rank prints its numbers; rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

from benchmarks.inputs import bench_model, build_random
from benchmarks.step import gather_objects
from engines.options import CUBLAS_WITHOUT_WORKSPACE, set_environment
from engines.parallel.attention import _kv_attention, gathered_attention
from engines.parallel.collectives import (
    all_to_all,
    finish,
    finish_all_gather,
    start_all_gather,
    start_all_to_all,
    start_ring_shift,
)
from engines.parallel.copy_engine import CopyEngineTransport, start_gather_kv
from engines.parallel.distributed import init_parallel, shutdown
from engines.parallel.parallelize import parallelize_transformer
from engines.parallel.plan import ParallelPlan
from pipelines.family import load
from pipelines.transformer_inputs import Shape


def graphed(fn, *, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """Capture fn() in a CUDA graph after `warmup` eager calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, group, *, repeat: int = 20) -> float:
    """Median ms of one replay (all ranks start together)."""
    times = []
    for _ in range(repeat):
        torch.distributed.barrier(group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--trace", type=Path, default=None, help="also write profiler traces of the GEMM runs here")
    args = parser.parse_args()
    set_environment(dict(CUBLAS_WITHOUT_WORKSPACE))  # as the app runs
    run_on_ranks("copy_engine_vs_nccl", lambda ctx, result: check(ctx, result, args.trace), args.out)


def run_on_ranks(name: str, check_fn, out: Path | None) -> None:
    """Run `check_fn(ctx, result)` on every rank, then print every rank's result dict and write them
    all as JSON to `out` (rank 0). A failure is recorded in that rank's result, never left hanging."""
    ctx = init_parallel()
    transport = CopyEngineTransport([ctx.group])  # the exchanges below run on the whole job's group
    result: dict = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), world_size=ctx.world_size,
                        nccl=".".join(map(str, torch.cuda.nccl.version())))
    try:
        check_fn(ctx, result)
    except Exception:  # report it with the other rank's results
        result["error"] = traceback.format_exc()[-3000:]
    everyone = gather_objects(ctx, result)
    for rank, r in enumerate(everyone):
        print(f"[{name}] rank {rank}: {json.dumps(r)}", file=sys.stderr, flush=True)
    if ctx.is_main and out:
        out.write_text(json.dumps(everyone, indent=2))
    transport.close()
    shutdown(ctx)


def trace_replay(graph: torch.cuda.CUDAGraph, group, path: Path) -> None:
    """Chrome trace (kernels and copies, per stream) of three replays of `graph`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier(group)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


def check(ctx, result: dict, trace: Path | None = None) -> None:
    """Fill `result` with sections 1 and 2 of the module docstring."""
    group, name, size, device = ctx.group, ctx.group.group_name, ctx.world_size, ctx.device
    # 1a. the op against NCCL, direct and from a graph
    torch.manual_seed(ctx.rank)
    x = torch.randn(size, 3, 1, 2304, 24 // size, 128, device=device, dtype=torch.bfloat16)
    reference = all_to_all(x, group)
    direct = finish(start_all_to_all(x, name, size, "copy-engine"))
    result["direct_equal"] = bool(torch.equal(direct, reference))
    holder = {}

    def exchange_twice() -> None:
        first = finish(start_all_to_all(x, name, size, "copy-engine"))
        holder["out"] = finish(start_all_to_all(first * 2, name, size, "copy-engine"))

    graph = graphed(exchange_twice)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    result["graph_equal"] = bool(torch.equal(holder["out"], all_to_all(all_to_all(x, group) * 2, group)))
    # 1b. the ring pass (to rank + 1, from rank - 1) against NCCL's, direct and from a graph
    def shift(y: torch.Tensor, transport: str) -> torch.Tensor:
        return finish(start_ring_shift(y, name, ctx.rank, size, transport))

    result["shift_direct_equal"] = bool(torch.equal(shift(x, "copy-engine"), shift(x, "nccl")))

    def shift_twice() -> None:
        holder["shifted"] = shift(shift(x, "copy-engine") * 2, "copy-engine")

    graph = graphed(shift_twice)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    result["shift_graph_equal"] = bool(torch.equal(holder["shifted"], shift(shift(x, "nccl") * 2, "nccl")))
    # 1c. the K/V all-gather (GatherAttention's exchange) and the attention that reads it where it
    # landed, against NCCL's all-gather and the same attention, direct and from a graph
    rows = 2304
    q = torch.randn(1, rows, 24, 128, device=device, dtype=torch.bfloat16)  # BSHD
    kv = torch.randn(2, rows, 1, 24, 128, device=device, dtype=torch.bfloat16)  # (2, S, B, H, D)
    runs = ((0, size * rows),)

    def attend(y: torch.Tensor, transport: str) -> torch.Tensor:
        if transport == "copy-engine":
            # values in two parts (FLUX's text and image streams): each pushed from where it is
            token = start_gather_kv([y[0]], [y[1][:256], y[1][256:]], name, size)
            return gathered_attention(q, finish(token), name, size, [0, size * rows])
        if transport == "copy-engine, keys ahead":  # FLUX's double blocks: the keys first, then the values
            keys = start_gather_kv([y[0]], [], name, size)
            token = start_gather_kv([], [y[1][:256], y[1][256:]], name, size, keys_sent=keys)
            return gathered_attention(q, finish(token), name, size, [0, size * rows])
        return _kv_attention(q, finish_all_gather(start_all_gather(y, name, size), size), runs).transpose(1, 2)

    def attend_twice(transport: str, second: str | None = None) -> torch.Tensor:
        """Two gathers in a row: the second lands where the first attention read."""
        first = attend(kv, transport)
        return attend(torch.stack((first, first * 2)).transpose(1, 2), second or transport)

    expected = attend(kv, "nccl")
    result["gather_direct_equal"] = all(torch.equal(attend(kv, t), expected)
                                        for t in ("copy-engine", "copy-engine, keys ahead"))
    graph = graphed(lambda: holder.__setitem__("attended", attend_twice("copy-engine", "copy-engine, keys ahead")))
    checks = []
    for _ in range(3):  # replays one after another: the flags end each replay as they began it
        kv.copy_(torch.randn_like(kv))
        graph.replay()
        torch.cuda.synchronize()
        checks.append(bool(torch.equal(holder["attended"], attend_twice("nccl"))))
    result["gather_graph_equal"] = all(checks)

    # 2. speed: exchange alone, GEMM alone, exchange issued before the GEMM then waited
    a = torch.randn(2304, 3072, device=device, dtype=torch.bfloat16)
    w = torch.randn(3072, 12288, device=device, dtype=torch.bfloat16)
    timings = {}
    for transport in ("nccl", "copy-engine"):
        for label, nbytes_x in (("qkv", x), ("out", x[:, :1].contiguous())):
            def alone(t=transport, y=nbytes_x) -> None:
                holder["y"] = finish(start_all_to_all(y, name, size, t))

            def under_gemm(t=transport, y=nbytes_x) -> None:
                pending = start_all_to_all(y, name, size, t)
                holder["g"] = a @ w
                holder["y"] = finish(pending)

            timings[f"{transport} {label} alone"] = time_graph(graphed(alone), group)
            graph = graphed(under_gemm)
            timings[f"{transport} {label} under gemm"] = time_graph(graph, group)
            if trace is not None and label == "qkv":
                trace_replay(graph, group, trace / f"{transport}-qkv-under-gemm.rank{ctx.rank}.json")
    timings["gemm alone"] = time_graph(graphed(lambda: holder.__setitem__("g", a @ w)), group)
    # The floor of any copy-engine design: one 21 MB pull from the peer's symmetric memory on a side
    # stream, nothing else (no staging, no flags; the data never changes), beside the same GEMM.
    from torch.distributed import _symmetric_memory as symm_mem

    chunk = x[0]
    mine = symm_mem.empty(chunk.numel(), dtype=chunk.dtype, device=device)
    handle = symm_mem.rendezvous(mine, name)
    remote = handle.get_buffer((ctx.rank + 1) % size, chunk.shape, chunk.dtype)
    pulled = torch.empty_like(chunk)
    side = torch.cuda.Stream(device=device)

    def raw_pull(with_gemm: bool) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pulled.copy_(remote)
        if with_gemm:
            holder["g"] = a @ w
        torch.cuda.current_stream().wait_stream(side)

    timings["raw peer pull alone"] = time_graph(graphed(lambda: raw_pull(False)), group)
    timings["raw peer pull under gemm"] = time_graph(graphed(lambda: raw_pull(True)), group)
    result["ms"] = timings
    result["qkv_mbytes_per_rank"] = x.numel() * x.element_size() / 1e6

    # 1d. FLUX.1-dev (random weights, eager, 1024²): same output with either transport
    spec = bench_model("flux-dev")
    model = build_random(spec, device=device, dtype=torch.bfloat16)
    inputs, _ = spec.inputs(Shape(height=1024, width=1024), batch=1, device=device, dtype=torch.bfloat16)
    adapter = load(spec.family.parallelize)
    strategies = ("ulysses", "ring", "allgather")
    outputs = {}
    with torch.no_grad():
        for transport in ("nccl", "copy-engine"):
            for strategy in strategies:
                plan = ParallelPlan.auto(size, 24, strategy=strategy)
                parallel = parallelize_transformer(model, ctx, plan, adapter, all_to_all=transport)
                outputs[strategy, transport] = parallel(**inputs)[0].float()
                parallel.restore()
        single = model(**inputs)[0].float() if ctx.rank == 0 else None
    for strategy in strategies:
        nccl, copy = outputs[strategy, "nccl"], outputs[strategy, "copy-engine"]
        result[f"flux_{strategy}_max_diff_transports"] = (nccl - copy).abs().max().item()
        if single is not None:
            result[f"flux_{strategy}_max_diff_vs_1_gpu"] = (nccl - single).abs().max().item()
    result["flux_scale"] = outputs["ulysses", "nccl"].abs().max().item()


if __name__ == "__main__":
    main()
