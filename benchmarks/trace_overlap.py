"""Summarise a torch.profiler Chrome trace of one parallel forward: compute vs NCCL time, and overlap.

    python -m benchmarks.trace_overlap PROFILE_DIR/*.json.gz      # traces of benchmarks.step --profile

For each trace: the window from the end of the first NCCL kernel (the ranks' start skew: the
first collective waits for the later rank) to the last kernel; in it, the time some compute
kernel runs (union over streams), the time some NCCL kernel runs, their overlap, and the time no
compute kernel runs. Kernels inside CUDA graphs are listed by CUPTI like any other. A second line
sums the call's kernel time by kind (GEMMs, attention, Triton, local copies run as kernels, NCCL
without the start-skew wait, other), over the whole call: the work before the first collective
counts too. The kinds are those of the engines' GPU paths (cuBLAS, cuDNN SDPA, inductor).
"""

from __future__ import annotations

import gzip
import json
import sys


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kind(name: str) -> str:
    """The kind of a kernel, by its name."""
    lowered = name.lower()
    if "nccl" in lowered:
        return "NCCL"
    if lowered.startswith("triton"):  # inductor's kernels, also those named after the attention they feed
        return "Triton"
    if "sdpa" in lowered or "flash" in lowered or "attention" in lowered:
        return "attention"
    if lowered.startswith(("nvjet", "sm90_xmma", "cutlass")) or "gemm" in lowered:
        return "GEMM"
    if lowered.startswith("memcpy"):
        return "copies"
    return "other"


def summarise(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    nccl = [e for e in events if kind(e["name"]) == "NCCL"]
    start = min(e["ts"] for e in events)
    first = None
    if nccl:
        first = min(nccl, key=lambda e: e["ts"])
        start = first["ts"] + first["dur"]
    end = max(e["ts"] + e["dur"] for e in events)

    def spans(kernels: list[dict]) -> list[tuple[float, float]]:
        return _union([(max(e["ts"], start), e["ts"] + e["dur"]) for e in kernels if e["ts"] + e["dur"] > start])

    compute = spans([e for e in events if kind(e["name"]) != "NCCL"])
    comm = spans(nccl)
    window = end - start
    by_kind: dict[str, float] = {}
    for e in events:
        if e is not first:
            name = kind(e["name"])
            by_kind[name] = by_kind.get(name, 0.0) + e["dur"]
    return (f"{path}: window {window / 1e3:.1f} ms, compute {_length(compute) / 1e3:.1f} ms, "
            f"NCCL {_length(comm) / 1e3:.1f} ms, overlapped {_intersection(compute, comm) / 1e3:.1f} ms, "
            f"no compute {(window - _length(compute)) / 1e3:.1f} ms\n  kernel time by kind: "
            + ", ".join(f"{name} {ms / 1e3:.2f} ms" for name, ms in sorted(by_kind.items(), key=lambda x: -x[1])))


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(summarise(name))
