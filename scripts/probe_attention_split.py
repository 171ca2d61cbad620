"""GPU probe: does one rank's FLUX attention (2304 queries over 4608 gathered keys, 24 heads of
128, bf16) lose to wave quantization, and would two half-key attentions on two streams plus a
log-sum-exp merge beat one kernel?

    python scripts/probe_attention_split.py [--out result.json]

Times (CUDA-graph replays, CUDA events, median of 20 replays of 20 calls each, microseconds):
- cuDNN SDPA at several query counts against 4608 keys: if 2304, 2560 and 2816 queries take about
  the same time, the kernel's last wave of CTAs is mostly idle at 2304;
- the split: attention to each half of the keys (cuDNN, with its log-sum-exp), the halves on two
  streams, then a compiled merge; the halves alone; the merge alone;
and the split's largest difference from one kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def probe_output(doc: str) -> Path | None:
    """A probe's command line (described by the first line of `doc`): --out FILE, where its JSON
    result goes; returns FILE, or None without it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args().out


def write_result(result: dict, out: Path | None) -> None:
    """Write a probe's result as JSON to `out`, if given."""
    if out:
        out.write_text(json.dumps(result, indent=1))


def capture(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of `fn` (after 3 warm-up calls on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def time_replays(graph: torch.cuda.CUDAGraph, calls: int, repeats: int = 20) -> float:
    """Median microseconds per call over `repeats` replays of `graph` (which holds `calls` calls)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def replay_us(fn: Callable[[], object], calls: int = 20, repeats: int = 20) -> float:
    """Median microseconds per call of `fn`, captured `calls` times in one CUDA graph."""
    return time_replays(capture(fn, calls), calls, repeats)


def cudnn_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    return out, lse.reshape(q.shape[:3])


@torch.compile(fullgraph=True)
def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m).unsqueeze(-1), torch.exp(l2 - m).unsqueeze(-1)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(o1.dtype)


def main() -> None:
    out = probe_output(__doc__)
    torch.manual_seed(0)
    heads, dim, keys = 24, 128, 4608
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "cudnn": torch.backends.cudnn.version(), "us": {}}
    k = torch.randn(1, heads, keys, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for queries in (1152, 2048, 2112, 2176, 2304, 2560, 2816, 3072, 4608):
            q = torch.randn(1, heads, queries, dim, device="cuda", dtype=torch.bfloat16)
            result["us"][f"one kernel, {queries} queries"] = replay_us(lambda q=q: F.scaled_dot_product_attention(q, k, v))
    q = torch.randn(1, heads, 2304, dim, device="cuda", dtype=torch.bfloat16)
    half = keys // 2
    side = torch.cuda.Stream()
    held: dict = {}

    def halves() -> None:
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        held["a"] = cudnn_lse(q, k[:, :, :half], v[:, :, :half])
        with torch.cuda.stream(side):
            held["b"] = cudnn_lse(q, k[:, :, half:], v[:, :, half:])
        current.wait_stream(side)

    def split() -> None:
        halves()
        held["out"] = merge(*held["a"], *held["b"])

    def halves_in_order() -> None:
        held["a"] = cudnn_lse(q, k[:, :, :half], v[:, :, :half])
        held["b"] = cudnn_lse(q, k[:, :, half:], v[:, :, half:])

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        expected = F.scaled_dot_product_attention(q, k, v)
    split()
    torch.cuda.synchronize()
    result["split_max_diff"] = (held["out"].float() - expected.float()).abs().max().item()
    result["us"]["cudnn with lse, 2304 queries"] = replay_us(lambda: cudnn_lse(q, k, v))
    result["us"]["split: halves on two streams"] = replay_us(halves)
    result["us"]["split: halves on one stream"] = replay_us(halves_in_order)
    a, b = held["a"], held["b"]
    result["us"]["split: merge alone"] = replay_us(lambda: merge(*a, *b))
    result["us"]["split: halves on two streams + merge"] = replay_us(split)
    print(json.dumps(result, indent=1))
    write_result(result, out)


if __name__ == "__main__":
    main()
