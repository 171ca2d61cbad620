"""Command line: `ulysses-studio generate|...` (also `python -m app`).

User mistakes (unknown model, missing weights, bad sizes, unwritable output) end with one line on
stderr and exit status 2, before any model is loaded. Bugs keep their tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from app.outputs import OutputError, check_output_path
from pipelines.registry import MODELS, MODELS_ENV, ModelNotFoundError, resolve_model
from pipelines.requests import RequestError, make_request, read_limits

USER_ERRORS = (ModelNotFoundError, RequestError, OutputError)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"registered model name: {', '.join(MODELS)} (default tiny-flux)")
    parser.add_argument("--model-path", default=None, metavar="DIR",
                        help=f"a diffusers-format folder to load instead of the registry's (weights are looked "
                             f"up under ${MODELS_ENV} or ~/models otherwise)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--input", dest="condition", default=None, metavar="FILE",
                        help="image or video whose frames start the video (video-to-world)")


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """'768x512' -> (width 768, height 512); None -> (None, None)."""
    if size is None:
        return None, None
    try:
        width, height = (int(part) for part in size.lower().split("x"))
    except ValueError:
        raise RequestError(f"--size must look like 768x512 (width x height), got {size!r}") from None
    return width, height


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ulysses-studio", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="one image or video from a prompt")
    add_model_arguments(generate)
    add_request_arguments(generate)
    generate.add_argument("--out", required=True, help="output file: .png for image models, .mp4 for video models")
    generate.add_argument("--quiet", action="store_true", help="no progress bar")
    generate.set_defaults(func=run_generate)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    spec, folder = resolve_model(args.model, args.model_path)
    width, height = parse_size(args.size)
    request = make_request(
        spec, read_limits(spec, folder),
        prompt=args.prompt, negative_prompt=args.negative_prompt, seed=args.seed, steps=args.steps,
        guidance=args.guidance,
        height=args.height if args.height is not None else height,
        width=args.width if args.width is not None else width,
        frames=args.frames, fps=args.fps, condition=args.condition,
    )
    out = check_output_path(args.out, spec)

    # Heavy imports only once the request is known to be good.
    import torch
    import transformers
    from tqdm import tqdm

    # transformers warns at import that its image processors lack torchvision (we use none of them),
    # and draws a progress bar per loaded component: noise next to our own progress bar.
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    from app.outputs import write_result
    from pipelines.factory import default_dtype, load_pipeline

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    pipeline = load_pipeline(spec, folder, device=device, dtype=default_dtype(device))
    with tqdm(total=request.steps, desc="denoising", unit="step", disable=args.quiet, file=sys.stderr) as bar:
        result = pipeline.generate(request, on_step=lambda done, total: bar.update(done - bar.n))
    write_result(result, out, request, spec)
    if not args.quiet:
        print(f"wrote {out} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    # Never reach for the hub by surprise: every model is a local folder. A user who wants downloads
    # can still set HF_HUB_OFFLINE=0 explicitly.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
