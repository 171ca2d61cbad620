"""Command line: `ulysses-studio generate|serve|batch|build|bench|launch` (also `python -m app`).

`bench` runs `python -m benchmarks` (benchmarks.cli) with the same arguments: the benchmark harness
imports the app, never the other way round.

Environment: HF_HUB_OFFLINE=1, and for the commands that run models the variables of
engines.options.run_environment (cuBLAS without a workspace, inductor's kernels beside the engine
cache), each set here, before the first model is loaded, unless the user set it. Where bytecode may not be
written beside the sources (PYTHONDONTWRITEBYTECODE), it is kept in the app's own cache folder instead
(engines.options.bytecode_outside_sources).

User mistakes (unknown model, missing weights, bad sizes, unwritable output, a busy port, a missing
prompt file) end with one line on stderr and exit status 2, before any model is loaded. A rank that
is lost mid-run ends the process with one line and exit status 1. Bugs keep their tracebacks.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from app.commands.arguments import (
    OptionsError,
    add_model_arguments,
    add_parallel_arguments,
    add_request_arguments,
    parse_size,
    run_options,
)
from app.commands.batch import BatchError, add_batch_arguments, check_batch, run_batch
from app.commands.build import BuildError, add_build_arguments, run_build
from app.commands.generate import check_generate, run_generate
from app.commands.launch import LaunchError, add_launch_arguments, hand_over_exit_status, run_launch
from app.failures import JobFailed, RankLost, StartupError
from app.outputs import OutputError
from app.ranks.stopping import end_process
from app.server import serve as serve_module
from app.server.serve import ServeError, add_serve_arguments, check_serve, run_serve
from engines.options import bytecode_outside_sources, engine_cache_dir, run_environment, set_environment
from pipelines.registry import ModelNotFoundError
from pipelines.requests import RequestError

USER_ERRORS = (ModelNotFoundError, RequestError, OutputError, BatchError, ServeError, LaunchError, BuildError,
               OptionsError)

__all__ = ["USER_ERRORS", "build_parser", "exit_with", "main", "parse_size"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ulysses-studio", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="one image or video from a prompt")
    add_model_arguments(generate)
    add_request_arguments(generate)
    generate.add_argument("--out", required=True, help="output file: .png for image models, .mp4 for video models")
    generate.add_argument("--quiet", action="store_true", help="no progress bar")
    add_parallel_arguments(generate)
    generate.set_defaults(func=run_generate, check=check_generate)

    serve = commands.add_parser("serve", help="the web UI (Gradio) on rank 0, every rank generating",
                                description=serve_module.__doc__.split("\n\n")[1].replace("\n", " "))
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve, check=check_serve)

    batch = commands.add_parser("batch", help="every prompt of a .txt, .jsonl or .csv file, resumable")
    add_batch_arguments(batch)
    batch.set_defaults(func=run_batch, check=check_batch)

    build = commands.add_parser("build", help="compile transformer engines ahead of time into the engine cache")
    add_build_arguments(build)
    build.set_defaults(func=run_build, check=None)

    # Every argument, --help included, is the benchmark's own (benchmarks.cli parses them): with no "-"
    # among its prefix characters this parser takes none of them as its options.
    bench = commands.add_parser("bench", help="benchmark transformer engines (1 GPU, ours, diffusers-native, peers) or "
                                              "whole generations (--end-to-end) under torchrun "
                                              "(`python -m benchmarks`; `bench --help` says more)",
                                add_help=False, prefix_chars="+")
    bench.add_argument("benchmark_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=run_bench, check=None)

    launch = commands.add_parser(
        "launch", help="run serve, batch or generate on several ranks with torchrun",
        description="Start `torchrun --nproc-per-node N -m app COMMAND ...` on a free port. "
                    "Example: ulysses-studio launch --nproc 2 serve",
    )
    add_launch_arguments(launch)
    launch.set_defaults(func=lambda args: run_launch(args, build_parser()), check=None)
    return parser


def run_bench(args: argparse.Namespace) -> int:
    """`python -m benchmarks` with the command's arguments, in a process of its own; its exit status."""
    return subprocess.call([sys.executable, "-m", "benchmarks", *args.benchmark_args])


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status (see the module docstring, and app.commands.launch for ranks)."""
    return hand_over_exit_status(_run(argv))


def exit_with(status: int) -> None:
    """End the process (the console script and `python -m app`) with `status`, at once, its output flushed.

    By then the command has torn down what it started, within bounds (engines.parallel.distributed.shutdown: graphs,
    process groups, compile workers; the server's files and folders), and written its results. What the
    interpreter's own exit would add is waiting: one last garbage collection over every object torch,
    transformers and diffusers made (0.9 s of a 5 s `generate` on a 2-core CPU, measured), the atexit handlers of
    torch's compile-worker pools (up to 300 s with torch 2.11 after a cold start), and the destructors of NCCL
    communicators whose teardown did not finish. So it ends with os._exit, as app.commands.torchrun ends torchrun.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say there
            pass
    os._exit(status)


def console_main() -> None:
    """The `ulysses-studio` console script."""
    exit_with(main())


def _run(argv: list[str] | None) -> int:
    # Never reach for the hub by surprise: every model is a local folder. A user who wants downloads
    # can still set HF_HUB_OFFLINE=0 explicitly.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    bytecode_outside_sources()  # before torch's import: its bytecode kept where the sources' folders may not hold it
    args = build_parser().parse_args(argv)
    if hasattr(args, "engine_cache"):  # a command that runs models here (launch and bench start processes that do)
        set_environment(run_environment(engine_cache_dir(args.engine_cache)))
    try:
        if hasattr(args, "rank_timeout"):  # a command that runs models: its run options go together
            run_options(args)
        return args.func(args)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (StartupError, JobFailed) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except RankLost as error:
        end_process(str(error))  # os._exit: a normal exit could hang on the dead peer's collective
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
