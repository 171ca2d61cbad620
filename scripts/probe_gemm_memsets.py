"""GPU probe: the 4-byte memsets that precede cuBLAS's cooperative GEMM kernels in FLUX's CUDA
graphs, and what they cost; run once per cuBLAS setting (environment) to compare.

    python scripts/probe_gemm_memsets.py [--out result.json]

For each GEMM of a FLUX ring-2 rank (2304 rows) and of 1 GPU (4608 rows): CUDA-graph replay time of
20 calls (median of 20, CUDA events), and a profile of one replay: kernels, memsets and the time from
the first to the last event.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from probe_attention_split import capture, time_replays  # this folder (run as scripts/probe_gemm_memsets.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    env = {k: v for k, v in os.environ.items() if k.startswith(("CUBLAS", "DISABLE_ADDMM", "TORCH_CUBLAS", "TORCH_BLAS"))}
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "env": env, "gemms": {}}
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for rows in (2304, 4608):
        for name, k, n, bias in (("qkv projection", 3072, 3072, True), ("proj_out attention share", 3072, 3072, False),
                                 ("mlp", 3072, 12288, True), ("proj_out mlp share", 12288, 3072, True),
                                 ("text projection", 3072, 3072, True)):
            m = rows // 9 if name == "text projection" else rows  # 256 / 512 text rows
            x, w = torch.randn(m, k, **bf16), torch.randn(n, k, **bf16) * 0.02
            b = torch.randn(n, **bf16) if bias else None
            calls = 20
            graph = capture(lambda x=x, w=w, b=b: F.linear(x, w, b), calls)
            us = time_replays(graph, calls)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            events = [e for e in prof.events() if e.device_type.name == "CUDA"]
            kernels = [e for e in events if "emset" not in e.name]
            memsets = [e for e in events if "emset" in e.name]
            span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / calls
            busy = sum(e.time_range.elapsed_us() for e in kernels) / calls
            result["gemms"][f"{m}x{k}x{n}{' +bias' if bias else ''} ({name})"] = dict(
                us=us, span_us=span, kernel_us=busy, memsets_per_call=len(memsets) / calls,
                kernel=kernels[0].name[:90] if kernels else None)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
