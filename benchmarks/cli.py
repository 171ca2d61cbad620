"""`python -m benchmarks` (or `ulysses-studio bench`): one of the benchmarks (benchmarks.step, benchmarks.generation)
under torchrun, plus a PNG chart.

    ulysses-studio bench --ranks 2 --out bench/ -- --model flux-dev --backends eager,inductor-blocks+cudagraph
    ulysses-studio bench --ranks 2 --out bench/ -- --strategies "" --no-diffusers --peers xdit,cache-dit
    ulysses-studio bench --ranks 2 --end-to-end --out bench/ -- --model flux-dev --backends inductor-blocks+cudagraph
    ulysses-studio bench --ranks 2 --tiny --out bench/          # CPU smoke test, seconds

Before any rank starts, the benchmark's arguments are checked, and what this machine cannot run is refused with one
line and exit status 2 (benchmarks/preflight.py): a CUDA-only option without CUDA, or ranks on CPUs whose random
weights exceed the memory available. torchrun is app.commands.torchrun, which leaves no log folder behind.

Modes of the default benchmark (benchmarks/step.py: one transformer forward): 1 GPU, ours per
plan (+ CFG), diffusers-native Ulysses, and with --peers the peers xDiT and cache-dit (their
context parallelism on the same FLUX weights, eager and compiled as each advises; a peer that is not
installed or fails gets rows saying why). Writes bench/bench.json (rows: per-step ms median, speedup
vs 1 GPU of the same backend, MFU, peak GiB, build seconds) and bench/bench.png (ms per mode and
backend).

--end-to-end (benchmarks/generation.py): whole generations through our pipelines (text encoding, denoising,
VAE decode) at the model's real size and steps (FLUX.1-dev 1024x1024 x 28; Cosmos-Predict2 720p-class
x 35), random weights of the real architectures, 1 GPU and every plan on all ranks, parallelized and
compiled as serve and batch do. Writes bench/e2e.json (median total seconds, seconds per stage, ms per
step, speedup vs 1 GPU of the same backend, peak GiB per rank) and bench/e2e.png (seconds per mode).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


class BenchError(ValueError):
    """A bench command line that cannot run."""


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="ranks (GPUs) for the parallel modes (default 2)")
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for bench.json and bench.png (e2e.json and e2e.png with --end-to-end)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on CPU (gloo): a smoke test")
    parser.add_argument("--end-to-end", action="store_true",
                        help="whole generations (encode, denoise, decode) through our pipelines instead of one "
                             "transformer forward: benchmarks.generation (--model, --steps, --backends, --strategies, "
                             "--cfg, --runs, ...)")
    parser.add_argument("benchmark_args", nargs=argparse.REMAINDER, metavar="...",
                        help="passed to benchmarks.step (--model, --sizes, --video, --backends, --strategies, "
                             "--peers xdit,cache-dit, ...) or, with --end-to-end, to benchmarks.generation")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ulysses-studio bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark the arguments name; a bad command line is one line on stderr and exit status 2."""
    try:
        return run_bench(build_parser().parse_args(argv))
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark on --ranks ranks, then draw the chart from its JSON."""
    from app.commands.launch import free_port

    if args.ranks < 1:
        raise BenchError(f"--ranks must be >= 1, got {args.ranks}")
    name, module = ("e2e", "benchmarks.generation") if args.end_to_end else ("bench", "benchmarks.step")
    result = args.out / f"{name}.json"
    benchmark_args = [*(["--tiny"] if args.tiny else []), *(a for a in args.benchmark_args if a != "--")]
    check_machine(benchmark_args, ranks=args.ranks, end_to_end=args.end_to_end)
    args.out.mkdir(parents=True, exist_ok=True)
    # app.commands.torchrun: torchrun that removes its log folder (plain torchrun leaves a torchelastic_* one per run)
    cmd = [sys.executable, "-m", "app.commands.torchrun", f"--nproc-per-node={args.ranks}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", module, *benchmark_args,
           "--out", str(result)]
    status = subprocess.call(cmd)
    if status != 0 or not result.is_file():
        print(f"error: the benchmark exited with status {status}", file=sys.stderr)
        return status or 1
    rows = json.loads(result.read_text())["rows"]
    picture = args.out / f"{name}.png"
    if args.end_to_end:
        chart(rows, picture, key="total_s", unit="s", axis="seconds per generation (median)")
    else:
        chart(rows, picture)
    print(f"bench: wrote {result} and {picture}", flush=True)
    return 0


def check_machine(benchmark_args: list[str], *, ranks: int, end_to_end: bool) -> None:
    """Before any rank starts: the benchmark's own command-line checks (argparse's exit status 2), then BenchError
    saying what this machine cannot run (benchmarks.preflight: CUDA-only options without CUDA, weights larger than
    the memory available)."""
    import torch

    from benchmarks.preflight import available_memory, cannot_run

    if end_to_end:
        from benchmarks.generation import parse_args

        options = parse_args(benchmark_args)
    else:
        from benchmarks.step import parse_args

        options = parse_args(benchmark_args, world_size=ranks)
    problem = cannot_run(options, ranks=ranks, end_to_end=end_to_end, cuda=torch.cuda.is_available(),
                         available=available_memory())
    if problem:
        raise BenchError(problem)


def chart(rows: list[dict], path: Path, *, key: str = "ms", unit: str = "ms",
          axis: str = "ms per step (median)") -> None:
    """Horizontal bars of each row's `key` (matplotlib if installed, else PIL); rows without a value draw none."""
    labels = [f"{r['model']} {r['shape']} {r['mode']} [{r['backend']}]" for r in rows]
    values = [r[key] if r[key] is not None and r[key] == r[key] else 0.0 for r in rows]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1))
        ax.barh(labels, values)
        ax.invert_yaxis()
        ax.set_xlabel(axis)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return
    except ImportError:
        pass
    from PIL import Image, ImageDraw

    row_h, label_w, bar_w = 18, 520, 400
    image = Image.new("RGB", (label_w + bar_w + 90, row_h * len(rows) + 10), "white")
    draw = ImageDraw.Draw(image)
    top = max(values) or 1.0
    for i, (label, value) in enumerate(zip(labels, values)):
        y = 5 + i * row_h
        draw.text((5, y), label[:80], fill="black")
        draw.rectangle([label_w, y + 2, label_w + int(bar_w * value / top), y + row_h - 4], fill=(70, 110, 200))
        draw.text((label_w + int(bar_w * value / top) + 4, y), f"{value:.1f} {unit}", fill="black")
    image.save(path)
