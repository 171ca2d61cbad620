"""`ulysses-studio build`: compile a model's transformer engines ahead of time into the engine cache.

    ulysses-studio build --model flux-dev --size 1024x1024 --ranks 2 --backend inductor-blocks+cudagraph

Every rank loads the model, wraps its transformer in the parallel plan and the engine, and runs
the denoising loop of one request of the given size for --steps steps: the transformer is called
exactly as serve and batch call it, so the artifacts written under the cache folder (key: model
config, dtype, shape, plan, rank, backend, library versions; see engines/levers/cache.py) are the ones
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

from app.commands.arguments import (
    add_model_arguments,
    add_parallel_arguments,
    add_replicas_argument,
    lora_limits,
    request_fields,
    run_options,
)

DEFAULT_BACKEND = "inductor-blocks"
"""What `build` compiles on CPUs (--device cpu, or a machine without a GPU) when no --backend is given (on GPUs:
what serve runs there)."""


class BuildError(ValueError):
    """A build command line that cannot run."""


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--size", default=None, metavar="WxH", help="image/video size (model default if omitted)")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--frames", type=int, default=None, help="video frames (video models)")
    parser.add_argument("--ranks", type=int, default=1, help="ranks the engines are built for (default 1)")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps run while building (default 2)")
    add_replicas_argument(parser)
    add_parallel_arguments(parser, backend_default=None)


def check_build(args: argparse.Namespace):
    """Validate the command line without loading anything; returns (spec, folder, request, engine options)."""
    from engines.options import EngineOptions, default_backend
    from pipelines.registry import resolve_model
    from pipelines.requests import make_request, read_limits

    if args.ranks < 1:
        raise BuildError(f"--ranks must be >= 1, got {args.ranks}")
    device = args.device
    if device is None:
        from app.commands.memory_plan import visible_gpus

        device = "cuda" if visible_gpus() else "cpu"
    backend = args.backend or (DEFAULT_BACKEND if device == "cpu"
                               else default_backend("cuda", cache=args.cache is not None))
    try:
        options = EngineOptions.parse(backend)
    except ValueError as error:
        raise BuildError(f"--backend {backend!r}: {error}") from None
    spec, folder = resolve_model(args.model, args.model_path)
    fields = {k: v for k, v in request_fields(_request_namespace(args)).items() if k in ("height", "width", "frames")}
    limits = lora_limits(args, spec, folder, read_limits(spec, folder, cfg_parallel=args.cfg_parallel))
    request = make_request(spec, limits, prompt="engine build", steps=args.steps, **fields)
    return spec, folder, request, options


def _request_namespace(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(negative_prompt=None, seed=0, steps=None, guidance=None, guidance_2=None,
                              height=args.height, width=args.width, size=args.size, frames=args.frames, fps=None)


def run_build(args: argparse.Namespace) -> int:
    """Build (or find) the engines; with --ranks > 1 outside torchrun, start torchrun first.

    The build is one request through the same runtime as serve and batch (start_runtime), so the
    engines it compiles are called with exactly the inputs theirs will be, and land under the keys
    they will look up.
    """
    spec, folder, request, engine = check_build(args)
    if args.ranks > 1 and "WORLD_SIZE" not in os.environ:
        from app.commands.launch import torchrun_command
        from app.commands.torchrun import free_port

        return subprocess.call(torchrun_command(args.ranks, sys.argv[1:], free_port()))
    if int(os.environ.get("WORLD_SIZE", "1")) != args.ranks:
        raise BuildError(f"--ranks {args.ranks} but {os.environ.get('WORLD_SIZE', '1')} ranks are running")

    from app.ranks.runtime import start_runtime
    from app.ranks.stopping import stop_on_signals

    started = time.perf_counter()
    options = dataclasses.replace(run_options(args), backend=engine.label)
    cache_dir = options.cache_dir
    with stop_on_signals() as stop, start_runtime([(spec, folder)], options, stop=stop,
                                                  replicas=args.replicas) as runtime:
        if not runtime.is_main:
            runtime.follow()
            return 0
        shape = f"{request.width}x{request.height}" + (f"x{request.frames}" if spec.media == "video" else "")
        for index, layout in enumerate(runtime.layouts):
            # Every group builds its own ranks' engines, side by side (where the run regroups, in every layout
            # rank 0 may choose).
            runtime.regroup(index)
            where = f"{runtime.world_size} rank(s)" if layout.replicas == 1 else \
                f"{layout.replicas} groups of {layout.group_size} rank(s)"
            _progress(f"building {engine.label} engine of {spec.name} for {shape} on {where} ({layout.plan}); "
                      "the first step compiles")
            _run_everywhere(runtime, index, spec.media, request)
            built = layout.service.pipelines[spec.media].transformer
            for record in getattr(built, "builds", {}).values():
                state = "cache hit" if record.cache_hit else "built"
                _progress(f"rank 0: {state} in {record.seconds:.1f} s, key {record.key} under {cache_dir}")
        runtime.regroup(0)
    _progress(f"done in {time.perf_counter() - started:.1f} s")
    return 0


def _run_everywhere(runtime, index: int, model: str, request) -> None:
    """Run `request` on every group of layout `index` at once (rank 0's own in this thread); raises the first
    failure."""
    from concurrent.futures import ThreadPoolExecutor

    from app.server.jobs import layout_workers

    own, *others = layout_workers(runtime, index)
    with ThreadPoolExecutor(max(1, len(others))) as pool:
        pending = [pool.submit(worker.run, model, request) for worker in others]
        own.run(model, request, on_step=lambda done, total: _progress(f"step {done}/{total}"))
        for future in pending:
            future.result()


def _progress(text: str) -> None:
    print(f"[build] {text}", file=sys.stderr, flush=True)
