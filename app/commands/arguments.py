"""Command-line arguments that several commands share (model, request, parallel run)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path

from engines.options import (
    ATTENTION_PRECISIONS,
    CACHES,
    DEFAULT_RANK_TIMEOUT,
    DEFAULT_STRATEGY,
    DEFAULT_TRANSPORT,
    ENGINE_CACHE_ENV,
    SPLIT_VAE,
    STRATEGIES,
    TRANSPORTS,
    CacheOptions,
    EngineOptions,
    LoraError,
    LoraFile,
    RunOptions,
)
from pipelines.registry import MODELS, MODELS_ENV
from pipelines.requests import MediaLimits, RequestError


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"registered model name: {', '.join(MODELS)} (default tiny-flux)")
    parser.add_argument("--model-path", default=None, metavar="DIR",
                        help=f"a diffusers-format folder to load instead of the registry's (weights are looked "
                             f"up under ${MODELS_ENV} or ~/models otherwise)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")


def add_request_arguments(parser: argparse.ArgumentParser, *, prompt_required: bool = True) -> None:
    if prompt_required:
        parser.add_argument("--prompt", required=True, help="what to draw, in words")
    parser.add_argument("--negative-prompt", default=None, help="what to steer away from (Cosmos models)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed: the same seed and settings give the same result (default 0)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (model default if omitted)")
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale (model default if omitted)")
    parser.add_argument("--guidance-2", type=float, default=None,
                        help="two-expert models (Wan 2.2 A14B): the guidance scale of the second, low-noise expert's "
                             "steps (model default if omitted)")
    parser.add_argument("--height", type=int, default=None,
                        help="pixels (model default if omitted; a multiple of the model's size step)")
    parser.add_argument("--width", type=int, default=None,
                        help="pixels (model default if omitted; a multiple of the model's size step)")
    parser.add_argument("--size", default=None, metavar="WxH", help="shorthand for --width and --height")
    parser.add_argument("--frames", type=int, default=None, help="video frames (video models)")
    parser.add_argument("--fps", type=int, default=None, help="video frame rate (video models)")
    if prompt_required:
        parser.add_argument("--input", dest="condition", default=None, metavar="FILE",
                            help="image or video whose frames start the video (video-to-world), or the reference image "
                                 "of an image model that takes one (FLUX.2)")


def replicas_value(text: str) -> int | str:
    """--replicas: "auto" or a whole number of groups, at least 1."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--replicas takes a number of groups (1 or more) or auto, not {text!r}")
    return int(text)


def add_replicas_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=replicas_value, default=None, metavar="R|auto",
                        help="split the ranks into R equal groups of consecutive ranks, each with its own plan "
                             "(--strategy, --cfg-parallel, --tp inside it) and running its own requests side by side: "
                             "more images an hour for a team or a batch; 1 gives each request every rank, the lowest "
                             "latency. auto (the default on 2+ GPUs of one host; else 1, and one group per host on "
                             "several hosts): every rank as one group while requests come one at a time, smaller "
                             "groups while they wait, the split whose time estimates end the queue soonest")


def add_parallel_arguments(parser: argparse.ArgumentParser, *, backend_default: str | None = None) -> None:
    """The RunOptions arguments (read back with run_options); `backend_default` None: by device."""
    parser.add_argument("--strategy", default=DEFAULT_STRATEGY, choices=STRATEGIES,
                        help="how ranks split the transformer's token sequence when several run: ulysses "
                             "(all-to-all to head shards; default), ring (K/V passed around the ranks), allgather "
                             "(K/V gathered once, one attention over every key), ulysses-ring (both)")
    parser.add_argument("--all-to-all", default=DEFAULT_TRANSPORT, choices=TRANSPORTS,
                        help="how the Ulysses all-to-alls and K/V exchanges travel between GPUs: nccl (default), "
                             "or copy-engine (peer copies through symmetric memory, no SM kernels; all ranks on one "
                             "host; no watchdog; with --strategy allgather the fastest FLUX setting measured on "
                             "2x H200, docs/benchmarks.md)")
    parser.add_argument("--cfg-parallel", action="store_true",
                        help="video (Cosmos-style) models: run classifier-free guidance's two branches on two halves "
                             "of the ranks, each half splitting the sequence (needs an even number of ranks; "
                             "requests then need guidance above 1). Image (FLUX-style) models have one branch "
                             "and are unaffected")
    parser.add_argument("--tp", type=int, default=None, metavar="N",
                        help="tensor parallelism: N ranks split every transformer block's weights (and heads), for "
                             "models larger than one GPU; the other ranks' axes (--strategy, --cfg-parallel) split "
                             "the rest, so tp x ulysses x ring x cfg = ranks. Default: `launch` picks the smallest "
                             "N whose weights fit the GPUs' memory, 1 otherwise (docs/tensor-parallel.md)")
    default = backend_default or ("inductor-blocks+cudagraph on GPUs (+blockgraph with --cache: a graph per block), "
                                  "eager on CPUs")
    parser.add_argument("--backend", default=backend_default, type=backend_label,
                        help="engine of each rank's transformer: eager, inductor, inductor-blocks (per-block "
                             "compile), inductor...+overlap (keeps FLUX's all-to-all overlap through compilation), any "
                             f"of them +cudagraph (CUDA only), tensorrt (where installed); default {default}")
    parser.add_argument("--engine-cache", "--cache-dir", dest="engine_cache", type=Path, default=None, metavar="DIR",
                        help=f"compiled-engine cache (default ${ENGINE_CACHE_ENV} or ~/.cache/ulysses-studio/engines)")
    parser.add_argument("--fp8", action="store_true",
                        help="faster, approximate: the transformer blocks' linear layers as FP8 (e4m3) matrix "
                             "multiplies with dynamic scales, through torchao; embedders, modulation and the final "
                             "layer stay in bf16 (docs/faster.md)")
    parser.add_argument("--cache", default=None, type=cache_label, metavar="fbcache[:THRESHOLD]",
                        help="faster, approximate: a step whose first transformer block changed by less than "
                             f"THRESHOLD (default {CACHES['fbcache']:g}) since the last computed step reuses the "
                             "other blocks' result; all ranks decide together, the first and last steps always "
                             "run (docs/faster.md)")
    parser.add_argument("--attention-precision", default="full", choices=ATTENTION_PRECISIONS,
                        help="faster, approximate: the transformer's attention kernels quantized, int8 "
                             "(SageAttention's method: K smoothed by its mean, INT8 Q·Kᵀ, FP16 P·V) or fp8 (e4m3 Q, K, "
                             "V), each with "
                             "per-block scales, on every strategy; the first and last steps stay at full precision; a "
                             "request may ask for full precision (quantized_attention false); default full "
                             "(docs/faster.md)")
    parser.add_argument("--split-vae", default="auto", choices=SPLIT_VAE,
                        help="with several ranks, on: split the VAE decode over them (each decodes a band of rows, "
                             "rank 0 gathers them; the same image within one 8-bit level; every rank holds the VAE), "
                             "and so the encode of a Cosmos-Predict2 input; off: rank 0 alone holds the VAE and runs "
                             "it; auto (default): on for video models, off for image models, whose decode measured "
                             "no faster split")
    parser.add_argument("--lora", action="append", default=[], type=lora_label, metavar="NAME=PATH[:SCALE]",
                        help="load a LoRA adapter (repeatable): a .safetensors file in any format diffusers reads for "
                             "the model (diffusers/PEFT, kohya, BFL, XLabs; Wan 2.2 A14B: HIGH,LOW, a file per "
                             "expert), checked against the model before any rank "
                             "starts (serve: each served model gets the files that fit it; a file that fits none is "
                             "refused). Every LoRA stays loaded; each request chooses which ones and their scales. "
                             "generate and batch: a request that names none (no batch `lora` field) uses every --lora "
                             "at its SCALE (default 1), a batch line's `lora` field (e.g. \"style:0.8\", \"\" none) "
                             "chooses; serve: the default is none, the UI's LoRA choice or the API's `lora` field "
                             "chooses, a name without a scale taking its SCALE")
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
        guidance_2=args.guidance_2,
        height=args.height if args.height is not None else height,
        width=args.width if args.width is not None else width,
        frames=args.frames, fps=args.fps,
    )


class OptionsError(ValueError):
    """Run options that cannot go together (RunOptions' checks), said before anything is loaded."""


def run_options(args: argparse.Namespace) -> RunOptions:
    """The RunOptions of a command line built with add_model_arguments and add_parallel_arguments."""
    try:
        options = RunOptions(device=args.device, strategy=args.strategy, cfg_parallel=args.cfg_parallel,
                             all_to_all=args.all_to_all, backend=args.backend, engine_cache=args.engine_cache,
                             rank_timeout=args.rank_timeout, fp8=args.fp8, cache=args.cache, tp=args.tp or 1,
                             split_vae=args.split_vae, loras=lora_files(args),
                             attention_precision=args.attention_precision)
    except ValueError as error:
        raise OptionsError(str(error)) from None
    check_graphs_have_gpus(args.backend, args.device)
    return options


def check_graphs_have_gpus(backend: str | None, device: str | None) -> None:
    """OptionsError for a --backend with CUDA graphs (+cudagraph, +blockgraph) on a run whose ranks are CPUs (--device
    cpu, or no GPU here), before any rank starts: a rank would otherwise fail building its engine."""
    from engines.options import EngineOptions

    if not backend:
        return
    engine = EngineOptions.parse(backend)
    if not (engine.cuda_graph or engine.block_graphs):
        return
    if device is None:
        from app.commands.memory_plan import visible_gpus

        device = "cuda" if visible_gpus() else "cpu"
    if not str(device).startswith("cuda"):
        plain = backend.replace("+cudagraph", "").replace("+blockgraph", "")
        raise OptionsError(f"--backend {backend}: CUDA graphs need GPUs, and this run's ranks are CPUs; use "
                           f"--backend {plain} (or run it on GPUs)")


def lora_files(args: argparse.Namespace) -> tuple[LoraFile, ...]:
    """The --lora files of a command line built with add_parallel_arguments (names unique)."""
    files = tuple(LoraFile.parse(text) for text in getattr(args, "lora", None) or ())
    names = [file.name for file in files]
    if len(set(names)) != len(names):
        raise OptionsError(f"--lora names must differ: {', '.join(names)}")
    return files


def lora_limits(args: argparse.Namespace, spec, folder: Path, limits: MediaLimits) -> MediaLimits:
    """`limits` with the run's --lora names and scales, once every file is read and checked against `spec`'s
    transformer (its config alone, on the meta device: no weights are loaded). The commands' check step calls it,
    before any rank starts: a file that does not fit is refused naming its first bad key (OptionsError)."""
    from dataclasses import replace

    files = lora_files(args)
    if not files:
        return limits
    from engines.weights.lora import check_lora_files

    for file in _pairs_for_one_transformer(files, spec):
        raise OptionsError(f"--lora {file.name}: {TWO_FILES}; {spec.name} has one transformer")
    try:
        for index, transformer, config in _transformer_configs(spec, folder):
            check_lora_files([file.for_expert(index) for file in files], transformer, config)
    except LoraError as error:
        raise OptionsError(f"{error} (model {spec.name})") from None
    return replace(limits, loras=tuple((file.name, file.scale) for file in files))


def expert_components(spec) -> list[str]:
    """The folder components of `spec`'s transformers: "transformer", and "transformer_2" for a two-expert model."""
    return ["transformer", "transformer_2"][:spec.experts]


def _transformer_configs(spec, folder: Path) -> Iterator[tuple[int, type, dict]]:
    """(expert index, transformer class, its config from `folder`) of each of `spec`'s transformers, read as
    iterated."""
    from pipelines.family import load
    from pipelines.registry import family_of, read_component_config

    for index, component in enumerate(expert_components(spec)):
        yield index, load(family_of(spec).transformer), read_component_config(folder, component)


TWO_FILES = "two files are a two-expert model's (Wan 2.2 A14B: high noise, low noise)"


def _pairs_for_one_transformer(files, spec) -> list:
    """The LoRAs of `files` given as two files (one per expert) where `spec` has one transformer."""
    return [file for file in files if file.path_2 is not None and spec.experts == 1]


def _fitting_names(files, spec, folder: Path) -> tuple[set[str], dict[str, str]]:
    """The names of `files` that fit every transformer of `spec` (by `folder`'s configs), and why each other does
    not (LoraError for a file that cannot be read)."""
    from engines.weights.lora import fitting_lora_files

    refused = {file.name: TWO_FILES for file in _pairs_for_one_transformer(files, spec)}
    names = {file.name for file in files} - set(refused)
    for index, transformer, config in _transformer_configs(spec, folder):
        fits, why = fitting_lora_files([file.for_expert(index) for file in files], transformer, config)
        names &= {weights.name for weights in fits}
        for name, reason in why.items():
            refused.setdefault(name, reason)
    return names, refused


def served_lora_limits(args: argparse.Namespace, models: list, limits: list[MediaLimits]) -> list[MediaLimits]:
    """serve's lora_limits over several models: each model's `limits` with the --lora files that fit it (read and
    checked from its config, as lora_limits does); a file is refused (OptionsError, each model's reason) only when
    it fits none of them."""
    from dataclasses import replace

    files = lora_files(args)
    if not files:
        return list(limits)
    fitting, reasons = [], {}
    for (spec, folder), _ in zip(models, limits, strict=True):
        try:
            names, refused = _fitting_names(files, spec, folder)
        except LoraError as error:
            raise OptionsError(f"{error} (model {spec.name})") from None
        fitting.append(names)
        for name, why in refused.items():
            reasons.setdefault(name, []).append(f"{spec.name}: {why}")
    for file in files:
        if not any(file.name in names for names in fitting):
            raise OptionsError(f"--lora {file.name} fits none of the served models ({'; '.join(reasons[file.name])})")
    return [replace(model_limits, loras=tuple((file.name, file.scale) for file in files if file.name in names))
            for model_limits, names in zip(limits, fitting, strict=True)]


def _label_of(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type: the text when `parse` takes it, else a usage error saying what is wrong."""

    def label(text: str) -> str:
        try:
            parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text

    return label


backend_label = _label_of(EngineOptions.parse)
"""argparse type of --backend: a valid engine label."""
cache_label = _label_of(CacheOptions.parse)
"""argparse type of --cache: a valid step cache label."""
lora_label = _label_of(LoraFile.parse)
"""argparse type of --lora: NAME=PATH[:SCALE] (the file is checked with the model, lora_limits)."""
