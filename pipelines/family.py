"""What a model family and a named checkpoint are: the records pipelines.families fills in.

A family (FLUX-style, Cosmos-style, ...) is everything that makes one diffusers transformer class
run here: our pipeline for it, its parallelize function, its repeated blocks, how its requests are
limited, how its transformer is called at a given size (the work estimate and the benchmarks), its
tiny test configs, and its named checkpoints with their defaults. Every place that needs to know
about a model reads its family's record, so adding a family is one record plus its own modules (its
pipeline, its engines adapter); no code elsewhere asks which family it has (tests/test_structure.py).

Code is named as "module:attribute" and imported when first used (`load`): reading the records
(`--help`, the checks made before anything is loaded) imports no torch, and a family whose
pipeline module is heavy costs nothing until a model of it runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Literal


def load(reference: str) -> Any:
    """The object a "module:attribute" reference names (e.g. "pipelines.flux.parallel:parallelize_flux")."""
    module, _, attribute = reference.partition(":")
    if not module or not attribute:
        raise ValueError(f"{reference!r} is not a 'module:attribute' reference")
    from engines.import_noise import quiet_torchao_import

    # A family's code is diffusers' (its transformer class) or imports it, and diffusers imports torchao through
    # peft and transformers: the checks made before any rank starts (--lora files) get here first.
    quiet_torchao_import()
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True, kw_only=True, slots=True)
class Architecture:
    """A checkpoint's published component configs: enough to build it with random weights (benchmarks
    measure speed on random weights of the real architectures; no download)."""

    transformer: dict[str, Any]
    """Keyword arguments of the family's diffusers transformer class."""
    vae_class: str
    """Reference of the VAE class, e.g. "diffusers:AutoencoderKL"."""
    vae: dict[str, Any]
    """Keyword arguments of vae_class (its defaults fill the rest)."""
    text_encoders: dict[str, tuple[str, dict[str, Any]]]
    """Component name -> (reference of its transformers model class, keyword arguments of its config)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A named checkpoint: what it makes, where its weights are looked for, how it runs by default."""

    name: str
    """Registry name, e.g. 'flux-dev'."""
    family: str
    """Name of its ModelFamily."""
    media: Literal["image", "video"]
    """What one request produces."""
    checkpoint_class: str
    """The diffusers pipeline class its model_index.json names, e.g. "FluxPipeline"."""
    folder: str
    """Folder name under the models root (or under assets/ for embedded models)."""
    source: str
    """Where a user gets the weights (a hub id to copy locally, or 'embedded')."""
    height: int
    width: int
    steps: int
    guidance: float
    frames: int = 1
    fps: int = 16
    max_sequence_length: int = 512
    negative_prompt: str = ""
    embedded: bool = False
    """True for the tiny models shipped in assets/."""
    examples: tuple[str, ...] = ()
    """Prompts the UI offers as examples, in the wording the model knows (the tiny models' caption grammar)."""
    architecture: Architecture | None = None
    """Published configs of its components (for random-weight benchmarks), where known."""
    experts: int = 1
    """Transformers it denoises with, each whole and resident: Wan 2.2 A14B's two experts (model_index.json's
    transformer and transformer_2; the second takes the steps below boundary_ratio's timestep)."""
    guidance_2: float | None = None
    """A two-expert model's default guidance scale for its second (low-noise) expert's steps (WanPipeline's
    guidance_scale_2); None: one expert."""
    guidance_batch: bool | None = None
    """Its classifier-free guidance has two branches (--cfg-parallel applies); None: as its family's record
    says (FLUX.2's Klein base checkpoints use guidance where dev and the distilled Klein ones do not)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchShapes:
    """How the benchmark calls a family's transformer."""

    inputs: str
    """Reference of the function that builds the transformer's keyword arguments for one size
    (pipelines.transformer_inputs says what it takes and returns): the benchmarks call the transformer
    with them, and the work estimate (pipelines.work) counts a request's FLOPs on them."""
    sizes: tuple[str, ...]
    """Default sizes: "HxW" for images, "FxHxW" for videos (pixels)."""
    tiny_sizes: tuple[str, ...]
    """Sizes for the tiny, CPU smoke-test configs."""
    video: bool = False
    """Sizes carry a frame count."""
    batch: int = 1
    """Batch of one transformer call (2 for guidance-batched families: conditional + unconditional)."""
    peers: tuple[str, ...] = ()
    """Peer implementations (benchmarks.peers) that run this family's transformer."""
    tiny_config: str = ""
    """Families with no embedded model: reference of a tiny transformer config (a dict) for --tiny runs."""
    tiny_checkpoint: str = ""
    """Families with no embedded model: reference of a function (spec, folder) -> None that writes a tiny
    random checkpoint of spec's pipeline class into folder (training.tiny_models); the end-to-end
    benchmark takes its tokenizers and scheduler."""
    diffusers_parallel: bool = False
    """diffusers' own context parallelism (enable_parallelism) runs this family's transformer."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFamily:
    """One family of diffusion models: see the module docstring."""

    name: str
    """Registry name, e.g. "flux"."""
    title: str
    """What a person calls it, e.g. "FLUX-style"."""
    transformer: str
    """Reference of its diffusers transformer class, e.g. "diffusers:FluxTransformer2DModel"."""
    pipeline: str
    """Reference of our pipeline class (encode -> denoise -> decode), e.g.
    "pipelines.flux.pipeline:FluxImagePipeline"."""
    parallelize: str = "engines.parallel.generic:parallelize_generic"
    """Reference of its engines adapter, a function (model, mesh) -> ParallelTransformer: by default the generic
    path, driven by the transformer class's diffusers _cp_plan."""
    tensor_parallel: str = "engines.parallel.generic:generic_weights"
    """Reference of its tensor-parallel split, a function (model, tp) -> engines.parallel.tensor_parallel.WeightSplit
    (its adapter splits by it; sharded loading and the memory plan read it): by default the standard split of
    attention heads and feed-forward widths."""
    repeated_blocks: tuple[str, ...]
    """Names of the transformer's ModuleLists of repeated blocks: compiled one block at a time, their linears made
    FP8 by --fp8, and the step cache's block loop (its first block's change decides a step)."""
    block_outputs: tuple[tuple[str, ...], ...]
    """Per list of repeated_blocks: the block arguments its outputs replace, in return order (the step
    cache, engines.levers.step_cache, passes a skipped block's inputs on in that form)."""
    cache_stream: str = "hidden_states"
    """The first block's argument whose residual the step cache measures: the image or video tokens."""
    limits: str
    """Reference of the torch-free function (spec, folder, cfg_parallel) -> MediaLimits that reads
    what sizes and frame counts a checkpoint accepts from its configs."""
    guidance_batch: bool
    """Classifier-free guidance's two branches can run on two halves of the ranks (--cfg-parallel applies):
    batched in one transformer call (Cosmos-Predict2, Wan) or as two calls (Cosmos 3, FLUX.3 base:
    the transformer's forward_guided, engines.parallel.wrapper)."""
    guidance_calls: bool = False
    """Its classifier-free guidance runs the two branches as two transformer calls that cannot share a batch
    (their text lengths differ, FLUX.3 base's for one): a guided request's work counts both (pipelines.work); with
    --cfg-parallel they run at once on two rank groups (StagedPipeline.predict_guided)."""
    other_blocks: tuple[str, ...] = ()
    """More ModuleLists of repeated blocks (dotted paths reach into a ModuleDict: "mode_blocks.image"), compiled and
    made FP8 like repeated_blocks but outside the step cache's loop: FLUX.3's per-mode blocks, which run before its
    joint blocks on one stream each."""
    adapter_at_one_rank: bool = False
    """Its parallelize function also wraps the transformer of a one-rank run (Cosmos 3: its adapter marks
    the prompt-length dimension dynamic for compiled blocks)."""
    transformer_setup: str = ""
    """Reference of a function () -> None to call before its transformer runs outside its own pipeline (the
    work estimate's meta forward), e.g. Cosmos-style's pipelines.cosmos.torchvision_shim:install; "" for none."""
    bench: BenchShapes
    models: tuple[ModelSpec, ...] = field(default=())
    """Its named checkpoints."""

    @property
    def compiled_blocks(self) -> tuple[str, ...]:
        """Every list of repeated blocks: what per-block compilation and --fp8 reach
        (repeated_blocks + other_blocks)."""
        return self.repeated_blocks + self.other_blocks

    def __post_init__(self) -> None:
        for spec in self.models:
            if spec.family != self.name:
                raise ValueError(f"model {spec.name!r} names family {spec.family!r}, not {self.name!r}")
