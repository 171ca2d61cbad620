"""`ulysses-studio generate`: one image or video from the command line, on one rank or many."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from app.commands.arguments import lora_limits, request_fields, run_options
from app.outputs import check_output_path
from app.ranks.stopping import stop_on_signals
from pipelines.registry import ModelSpec, resolve_model
from pipelines.requests import GenerationRequest, make_request, read_limits


@dataclass(frozen=True)
class GenerateJob:
    """A checked `generate` command line: what to make and where to write it."""

    spec: ModelSpec
    folder: Path
    request: GenerationRequest
    out: Path


def check_generate(args: argparse.Namespace) -> GenerateJob:
    """Validate the command line without loading anything (pure, so every rank gets the same answer)."""
    spec, folder = resolve_model(args.model, args.model_path)
    limits = lora_limits(args, spec, folder, read_limits(spec, folder, cfg_parallel=args.cfg_parallel))
    request = make_request(spec, limits, prompt=args.prompt, condition=args.condition,
                           **request_fields(args))
    return GenerateJob(spec=spec, folder=folder, request=request, out=check_output_path(args.out, spec))


def run_generate(args: argparse.Namespace) -> int:
    """Generate one result and write it (rank 0); other ranks take part in the denoising."""
    job = check_generate(args)

    # Heavy imports only once the request is known to be good.
    from tqdm import tqdm

    from app.failures import JobCancelled
    from app.outputs import write_result
    from app.ranks.runtime import start_runtime

    with stop_on_signals() as stop, start_runtime([(job.spec, job.folder)], run_options(args), stop=stop) as runtime:
        if not runtime.is_main:
            runtime.service.follow()
            return 0
        quiet = args.quiet
        if not quiet:
            print(runtime.startup.describe(), file=sys.stderr, flush=True)
        started = time.perf_counter()
        with tqdm(total=job.request.steps, desc="denoising", unit="step", disable=quiet, file=sys.stderr) as bar:
            try:
                generation = runtime.service.run(job.spec.media, job.request,
                                                 on_step=lambda done, total: bar.update(done - bar.n))
            except JobCancelled:
                print("interrupted", file=sys.stderr)
                return 130
        write_started = time.perf_counter()
        write_result(generation.result, job.out, job.request, job.spec, generation.computed_steps)
        if not quiet:  # before the ranks' teardown: the result is there, whatever the teardown takes
            stages = generation.stages.with_write(time.perf_counter() - write_started).describe() \
                if generation.stages is not None else ""
            cached = "" if generation.computed_steps is None else (
                f"; {generation.computed_steps} of {job.request.steps} steps computed, the rest from the step cache")
            print(f"wrote {job.out} ({time.perf_counter() - started:.1f} s{cached}{'; ' if stages else ''}{stages}"
                  f"{engine_builds(runtime.service.pipelines[job.spec.media])})", file=sys.stderr, flush=True)
    return 0


def engine_builds(pipeline: object) -> str:
    """What building the engines took in this process's request, part of its steps' seconds (each engine's first
    call of a shape: its compiler artifacts loaded or compiled, its warm-up and CUDA graph capture), e.g.
    "; engine built in 4.2 s from the engine cache"; "" with none built."""
    from engines.levers.compile import Engine

    builds = [record for _, engine in pipeline.transformers()
              if isinstance(engine, Engine) and engine.options.backend != "eager" for record in engine.builds.values()]
    if not builds:
        return ""
    where = "from the engine cache" if all(r.cache_hit for r in builds) else (
        "compiled" if not any(r.cache_hit for r in builds) else "compiled in part")
    return f"; engine{'s' if len(builds) > 1 else ''} built in {sum(r.seconds for r in builds):.1f} s {where}"
