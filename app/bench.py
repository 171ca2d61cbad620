"""`ulysses-studio bench`: the engines benchmark (engines/benchmark.py) under torchrun, plus a PNG chart.

    ulysses-studio bench --ranks 2 --model flux-dev --backends eager,inductor-blocks+cudagraph --out bench/
    ulysses-studio bench --ranks 2 --tiny --out bench/          # CPU smoke test, seconds

Writes bench/bench.json (rows: per-step ms median, speedup vs 1 GPU of the same backend, MFU,
peak GiB, build seconds) and bench/bench.png (ms per mode and backend). Peers beyond
diffusers-native Ulysses (xDiT, cache-dit) are not wired in yet: see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path


class BenchError(ValueError):
    """A bench command line that cannot run."""


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="ranks (GPUs) for the parallel modes (default 2)")
    parser.add_argument("--out", type=Path, required=True, help="folder for bench.json and bench.png")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on CPU (gloo): a smoke test")
    parser.add_argument("benchmark_args", nargs=argparse.REMAINDER, metavar="...",
                        help="passed to engines.benchmark (--model, --sizes, --video, --backends, --strategies, ...)")


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark on --ranks ranks, then draw the chart from its JSON."""
    from app.launch import free_port

    import sys

    if args.ranks < 1:
        raise BenchError(f"--ranks must be >= 1, got {args.ranks}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = args.out / "bench.json"
    extra = [a for a in args.benchmark_args if a != "--"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "engines.benchmark",
           *(["--tiny"] if args.tiny else []), *extra, "--out", str(result)]
    status = subprocess.call(cmd)
    if status != 0 or not result.is_file():
        print(f"error: the benchmark exited with status {status}", file=sys.stderr)
        return status or 1
    chart(json.loads(result.read_text())["rows"], args.out / "bench.png")
    return 0


def chart(rows: list[dict], path: Path) -> None:
    """Horizontal bars of ms per row (matplotlib if installed, else PIL)."""
    labels = [f"{r['model']} {r['shape']} {r['mode']} [{r['backend']}]" for r in rows]
    values = [r["ms"] if r["ms"] == r["ms"] else 0.0 for r in rows]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1))
        ax.barh(labels, values)
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median)")
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
    for i, (label, ms) in enumerate(zip(labels, values)):
        y = 5 + i * row_h
        draw.text((5, y), label[:80], fill="black")
        draw.rectangle([label_w, y + 2, label_w + int(bar_w * ms / top), y + row_h - 4], fill=(70, 110, 200))
        draw.text((label_w + int(bar_w * ms / top) + 4, y), f"{ms:.1f} ms", fill="black")
    image.save(path)
