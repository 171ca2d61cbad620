"""Benchmark: seconds of whole generations through our pipelines, encode -> denoise -> decode.

    torchrun --nproc-per-node 2 -m benchmarks.generation --model flux-dev \\
        --backends eager,inductor-blocks+cudagraph --out e2e.json
    python -m benchmarks.generation --model cosmos-predict2-2b-video2world --runs 1 --out cosmos-1gpu.json
    torchrun --nproc-per-node 2 -m benchmarks.generation --model cosmos-predict2-2b-video2world --no-single \\
        --cfg --runs 1 --baseline cosmos-1gpu.json --out cosmos-2gpu.json
    torchrun --nproc-per-node 2 -m benchmarks.generation --tiny --out tiny.json        # CPU, gloo

What runs is what `generate`, `serve` and `batch` run: FluxImagePipeline / CosmosPipeline
(pipelines/), the transformer parallelized and turned into an engine by app.ranks.runtime's
parallelize_pipelines and build_engines, and every request through the LockstepService (rank 0
encodes and decodes, every rank denoises, the ranks agree after every step). Only the weights
differ: each component is the checkpoint's published architecture (its record in
pipelines.families; FLUX.1-dev: CLIP-L, T5-v1.1-XXL, the FLUX transformer and VAE; Cosmos-Predict2:
the T5-11B encoder, the Cosmos transformer and the Wan 2.1 VAE), with random weights created on the
device in its dtype (a 4.7B T5 in seconds). Tokenizers and schedulers are the family's embedded
tiny model's (assets/): their token ids are valid in the large vocabularies and the sequence
lengths (CLIP 77, T5 512) are the real ones.

Modes: "1 GPU" (rank 0 alone, as `generate` on one GPU; the other ranks wait), then "ours <plan>"
on all ranks for each --strategies plan (and cfg-2 with --cfg), each with every --backends engine;
the parallel modes split the VAE decode over the ranks as serve does (--split-vae: video models by default).
Per mode: one warm-up generation of --warmup-steps steps (with quantized attention at least one quantized step;
it compiles and captures the engine and runs every stage once), then --runs timed generations. Reported: medians
of total seconds (rank 0's wall time of one request), seconds in encode / denoise / decode (device-
synchronised), each step's seconds (step_s, agreement point included, median over the runs), ms per step
(denoise / steps), the seconds of writing the result file as the app does (write_s, PNG or MP4, after the
request and not in its total), peak GiB per rank over the timed runs, and the speedup of total and of denoise
against the 1 GPU mode of the same backend (this run's, else --baseline's). --tiny: the embedded tiny
models' configs, random float32 weights, CPU gloo ranks. The prompt cache is off: every request
encodes its prompt.

Entry point: sets the run environment (engines.options.run_environment) as the app does.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import torch
import transformers
from torch import nn

from app.failures import JobFailed, describe
from app.outputs import OutputError, check_writer
from app.ranks.lockstep import LockstepService
from app.ranks.runtime import build_engines, cpu_threads_per_rank, install_step_caches, parallelize_pipelines
from benchmarks.inputs import BenchModel, benchmarkable, build_random
from benchmarks.step import agreed_error, comma_list, engine_labels, gather_objects, mode_label, our_plans, sync
from engines.levers.compile import Engine
from engines.options import (
    FULL_PRECISION_EDGE_STEPS,
    SPLIT_VAE,
    STRATEGIES,
    TRANSPORTS,
    CacheOptions,
    RunOptions,
    default_backend,
    engine_cache_dir,
    run_environment,
    set_environment,
    splits_vae,
)
from engines.parallel.distributed import ParallelContext, init_parallel, shutdown
from engines.parallel.plan import ParallelPlan
from engines.parallel.wrapper import ParallelTransformer
from pipelines.factory import default_dtype
from pipelines.family import load
from pipelines.loading import component_class, load_component
from pipelines.registry import INDEX_FILES, ModelSpec, default_folder, family_of, get_spec, read_model_index
from pipelines.requests import GenerationRequest, MediaLimits, make_request, read_limits

PROMPT = "a lighthouse on a cliff at dusk, waves breaking below, warm light in the window"


@dataclass(kw_only=True, frozen=True)
class Components:
    """Every component of one checkpoint as configs: enough to build it with random weights."""

    spec: ModelSpec
    """The registered checkpoint: request defaults and checks."""
    transformer: BenchModel
    vae_class: type[nn.Module]
    vae: dict[str, Any]
    """Keyword arguments of vae_class (its defaults fill the rest)."""
    text_encoders: dict[str, tuple[type[nn.Module], Any]]
    """Component name -> (transformers model class, its config)."""
    assets: Path
    """The family's embedded model, whose tokenizers and scheduler config are used."""

    @property
    def vae_config(self) -> dict[str, Any]:
        """The VAE's complete config (what a checkpoint's vae/config.json holds)."""
        params = inspect.signature(self.vae_class.__init__).parameters
        defaults = {k: p.default for k, p in params.items() if k != "self" and p.default is not inspect.Parameter.empty}
        return {**defaults, **self.vae}


def _embedded_folder(spec: ModelSpec) -> Path:
    """The folder of the embedded model of `spec`'s family; a family that ships none (Cosmos 3, FLUX.2) has
    its tiny random checkpoint of `spec`'s pipeline class (its record's bench.tiny_checkpoint) written to a
    temporary folder for its tokenizer and scheduler."""
    family = family_of(spec)
    embedded = next((s for s in family.models if s.embedded), None)
    if embedded is not None:
        return default_folder(embedded)
    if not family.bench.tiny_checkpoint:
        raise ValueError(f"family '{spec.family}' has no embedded or tiny model to take a tokenizer from")
    folder = Path(tempfile.mkdtemp(prefix="ulysses-bench-")) / f"tiny-{spec.family}"
    load(family.bench.tiny_checkpoint)(spec, folder)
    return folder


def real_components(name: str) -> Components:
    """The published architecture of checkpoint `name` (pipelines.families)."""
    spec = get_spec(name)
    arch = spec.architecture
    if arch is None:
        raise ValueError(f"no published architecture is recorded for '{name}'")
    encoders = {}
    for component, (reference, config) in arch.text_encoders.items():
        cls = load(reference)
        encoders[component] = (cls, cls.config_class(**config))
    transformer = BenchModel(name=name, family=family_of(spec), config=dict(arch.transformer))
    return Components(spec=spec, transformer=transformer, vae_class=load(arch.vae_class), vae=arch.vae,
                      text_encoders=encoders, assets=_embedded_folder(spec))


def tiny_components(name: str) -> Components:
    """The embedded tiny model of `name`'s family, every config read from its folder in assets/."""
    folder = _embedded_folder(get_spec(name))
    spec = next((s for s in family_of(get_spec(name)).models if s.embedded), get_spec(name))
    index = read_model_index(folder)
    transformer = json.loads((folder / "transformer" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    encoders = {}
    for component in ENCODER_COMPANIONS:
        if component in index and index[component][0] is not None:
            cls = component_class(index, component)
            encoders[component] = (cls, cls.config_class.from_pretrained(folder / component))
    return Components(
        spec=spec,
        transformer=BenchModel(name=spec.name, family=family_of(spec),
                               config={k: v for k, v in transformer.items() if not k.startswith("_")}),
        vae_class=component_class(index, "vae"), vae={k: v for k, v in vae.items() if not k.startswith("_")},
        text_encoders=encoders, assets=folder,
    )


def write_config_folder(arch: Components, folder: Path) -> Path:
    """A checkpoint folder without weights: the configs the pipelines and request checks read (the model index as
    the tokenizers' folder has it: Wan's expand_timesteps, boundary_ratio and experts are read from it)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in INDEX_FILES:
        if (arch.assets / name).is_file():
            shutil.copy(arch.assets / name, folder / name)
    for name, config in (("vae", {"_class_name": arch.vae_class.__name__, **arch.vae_config}),
                         ("transformer", {"_class_name": arch.transformer.model_class.__name__,
                                          **arch.transformer.config})):
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def construct(make: Callable[..., nn.Module], *args: Any, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`make(*args)` with its weights created on `device` in `dtype` (the module's own random init)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            module = make(*args)
    finally:
        torch.set_default_dtype(previous)
    return module.eval().requires_grad_(False)


ENCODER_COMPANIONS = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "image_encoder": "image_processor"}
"""An encoder -> the component that prepares its input, taken from the family's tiny folder (tokenizers' token ids
are valid in the large vocabularies; an image processor is sized for the encoder here)."""


def build_pipeline(arch: Components, folder: Path, *, device: torch.device, with_encoders: bool,
                   with_vae: bool | None = None) -> Any:
    """The checkpoint's pipeline (its family's class) with random weights; ranks > 0 build no encoders, and
    no VAE unless `with_vae` (None: as with_encoders)."""
    spec = arch.spec
    pipeline_class = load(family_of(spec).pipeline)
    dtype = default_dtype(device)
    torch.manual_seed(0)
    parts: dict[str, Any] = {"transformer": build_random(arch.transformer, device=device, dtype=dtype)}
    if "scheduler" in read_model_index(arch.assets):  # a FLUX.3 folder has none: its pipeline makes diffusers' own
        parts["scheduler"] = load_component(arch.assets, "scheduler")
    if spec.experts > 1:  # Wan 2.2 A14B: a second expert of the same architecture
        parts["transformer_2"] = build_random(arch.transformer, device=device, dtype=dtype)
    if with_encoders:
        for name, (encoder_class, config) in arch.text_encoders.items():
            parts[name] = construct(encoder_class, config, device=device,
                                    dtype=pipeline_class.COMPONENT_DTYPES.get(name, dtype))
            companion = ENCODER_COMPANIONS[name]
            parts[companion] = load_component(arch.assets, companion)
            if companion == "image_processor":  # the tiny folder's sizes pictures for its tiny encoder: this one's
                side = config.image_size
                parts[companion].size = {"shortest_edge": side}
                parts[companion].crop_size = {"height": side, "width": side}
        if "text_tokenizer" in read_model_index(arch.assets):  # Cosmos 3: the transformer embeds token ids itself
            parts["text_tokenizer"] = load_component(arch.assets, "text_tokenizer")
    if with_encoders if with_vae is None else with_vae:
        parts["vae"] = build_vae(arch, device=device)
    return pipeline_class(spec=spec, folder=folder, device=device, **parts)


def build_vae(arch: Components, *, device: torch.device) -> nn.Module:
    """The checkpoint's VAE with random weights, in its pipeline's dtype for it (as checkpoints load)."""
    pipeline_class = load(family_of(arch.spec).pipeline)
    vae_dtype = pipeline_class.COMPONENT_DTYPES.get("vae", default_dtype(device))
    torch.manual_seed(0)
    return construct(arch.vae_class.from_config, arch.vae_config, device=device, dtype=vae_dtype)


class StageTimer:
    """A pipeline whose encode, denoise and decode are timed (device-synchronised); the last times in `seconds`."""

    def __init__(self, pipeline: Any, device: torch.device) -> None:
        self.pipeline = pipeline
        self.device = device
        self.seconds: dict[str, float] = {}

    def encode(self, request: GenerationRequest) -> Any:
        return self._timed("encode", self.pipeline.encode, request)

    def denoise(self, request: GenerationRequest, encoded: Any,
                on_step: Callable[[int, int], None] | None = None) -> torch.Tensor:
        return self._timed("denoise", self.pipeline.denoise, request, encoded, on_step)

    def decode(self, request: GenerationRequest, latents: torch.Tensor) -> Any:
        return self._timed("decode", self.pipeline.decode, request, latents)

    def encode_is_split(self, request: GenerationRequest) -> bool:
        return self.pipeline.encode_is_split(request)

    def prepare(self, request: GenerationRequest, encoded: Any) -> Any:
        """The pipeline's prepare (every rank: the part of the encoding split over them), counted in encode."""
        before = self.seconds.get("encode", 0.0)
        out = self._timed("encode", self.pipeline.prepare, request, encoded)
        self.seconds["encode"] += before
        return out

    def decode_is_split(self, request: GenerationRequest) -> bool:
        return self.pipeline.decode_is_split(request)

    def computed_steps(self) -> int | None:
        return self.pipeline.computed_steps()

    def _timed(self, stage: str, fn: Callable[..., Any], *args: Any) -> Any:
        sync(self.device)
        start = time.perf_counter()
        out = fn(*args)
        sync(self.device)
        self.seconds[stage] = time.perf_counter() - start
        return out


def run_requests(ctx: ParallelContext, timer: StageTimer, requests: list[GenerationRequest],
                 rank_timeout: float) -> list[tuple[float, dict[str, Any], Any]]:
    """Run `requests` on every rank of `ctx` through one LockstepService, as serve and batch do, and write each
    result file as they do (into a temporary folder, timed apart from the request).

    Rank 0 gets (wall seconds, stage seconds, result) per request, the stages being encode / denoise / decode
    (StageTimer), steps (each step's, the service's) and write; the other ranks follow and get [].
    A phase with no requests only starts and releases the followers.
    """
    from app.outputs import EXTENSIONS, write_result

    service = LockstepService(ctx, {"bench": timer}, stop=threading.Event(), rank_timeout=rank_timeout)
    if not ctx.is_main:
        service.follow()
        return []
    done = []
    spec = timer.pipeline.spec
    try:
        with tempfile.TemporaryDirectory() as folder:
            for request in requests:
                start = time.perf_counter()
                generation = service.run("bench", request)
                wall = time.perf_counter() - start
                write_start = time.perf_counter()
                write_result(generation.result, Path(folder) / f"result{EXTENSIONS[spec.media]}", request, spec)
                stages: dict[str, Any] = dict(timer.seconds, write=time.perf_counter() - write_start,
                                              steps=list(generation.stages.steps), computed=generation.computed_steps)
                done.append((wall, stages, generation.result))
    finally:
        service.stop()
    return done


def single_context(ctx: ParallelContext) -> ParallelContext:
    """This rank alone, as a one-process run sees itself."""
    return ParallelContext(rank=0, world_size=1, local_rank=ctx.local_rank, device=ctx.device, group=None,
                           control_group=None)


def restore_transformers(pipeline: Any, models: dict[str, nn.Module]) -> None:
    """Undo install_step_caches, build_engines and parallelize_pipelines: the pipeline calls the plain `models`
    (each transformer's, by attribute name) again."""
    pipeline.remove_step_caches()  # its wrappers hold the compiled blocks: out first
    for name, current in pipeline.transformers():
        if isinstance(current, Engine):  # compiled blocks back to plain ones
            current = current.release()
        if isinstance(current, ParallelTransformer):  # attention processors back
            current.restore()
        pipeline.use_transformer(models[name], name)


def measure_mode(model_name: str, mode: str, plan: ParallelPlan | None, backend: str, *, ctx: ParallelContext,
                 timer: StageTimer, models: dict[str, nn.Module], request: GenerationRequest,
                 args: argparse.Namespace) -> dict[str, Any]:
    """One mode x backend: warm-up generation, timed generations; the row (complete on rank 0).

    plan None is the 1 GPU mode: rank 0 alone, the other ranks wait at the final gather.
    """
    gpus = 1 if plan is None else ctx.world_size
    runs, warmup_s, peak, error, media = [], None, 0.0, None, None
    if plan is not None or ctx.is_main:
        mode_ctx = single_context(ctx) if plan is None else ctx
        pipeline = timer.pipeline
        try:
            options = RunOptions(strategy=plan.strategy if plan else "ulysses",
                                 cfg_parallel=bool(plan and plan.cfg > 1), all_to_all=args.all_to_all,
                                 backend=backend, engine_cache=args.engine_cache, rank_timeout=args.rank_timeout,
                                 cache=args.cache)
            if plan is not None:
                parallelize_pipelines([pipeline], ctx, options)
            pipeline.use_split_vae(ctx.group if plan is not None and splits_vae(args.split_vae, pipeline.spec.media)
                                   else None)
            build_engines([pipeline], mode_ctx, options)
            if options.cache is not None:
                install_step_caches([pipeline], mode_ctx, options)
        except Exception as exc:  # agreed below, reported in the row
            error = describe(exc)
        error = agreed_error(mode_ctx, error)
        if error is None:
            try:
                runs, warmup_s, peak = _time_generations(mode_ctx, timer, request, args)
            except JobFailed as exc:
                error = str(exc)
        restore_transformers(pipeline, models)
        torch._dynamo.reset()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        if runs and args.media_dir is not None:
            media = str(save_media(runs[-1][2], args.media_dir, f"{model_name}_{mode}_{backend}"))
    results = gather_objects(ctx, (peak, error))[:gpus]
    errors = [r[1] for r in results if r[1]]
    row: dict[str, Any] = dict(
        model=model_name, mode=mode, backend=backend, gpus=gpus, shape=shape_label(request),
        steps=request.steps, guidance=request.guidance, runs=len(runs), warmup_s=warmup_s,
        split_vae=plan is not None and splits_vae(args.split_vae, timer.pipeline.spec.media),
        peak_gib=[r[0] for r in results], error=errors[0] if errors else None, media=media,
    )
    for key in ("total", "encode", "denoise", "decode", "write"):
        values = [run[0] if key == "total" else run[1][key] for run in runs]
        row[f"{key}_s"] = statistics.median(values) if values else None
    row["step_s"] = [statistics.median(step) for step in zip(*(run[1]["steps"] for run in runs))] if runs else None
    row["step_ms"] = row["denoise_s"] / request.steps * 1e3 if runs else None
    row["step_cache"] = args.cache
    row["attention_precision"] = timer.pipeline.attention_precision
    row["computed_steps"] = [run[1]["computed"] for run in runs] if args.cache else None
    return row


def _time_generations(ctx: ParallelContext, timer: StageTimer, request: GenerationRequest,
                      args: argparse.Namespace) -> tuple[list, float | None, float]:
    """Warm-up generation, then the timed ones; (rank 0's runs, warm-up seconds, this rank's peak GiB)."""
    warmup, failure = [], None
    # with quantized attention the warm-up reaches a quantized step (the edge steps run at full precision, another
    # engine input), so that its engine is built and captured there and not in a timed run
    steps = args.warmup_steps
    if timer.pipeline.attention_precision != "full":
        steps = max(steps, 2 * FULL_PRECISION_EDGE_STEPS + 1)
    try:
        warmup = run_requests(ctx, timer, [replace(request, steps=steps)], args.rank_timeout)
    except JobFailed as exc:  # rank 0 only; the followers are released by the empty phase below
        failure = exc
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    runs = run_requests(ctx, timer, [] if failure else [request] * args.runs, args.rank_timeout)
    if failure is not None:
        raise failure
    peak = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.device.type == "cuda" else 0.0
    return runs, (warmup[0][0] if warmup else None), peak


def save_media(result: Any, folder: Path, name: str) -> Path:
    """The image or frames as a uint8 array file, for comparing modes."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (name.replace(" ", "-") + ".npy")
    np.save(path, np.asarray(result))
    return path


def shape_label(request: GenerationRequest) -> str:
    """HxW for images, FxHxW for videos."""
    size = f"{request.height}x{request.width}"
    return size if request.frames == 1 else f"{request.frames}x{size}"


def finish(rows: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add the speedups of total and denoise seconds against the 1 GPU row of the same model, shape and backend."""
    base = {(r["model"], r["shape"], r["backend"]): r for r in baseline + rows
            if r["mode"] == "1 GPU" and r["total_s"]}
    for r in rows:
        b = base.get((r["model"], r["shape"], r["backend"]))
        done = b is not None and r["total_s"]
        r["speedup"] = b["total_s"] / r["total_s"] if done else None
        r["denoise_speedup"] = b["denoise_s"] / r["denoise_s"] if done else None
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Compact text table of the rows."""
    head = (f"{'model':<30} {'mode':<16} {'backend':<26} {'total s':>8} {'encode':>7} {'denoise':>8} {'decode':>7} "
            f"{'write':>6} {'ms/step':>8} {'speedup':>8} {'peak GiB/rank':>14}")
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{r[k]:.2f}" if r[k] is not None else "-"
                 for k in ("total_s", "encode_s", "denoise_s", "decode_s", "write_s")]
        step = f"{r['step_ms']:.1f}" if r["step_ms"] else "-"
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        peak = "/".join(f"{p:.1f}" for p in r["peak_gib"])
        lines.append(f"{r['model']:<30} {r['mode']:<16} {r['backend']:<26} {cells[0]:>8} {cells[1]:>7} {cells[2]:>8} "
                     f"{cells[3]:>7} {cells[4]:>6} {step:>8} {speed:>8} {peak:>14}"
                     + (f"  ERROR {r['error']}" if r["error"] else ""))
    return "\n".join(lines)


def input_picture(limits: MediaLimits, args: argparse.Namespace, folder: Path) -> str | None:
    """For a checkpoint that needs an input picture (image-to-video's first frame, an edit's reference): a seeded
    noise picture of the asked size, written into `folder` (its path); else None. Its content changes no stage's
    cost."""
    if not limits.input_required:
        return None
    import PIL.Image

    size = (args.height or 720, args.width or 1280, 3)
    path = folder / "input.png"
    PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)).save(path)
    return str(path)


def run_model(name: str, args: argparse.Namespace, ctx: ParallelContext, rows: list[dict[str, Any]],
              meta: dict[str, Any], save: Callable[[list[dict[str, Any]]], None]) -> None:
    """Every mode x backend of one model; rows are appended (complete on rank 0) and saved after each."""
    arch = tiny_components(name) if args.tiny else real_components(name)
    spec = arch.spec
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config_folder(arch, Path(tmp))
        limits = read_limits(spec, folder)
        request = make_request(spec, limits, prompt=args.prompt, seed=0, steps=args.steps, height=args.height,
                               width=args.width, frames=args.frames, condition=input_picture(limits, args, Path(tmp)))
        start = time.perf_counter()
        pipeline = build_pipeline(arch, folder, device=ctx.device, with_encoders=ctx.is_main,
                                  with_vae=ctx.is_main or splits_vae(args.split_vae, spec.media))
        sync(ctx.device)
        if ctx.is_main:
            meta.setdefault("models", {})[spec.name] = dict(
                request=request.to_dict(), build_s=time.perf_counter() - start,
                parameters={k: sum(p.numel() for p in v.parameters()) for k, v in vars(pipeline).items()
                            if isinstance(v, nn.Module)},
            )
        models = dict(pipeline.transformers())
        timer = StageTimer(pipeline, ctx.device)
        modes: list[tuple[str, ParallelPlan | None]] = [] if args.no_single else [("1 GPU", None)]
        heads = pipeline.transformer_config.num_attention_heads
        plans = our_plans(ctx, heads, args.strategies, args.cfg)
        modes += [(mode_label(plan, args.all_to_all), plan) for plan in plans]
        # (linears, attention): bf16, then with --fp8 the linears FP8, then with --attention-precision the last of
        # those with quantized attention (as the app's steps run it: full precision on the first and last)
        precisions = [("bf16", "full")] + ([("fp8", "full")] if args.fp8 else [])
        if args.attention_precision:
            precisions.append((precisions[-1][0], args.attention_precision))
        for linears, attention in precisions:
            if linears == "fp8" and attention == "full":  # the same weights, the blocks' linears made FP8 in place
                from engines.levers.fp8 import quantize_fp8  # (engines/levers/fp8.py)

                for model in models.values():
                    quantize_fp8(model, family_of(spec).compiled_blocks)
            timer.pipeline.attention_precision = attention
            for mode, plan in modes:
                for backend in args.backends:
                    label = mode + (" fp8" if linears == "fp8" else "") + (
                        f" attention {attention}" if attention != "full" else "")
                    rows.append(measure_mode(spec.name, label, plan, backend, ctx=ctx, timer=timer, models=models,
                                             request=request, args=args))
                    if ctx.is_main:
                        r = rows[-1]
                        print(f"[bench_e2e] {r['model']} {label} [{backend}] {r['shape']} x{r['steps']} steps: "
                              + (f"{r['total_s']:.2f} s" if r["total_s"] else "-")
                              + (f" ERROR {r['error']}" if r["error"] else ""), file=sys.stderr, flush=True)
                        save(rows)
        del pipeline, models, timer
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux-dev",
                   help=f"comma-separated registered checkpoints: {', '.join(benchmarkable())} (default flux-dev)")
    p.add_argument("--steps", type=int, default=None,
                   help="denoising steps (default: the model's, 28 FLUX / 35 Cosmos)")
    p.add_argument("--height", type=int, default=None, help="default: the model's (1024 FLUX, 704 Cosmos)")
    p.add_argument("--width", type=int, default=None, help="default: the model's (1024 FLUX, 1280 Cosmos)")
    p.add_argument("--frames", type=int, default=None, help="video frames (default: the model's, 93 Cosmos)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--backends", default=None,
                   help="comma-separated engine labels (engines.options.EngineOptions), e.g. "
                        "eager,inductor-blocks+cudagraph (default: what serve uses: inductor-blocks+cudagraph on "
                        "GPUs, eager on CPUs)")
    p.add_argument("--strategies", default="ulysses",
                   help=f"comma-separated parallel modes on all ranks, of {', '.join(STRATEGIES)} (default ulysses; "
                        "'' for none)")
    p.add_argument("--all-to-all", default="nccl", choices=TRANSPORTS,
                   help="transport of the parallel modes' Ulysses all-to-alls and K/V exchanges (default nccl)")
    p.add_argument("--cfg", action="store_true", help="also the cfg-2 plan: each half of the ranks runs one "
                                                      "guidance branch (Cosmos)")
    p.add_argument("--split-vae", default="auto", choices=SPLIT_VAE,
                   help="whether the parallel modes split the VAE decode over the ranks (pipelines/split_vae.py), "
                        "as serve's option: auto (default) splits video models' only")
    p.add_argument("--no-single", action="store_true", help="skip the 1 GPU mode (see --baseline)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="an earlier JSON of this benchmark whose 1 GPU rows give the speedups")
    p.add_argument("--runs", type=int, default=3, help="timed generations per mode (median; default 3)")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="steps of the warm-up generation before the timed ones (default 2)")
    p.add_argument("--engine-cache", type=Path, default=None,
                   help="compiled-engine cache (default: serve's, $ULYSSES_STUDIO_ENGINE_CACHE or "
                        "~/.cache/ulysses-studio/engines)")
    p.add_argument("--rank-timeout", type=float, default=600.0,
                   help="seconds a rank waits for the others at an agreement point (default 600)")
    p.add_argument("--fp8", action="store_true",
                   help="after the bf16 rows, every mode again with the blocks' linears as FP8 (engines/levers/fp8.py)")
    p.add_argument("--attention-precision", default=None, choices=("int8", "fp8"),
                   help="after the other rows, every mode again with quantized attention at this precision, full on "
                        "the first and last steps as the app runs it (engines/levers/quantized_attention.py)")
    p.add_argument("--cache", default=None, metavar="CACHE",
                   help="a step cache on every mode, as serve's --cache (e.g. fbcache, fbcache:0.12; "
                        "engines/levers/step_cache.py); rows record the steps computed per run. Random weights make "
                        "the "
                        "hit rate meaningless: read the time of a skipped step from benchmarks.step --cached-step")
    p.add_argument("--tiny", action="store_true", help="embedded tiny models' configs, float32, CPU gloo ranks")
    p.add_argument("--media-dir", type=Path, default=None,
                   help="save each mode's last image or frames here as .npy (rank 0)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here (rank 0)")
    args = p.parse_args(argv)
    args.models = comma_list(p, args.model, "model", tuple(benchmarkable()))
    args.backends = engine_labels(p, args.backends or "")
    args.strategies = comma_list(p, args.strategies, "strategy", STRATEGIES)
    if args.runs < 1 or args.warmup_steps < 1:
        p.error("--runs and --warmup-steps must be >= 1")
    for name in args.models:  # each result is written as the app writes it: an MP4 writer or no run at all
        try:
            check_writer(get_spec(name))
        except OutputError as error:
            p.error(str(error))
    if args.cache is not None:
        try:
            CacheOptions.parse(args.cache)
        except ValueError as error:
            p.error(f"--cache {args.cache!r}: {error}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Benchmark entry point (see the module docstring)."""
    args = parse_args(argv)
    set_environment(run_environment(engine_cache_dir(args.engine_cache)))  # as the app's entry point does
    transformers.logging.set_verbosity_error()
    ctx = init_parallel("cpu" if args.tiny else None)
    try:
        if ctx.device.type == "cpu" and ctx.is_distributed:
            torch.set_num_threads(cpu_threads_per_rank(ctx.world_size))
        args.backends = args.backends or [default_backend(ctx.device.type)]
        launcher = f"torchrun --nproc-per-node {ctx.world_size}" if ctx.is_distributed else "python"
        cuda = ctx.device.type == "cuda"
        devices = gather_objects(ctx, torch.cuda.get_device_name(ctx.device) if cuda else platform.processor() or "cpu")
        meta: dict[str, Any] = dict(
            command=f"{launcher} -m benchmarks.generation {' '.join(sys.argv[1:] if argv is None else argv)}",
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            world_size=ctx.world_size, devices=devices, python=platform.python_version(), torch=torch.__version__,
            cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            diffusers=diffusers.__version__, transformers=transformers.__version__,
            dtype=str(default_dtype(ctx.device)).removeprefix("torch."), backends=args.backends, runs=args.runs,
            warmup_steps=args.warmup_steps,
            weights="random, tiny configs" if args.tiny else "random, real architectures",
        )
        baseline = json.loads(args.baseline.read_text())["rows"] if args.baseline else []

        def save(rows: list[dict[str, Any]]) -> None:
            if args.out:  # after every row, so a run cut short still leaves its numbers
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(dict(meta=meta, rows=finish(rows, baseline)), indent=2))

        rows: list[dict[str, Any]] = []
        for name in args.models:
            run_model(name, args, ctx, rows, meta, save)
        if ctx.is_main:
            print(table(finish(rows, baseline)), flush=True)
            save(rows)
    finally:
        shutdown(ctx)


if __name__ == "__main__":
    from app.commands.cli import exit_with

    main()
    # at once, as the app's commands end: the ranks' teardown is done and bounded (engines.parallel.distributed)
    exit_with(0)
