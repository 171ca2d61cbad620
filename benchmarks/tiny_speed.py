"""Benchmark: seconds of one generation by an embedded tiny model on this machine's CPU, once loaded.

    python -m benchmarks.tiny_speed                                   # tiny-cosmos: 17 frames, 128x128
    python -m benchmarks.tiny_speed --model tiny-flux --runs 5
    python -m benchmarks.tiny_speed --folder /tmp/tiny/tiny-cosmos    # a freshly trained folder

One process, one rank, registry defaults (size, frames, steps, guidance), float32 on the CPU with
torch's default thread count. One warm-up generation, then --runs timed ones; prints the median and
the fastest of the total and of each stage (encode / denoise / decode), with the machine's load
average, because other processes on a small CPU move these numbers by tens of percent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from pipelines.factory import load_pipeline
from pipelines.registry import default_folder, get_spec
from pipelines.requests import make_request, read_limits


def measure(name: str, folder: Path, runs: int) -> dict[str, list[float]]:
    """Seconds per stage and in total of `runs` generations (after one warm-up), registry defaults."""
    spec = get_spec(name)
    pipe = load_pipeline(spec, folder, device="cpu")
    request = make_request(spec, read_limits(spec, folder), prompt="a red circle moving right on a black background",
                           seed=0)
    pipe.generate(request)
    seconds: dict[str, list[float]] = {"encode": [], "denoise": [], "decode": [], "total": []}
    for _ in range(runs):
        start = time.perf_counter()
        conditioning = pipe.encode(request)
        encoded = time.perf_counter()
        latents = pipe.denoise(request, conditioning)
        denoised = time.perf_counter()
        pipe.decode(request, latents)
        decoded = time.perf_counter()
        seconds["encode"].append(encoded - start)
        seconds["denoise"].append(denoised - encoded)
        seconds["decode"].append(decoded - denoised)
        seconds["total"].append(decoded - start)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tiny_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-cosmos", choices=("tiny-cosmos", "tiny-flux"))
    parser.add_argument("--folder", type=Path, help="model folder (default: the embedded one in assets/)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)

    spec = get_spec(args.model)
    folder = args.folder or default_folder(spec)
    load = os.getloadavg()[0]
    seconds = measure(args.model, folder, args.runs)
    shape = f"{spec.frames} frames, " if spec.media == "video" else ""
    print(f"{args.model} ({folder}): {shape}{spec.width}x{spec.height}, {spec.steps} steps, guidance {spec.guidance}, "
          f"{torch.get_num_threads()} threads, {args.runs} runs, load average before {load:.2f}")
    for stage, values in seconds.items():
        print(f"  {stage:8s} median {statistics.median(values):.3f} s, fastest {min(values):.3f} s")


if __name__ == "__main__":
    main()
