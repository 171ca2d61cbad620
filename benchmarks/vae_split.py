"""Benchmark: the VAE decode whole, and split into 2 and 4 row bands run one after another on one device.

    python -m benchmarks.vae_split --out vae-split.json          # FLUX.1-dev 1024², Cosmos-Predict2-2B 93x704x1280
    python -m benchmarks.vae_split --tiny --out tiny.json        # the embedded tiny models' VAEs, CPU

What one rank of a split decode computes (pipelines/split_vae.py: the trunk, conv_in and the mid-block
on the whole latent, then its band of rows with halos through the up blocks), measured without the
other ranks: the parts run in this process, each part's work timed apart (device-synchronised), the
trunk counted in every part, as every rank runs it. A part's seconds bound from below what a rank of
an N-rank split decode takes (it adds the GroupNorm all-reduces and the gather); the whole decode's
seconds are what rank 0 alone takes. The VAEs are the checkpoints' published architectures
(pipelines.families) with random weights in the dtype their pipelines run them (FLUX: the run's,
bf16 on GPUs; Cosmos: float32), decoding random latents of the model's default size (--height,
--width, --frames to change it). Reported per model: seconds of the whole decode (median of --runs),
and per split: the largest and the mean part's seconds, the whole split's seconds (all parts one
after another), and the largest difference from the whole decode's output (in [-1, 1]). For the Wan
2.1 VAE (Cosmos-Predict2) the same for the encode of an input video of that size (encode_wan: bands
of input rows; the mid-block and head on the whole latent, in every part): `encode_s`, `encode_splits`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import diffusers
import torch

from benchmarks.generation import build_vae, real_components, tiny_components
from benchmarks.inputs import benchmarkable
from benchmarks.step import comma_list, sync
from pipelines.split_vae import Parts, encode_wan, split_decode

MODELS = ("flux-dev", "cosmos-predict2-2b-video2world")


def latent_shape(vae: torch.nn.Module, height: int, width: int, frames: int) -> tuple[int, ...]:
    """The latents a `frames` x `height` x `width` result decodes from (an image VAE's have no frame axis)."""
    config = vae.config
    if "z_dim" in config:  # Wan
        spatial, temporal = config.get("scale_factor_spatial", 8), config.get("scale_factor_temporal", 4)
        if height % spatial or width % spatial or (frames - 1) % temporal:
            raise ValueError(f"{frames}x{height}x{width} is not 1 + k x {temporal} frames of multiples of {spatial} px")
        return (1, config.z_dim, (frames - 1) // temporal + 1, height // spatial, width // spatial)
    spatial = 2 ** (len(config.block_out_channels) - 1)
    if height % spatial or width % spatial:
        raise ValueError(f"{height}x{width} is not a multiple of {spatial} px")
    return (1, config.latent_channels, height // spatial, width // spatial)


def timed(fn: Any, device: torch.device) -> tuple[float, Any]:
    """(seconds, result) of fn(), device-synchronised."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def measure(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One model's row: the whole decode and each split."""
    arch = tiny_components(name) if args.tiny else real_components(name)
    spec = arch.spec
    height, width = args.height or spec.height, args.width or spec.width
    frames = args.frames or spec.frames
    vae = build_vae(arch, device=device)
    shape = latent_shape(vae, height, width, frames)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device, vae.dtype)
    row: dict[str, Any] = dict(model=spec.name, vae=type(vae).__name__, dtype=str(vae.dtype).removeprefix("torch."),
                               shape=f"{height}x{width}" if len(shape) == 4 else f"{frames}x{height}x{width}",
                               latents=list(shape))
    with torch.no_grad():
        timed(lambda: vae.decode(z).sample, device)  # warm-up (cuDNN picks its kernels)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        whole_runs = [timed(lambda: vae.decode(z).sample, device) for _ in range(args.runs)]
        whole = whole_runs[-1][1].float()
        row["whole_s"] = statistics.median(s for s, _ in whole_runs)
        row["whole_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        row["splits"] = _split_rows(lambda parts: split_decode(vae, z, parts), whole, args, device)
        del whole
        if "z_dim" in vae.config and not vae.config.is_residual:
            video = (torch.rand(1, 3, frames, height, width, generator=torch.Generator().manual_seed(1)) * 2 - 1)
            row.update(_encode_rows(vae, video.to(device, vae.dtype), args, device))
    vae = z = None  # freed before the cache is emptied
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _encode_rows(vae: torch.nn.Module, video: torch.Tensor, args: argparse.Namespace, device: torch.device
                 ) -> dict[str, Any]:
    """The Wan encode of `video` whole and split (encode_wan's moments against the encoder's)."""
    def moments() -> torch.Tensor:
        posterior = vae.encode(video).latent_dist
        return torch.cat([posterior.mean, posterior.logvar], dim=1)

    timed(moments, device)  # warm-up
    runs = [timed(moments, device) for _ in range(args.runs)]
    whole = runs[-1][1].float()
    splits = _split_rows(lambda parts: encode_wan(vae, video, parts), whole, args, device)
    return dict(encode_s=statistics.median(s for s, _ in runs), encode_splits=splits)


def _split_rows(run: Callable[[Parts], torch.Tensor], whole: torch.Tensor, args: argparse.Namespace,
                device: torch.device) -> list[dict[str, Any]]:
    """Per --parts count: `run(parts)` with all parts in this process, --runs times; the medians of the
    largest part's, the mean part's and all parts' seconds, and the largest difference from `whole`."""
    rows = []
    for count in args.parts:
        largest, means, totals, difference = [], [], [], 0.0
        for _ in range(args.runs):
            parts = Parts.local(count, device=device)
            seconds, out = timed(partial(run, parts), device)
            difference = max(difference, (out.float() - whole).abs().max().item())
            largest.append(max(parts.seconds.values()))
            means.append(sum(parts.seconds.values()) / count)
            totals.append(seconds)
            del out
        rows.append(dict(parts=count, largest_part_s=statistics.median(largest), mean_part_s=statistics.median(means),
                         all_parts_s=statistics.median(totals), max_abs_difference=difference))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Compact text table of the rows."""
    head = (f"{'model':<32} {'shape':<14} {'whole s':>8} {'parts':>6} {'largest part s':>15} {'vs whole':>9} "
            f"{'max diff':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        for stage, whole, splits in (("decode", r["whole_s"], r["splits"]),
                                     ("encode", r.get("encode_s"), r.get("encode_splits", []))):
            for split in splits:
                ratio = whole / split["largest_part_s"]
                lines.append(f"{r['model'] + ' ' + stage:<32} {r['shape']:<14} {whole:>8.3f} {split['parts']:>6} "
                             f"{split['largest_part_s']:>15.3f} {ratio:>8.2f}x {split['max_abs_difference']:>9.1e}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=",".join(MODELS),
                   help=f"comma-separated registered checkpoints: {', '.join(benchmarkable())} (default "
                        f"{','.join(MODELS)})")
    p.add_argument("--parts", default="2,4", help="comma-separated part counts (default 2,4)")
    p.add_argument("--height", type=int, default=None, help="default: the model's")
    p.add_argument("--width", type=int, default=None, help="default: the model's")
    p.add_argument("--frames", type=int, default=None, help="default: the model's (video models)")
    p.add_argument("--runs", type=int, default=3, help="timed decodes of each kind (median; default 3)")
    p.add_argument("--tiny", action="store_true", help="the embedded tiny models' VAEs (CPU)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    args.models = comma_list(p, args.model, "model", tuple(benchmarkable()))
    try:
        args.parts = [int(n) for n in args.parts.split(",") if n]
    except ValueError:
        p.error(f"--parts takes whole numbers, got {args.parts!r}")
    if args.runs < 1 or not args.parts or min(args.parts) < 2:
        p.error("--runs must be >= 1 and every part count >= 2")
    return args


def main(argv: list[str] | None = None) -> None:
    """Benchmark entry point (see the module docstring)."""
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    meta = dict(command=f"python -m benchmarks.vae_split {' '.join(sys.argv[1:] if argv is None else argv)}",
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                python=platform.python_version(), torch=torch.__version__, diffusers=diffusers.__version__,
                runs=args.runs, weights="random, tiny configs" if args.tiny else "random, real architectures")
    rows = []
    for name in args.models:
        rows.append(measure(name, args, device))
        print(f"[vae_split] {name}: whole {rows[-1]['whole_s']:.3f} s", file=sys.stderr, flush=True)
        if args.out:  # after every model, so a run cut short still leaves its numbers
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
