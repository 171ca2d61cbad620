"""GPU probe: does destroy_process_group() return while a CUDA graph that captured an NCCL
collective is alive?

    torchrun --nproc-per-node 2 scripts/probe_graph_teardown.py alive      # the graph kept
    torchrun --nproc-per-node 2 scripts/probe_graph_teardown.py released   # the graph deleted first

Each rank captures one all_gather_into_tensor in a CUDA graph, replays it, then (with "released")
deletes the graph, and prints how long destroy_process_group() took. On 2x H200 (torch 2.11, NCCL
2.28.9) "released" returned in 0.5 s; "alive" never returned, and after torchrun was killed its
ranks still held their GPU memory (docs/benchmarks.md, eleventh session). Hence
engines.distributed.shutdown and app.runtime.release_engines.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "released"
    if mode not in ("alive", "released"):
        raise SystemExit("usage: probe_graph_teardown.py alive|released")
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    x = torch.ones(1024, device="cuda")
    out = torch.empty(1024 * dist.get_world_size(), device="cuda")
    dist.all_gather_into_tensor(out, x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        dist.all_gather_into_tensor(out, x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_gather_into_tensor(out, x)
    graph.replay()
    torch.cuda.synchronize()
    if mode == "released":
        del graph
        torch.cuda.synchronize()
    started = time.time()
    dist.destroy_process_group()
    print(f"rank {rank} ({mode}): destroy_process_group took {time.time() - started:.2f} s", flush=True)


if __name__ == "__main__":
    main()
