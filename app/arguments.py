"""Command-line arguments that several commands share (model, request, parallel run)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from pipelines.registry import MODELS, MODELS_ENV
from pipelines.requests import RequestError

STRATEGIES = ("ulysses", "ring", "allgather", "ulysses-ring")
"""The sequence strategies of engines.plan (repeated here so that `--help` needs no torch import)."""

TRANSPORTS = ("nccl", "copy-engine")
"""The all-to-all transports of engines.copy_engine (repeated for the same reason)."""

BACKEND_PATTERN = re.compile(
    r"(eager|inductor|tensorrt)(-blocks)?(-(default|max-autotune-no-cudagraphs|reduce-overhead))?(\+overlap)?(\+cudagraph)?"
)
"""Engine labels of engines.compile.EngineOptions (repeated here so that `--help` needs no torch import)."""

DEFAULT_RANK_TIMEOUT = 30.0
ENGINE_CACHE_ENV = "ULYSSES_STUDIO_ENGINE_CACHE"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"registered model name: {', '.join(MODELS)} (default tiny-flux)")
    parser.add_argument("--model-path", default=None, metavar="DIR",
                        help=f"a diffusers-format folder to load instead of the registry's (weights are looked "
                             f"up under ${MODELS_ENV} or ~/models otherwise)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")


def add_request_arguments(parser: argparse.ArgumentParser, *, prompt_required: bool = True) -> None:
    if prompt_required:
        parser.add_argument("--prompt", required=True)
    parser.add_argument("--negative-prompt", default=None, help="what to steer away from (Cosmos models)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (model default if omitted)")
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale (model default if omitted)")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--size", default=None, metavar="WxH", help="shorthand for --width and --height")
    parser.add_argument("--frames", type=int, default=None, help="video frames (video models)")
    parser.add_argument("--fps", type=int, default=None, help="video frame rate (video models)")
    if prompt_required:
        parser.add_argument("--input", dest="condition", default=None, metavar="FILE",
                            help="image or video whose frames start the video (video-to-world)")


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strategy", default="ulysses", choices=STRATEGIES,
                        help="how ranks split the transformer's token sequence when several run (default ulysses)")
    parser.add_argument("--all-to-all", default="nccl", choices=TRANSPORTS,
                        help="how the Ulysses all-to-alls and ring K/V passes travel between GPUs: nccl (default), "
                             "or copy-engine (peer copies through symmetric memory, no SM kernels; all ranks on one "
                             "host; no watchdog; with --strategy ring the fastest FLUX setting measured on 2x H200, "
                             "docs/benchmarks.md)")
    parser.add_argument("--cfg-parallel", action="store_true",
                        help="video (Cosmos-style) models: run classifier-free guidance's two branches on two halves "
                             "of the ranks, each half splitting the sequence (needs an even number of ranks; "
                             "requests then need guidance above 1). Image (FLUX-style) models have one branch "
                             "and are unaffected")
    parser.add_argument("--backend", default=None, type=backend_label,
                        help="engine of each rank's transformer: eager, inductor, inductor-blocks (per-block "
                             "compile), inductor...+overlap (keeps FLUX's all-to-all overlap through compilation), any "
                             "of them +cudagraph (CUDA only), tensorrt (where installed); default "
                             "inductor-blocks on GPUs, eager on CPUs")
    parser.add_argument("--engine-cache", type=Path, default=None, metavar="DIR",
                        help=f"compiled-engine cache (default ${ENGINE_CACHE_ENV} or ~/.cache/ulysses-studio/engines)")
    parser.add_argument("--rank-timeout", type=float, default=DEFAULT_RANK_TIMEOUT, metavar="SECONDS",
                        help="how long a rank waits for the others at an agreement point (after each denoising "
                             f"step) before it ends the job (default {DEFAULT_RANK_TIMEOUT:g})")


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """'768x512' -> (width 768, height 512); None -> (None, None)."""
    if size is None:
        return None, None
    try:
        width, height = (int(part) for part in str(size).lower().split("x"))
    except ValueError:
        raise RequestError(f"--size must look like 768x512 (width x height), got {size!r}") from None
    return width, height


def request_fields(args: argparse.Namespace) -> dict:
    """The make_request fields given by request arguments (None where left to the model's default)."""
    width, height = parse_size(args.size)
    return dict(
        negative_prompt=args.negative_prompt, seed=args.seed, steps=args.steps, guidance=args.guidance,
        height=args.height if args.height is not None else height,
        width=args.width if args.width is not None else width,
        frames=args.frames, fps=args.fps,
    )


def engine_cache_dir(given: Path | None) -> Path:
    """--engine-cache, else $ULYSSES_STUDIO_ENGINE_CACHE, else ~/.cache/ulysses-studio/engines."""
    if given is not None:
        return Path(given).expanduser()
    return Path(os.environ.get(ENGINE_CACHE_ENV, "~/.cache/ulysses-studio/engines")).expanduser()


def backend_label(text: str) -> str:
    """argparse type of --backend: a valid engine label, or a usage error naming the choices."""
    if not BACKEND_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an engine; use eager, inductor or tensorrt, optionally with -blocks, +overlap "
            "(inductor) and +cudagraph (e.g. inductor-blocks+cudagraph)"
        )
    return text
