"""`ulysses-studio build`: compile a model's transformer engines ahead of time into the engine cache.

    ulysses-studio build --model flux-dev --size 1024x1024 --ranks 2 --backend inductor-blocks+cudagraph

Every rank loads the model, wraps its transformer in the parallel plan and the engine, and runs
the denoising loop of one request of the given size for --steps steps: the transformer is called
exactly as serve and batch call it, so the artifacts written under the cache folder (key: model
config, dtype, shape, plan, rank, backend, library versions; see engines/cache.py) are the ones
they will look up. Text encoding runs once on rank 0 and is broadcast. With --ranks N > 1 and no
torchrun around, the command starts torchrun itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

from app.arguments import STRATEGIES, add_model_arguments, request_fields

DEFAULT_BACKEND = "inductor-blocks"


class BuildError(ValueError):
    """A build command line that cannot run."""


def default_cache_dir() -> Path:
    """$ULYSSES_STUDIO_ENGINE_CACHE, or ~/.cache/ulysses-studio/engines."""
    return Path(os.environ.get("ULYSSES_STUDIO_ENGINE_CACHE", "~/.cache/ulysses-studio/engines")).expanduser()


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--size", default=None, metavar="WxH", help="image/video size (model default if omitted)")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--frames", type=int, default=None, help="video frames (video models)")
    parser.add_argument("--ranks", type=int, default=1, help="ranks the engines are built for (default 1)")
    parser.add_argument("--strategy", default="ulysses", choices=STRATEGIES)
    parser.add_argument("--backend", default=DEFAULT_BACKEND,
                        help="engine: eager, inductor, inductor-blocks, ...+cudagraph, tensorrt "
                             f"(default {DEFAULT_BACKEND})")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps run while building (default 2)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="engine cache folder (default $ULYSSES_STUDIO_ENGINE_CACHE or ~/.cache/ulysses-studio/engines)")


def check_build(args: argparse.Namespace):
    """Validate the command line without loading anything; returns (spec, folder, request, options)."""
    from engines.compile import EngineOptions
    from pipelines.registry import resolve_model
    from pipelines.requests import make_request, read_limits

    if args.ranks < 1:
        raise BuildError(f"--ranks must be >= 1, got {args.ranks}")
    try:
        options = EngineOptions.parse(args.backend)
    except ValueError as error:
        raise BuildError(f"--backend {args.backend!r}: {error}") from None
    spec, folder = resolve_model(args.model, args.model_path)
    fields = {k: v for k, v in request_fields(_request_namespace(args)).items() if k in ("height", "width", "frames")}
    request = make_request(spec, read_limits(spec, folder), prompt="engine build", steps=args.steps, **fields)
    return spec, folder, request, options


def _request_namespace(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(negative_prompt=None, seed=0, steps=None, guidance=None, height=args.height,
                              width=args.width, size=args.size, frames=args.frames, fps=None)


def _progress(ctx_rank: int, text: str) -> None:
    if ctx_rank == 0:
        print(f"[build] {text}", file=sys.stderr, flush=True)


def run_build(args: argparse.Namespace) -> int:
    """Build (or find) the engines; with --ranks > 1 outside torchrun, start torchrun first."""
    spec, folder, request, options = check_build(args)
    if args.ranks > 1 and "WORLD_SIZE" not in os.environ:
        from app.launch import free_port, torchrun_command

        argv = [a for a in sys.argv[1:]]
        return subprocess.call(torchrun_command(args.ranks, argv, free_port()))

    import torch
    import torch.distributed as dist

    from engines.compile import prepare_engine
    from engines.distributed import init_parallel, shutdown
    from engines.parallelize import parallelize_transformer
    from engines.plan import ParallelPlan
    from pipelines.factory import default_dtype, load_pipeline

    ctx = init_parallel(args.device)
    if ctx.world_size != args.ranks:
        raise BuildError(f"--ranks {args.ranks} but {ctx.world_size} ranks are running")
    cache_dir = args.cache_dir or default_cache_dir()
    try:
        started = time.perf_counter()
        _progress(ctx.rank, f"loading {spec.name} from {folder} on {ctx.world_size} rank(s)")
        pipeline = load_pipeline(spec, folder, device=ctx.device, dtype=default_dtype(ctx.device),
                                 with_encoders=ctx.is_main)
        cond = [_to_cpu(pipeline.encode(request)) if ctx.is_main else None]
        if ctx.is_distributed:
            dist.broadcast_object_list(cond, src=0, group=ctx.control_group)
        transformer = pipeline.transformer
        if ctx.is_distributed:
            plan = ParallelPlan.auto(ctx.world_size, pipeline.transformer_config.num_attention_heads,
                                     strategy=args.strategy)
            transformer = parallelize_transformer(transformer, ctx, plan)
        engine = prepare_engine(transformer, options, cache_dir=cache_dir, rank=ctx.rank)
        pipeline.use_transformer(engine)
        _progress(ctx.rank, f"building {options.label} engine for {request.width}x{request.height}"
                            f"{f'x{request.frames}' if spec.media == 'video' else ''} (first step compiles)")
        with torch.no_grad():
            pipeline.denoise(request, cond[0],
                             on_step=lambda done, total: _progress(ctx.rank, f"step {done}/{total}"))
        for record in engine.builds.values():
            state = "cache hit" if record.cache_hit else ("built" if record.key else "nothing to build (eager)")
            _progress(ctx.rank, f"{state} in {record.seconds:.1f} s, key {record.key or '-'} under {cache_dir}")
        _progress(ctx.rank, f"done in {time.perf_counter() - started:.1f} s")
    finally:
        shutdown(ctx)
    return 0


def _to_cpu(conditioning):
    """A copy of an encode() result whose tensors are on the CPU (for broadcast_object_list)."""
    import torch

    return dataclasses.replace(conditioning, **{
        f.name: getattr(conditioning, f.name).cpu()
        for f in dataclasses.fields(conditioning) if isinstance(getattr(conditioning, f.name), torch.Tensor)
    })
