"""Every run option's name, choices and default, and the environment a run sets: one torch-free module.

The CLI (`--help`, the checks made before anything is loaded) and the engines read their choices
from here, so the two can never disagree and `ulysses-studio --help` imports no torch.

    options = RunOptions(strategy="allgather", all_to_all="copy-engine",
                         backend="inductor-blocks+overlap+cudagraph")
    engine = EngineOptions.parse(options.backend_for("cuda"))
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Collection, MutableMapping
from dataclasses import dataclass
from pathlib import Path

STRATEGIES = ("ulysses", "ring", "allgather", "ulysses-ring")
"""How the ranks of one guidance branch split the token sequence (engines.parallel.plan.ParallelPlan):
ulysses = all-to-all from sequence shards to head shards; ring = K/V passed around the ranks;
allgather = K/V gathered once, one attention over every key; ulysses-ring = both axes."""

TRANSPORTS = ("nccl", "copy-engine")
"""How the context-parallel exchanges (Ulysses all-to-alls, ring K/V passes, K/V all-gathers)
travel: the process group's collectives, or peer copies on the GPUs' copy engines
(engines/parallel/copy_engine.py)."""


def check_choice(what: str, value: str, choices: Collection[str]) -> None:
    """ValueError unless `value` is one of `choices`, naming `what` it is and the choices."""
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")


BACKENDS = ("eager", "inductor", "tensorrt")
SCOPES = ("whole", "blocks")

DEFAULT_STRATEGY = "ulysses"
DEFAULT_TRANSPORT = "nccl"
DEFAULT_RANK_TIMEOUT = 30.0
"""Seconds a rank waits for the others at an agreement point before it ends the job."""

ENGINE_CACHE_ENV = "ULYSSES_STUDIO_ENGINE_CACHE"
DEFAULT_ENGINE_CACHE = Path("~/.cache/ulysses-studio/engines")

CUBLAS_WITHOUT_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}
"""cuBLAS without a workspace. With one, cuBLAS picks variants of its Hopper GEMM kernels that need a
4-byte memset before each launch; inside a CUDA graph each memset costs 4-9 us of idle GPU, ~300 a
FLUX step. Without one it picks the same tiles without the memset. Measured on H200
(docs/benchmarks.md): FLUX.1-dev 1024² steps 2.5-3.4% faster on 1 and 2 GPUs, 2048² 1.3%,
Cosmos-Predict2-2B unchanged. It takes effect only before a process's first cuBLAS call, which is
why entry points set it before they import torch."""


def default_backend(device_type: str, *, cache: bool = False) -> str:
    """On GPUs, per-block compiled engines (built in seconds) replayed as CUDA graphs: one graph per call, or
    with a step cache (whose decision sits between the blocks) one per block; eager on CPUs.

    Without graphs a step split over several GPUs is paced by the host's kernel launches, not by the GPUs.
    Measured (docs/benchmarks.md), 4x H200, one step, per-block compiled against the same in one graph:
    Qwen-Image 1328² ulysses-4 339.8 -> 80.0 ms (1 GPU 240.2 -> 237.0), FLUX.3 Klein base 1024² ulysses-4
    58.6 -> 25.1 ms; FLUX.2 Klein 4B ulysses-2 39.4 -> 34.0 ms; FLUX.1-dev 1024² --fp8, one H100, 173 -> 97 ms.
    Video steps (Wan, Cosmos 3 Nano) take the same time either way (within 1%). A graph per block costs
    some of that back: FLUX.1-dev allgather-2 --fp8, 56.1 ms in one graph, 64.2 ms in a graph per block."""
    if device_type != "cuda":
        return "eager"
    return "inductor-blocks+blockgraph" if cache else "inductor-blocks+cudagraph"


def engine_cache_dir(given: Path | str | None) -> Path:
    """The engine cache folder: `given`, else $ULYSSES_STUDIO_ENGINE_CACHE, else ~/.cache/ulysses-studio/engines."""
    if given is not None:
        return Path(given).expanduser()
    return Path(os.environ.get(ENGINE_CACHE_ENV) or DEFAULT_ENGINE_CACHE).expanduser()


BYTECODE_CACHE = Path("~/.cache/ulysses-studio/bytecode")


def bytecode_outside_sources(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Where this process may not write bytecode beside the sources (PYTHONDONTWRITEBYTECODE=1, as container images
    set), write and read it in BYTECODE_CACHE instead (sys.pycache_prefix), and let the processes it starts (torchrun,
    the ranks) do the same; returns that folder, or None where nothing changed (bytecode allowed, or a prefix the user
    set). Otherwise every process compiles torch's, transformers' and diffusers' Python from source again: on a GPU
    machine's image that sets the variable and ships torch without bytecode, a rank's imports took 20 s, and 8 s once
    its bytecode was kept (docs/app-on-gpus.md). The sources' folders stay unwritten, as the variable asks."""
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None:
        return None
    folder = BYTECODE_CACHE.expanduser()
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    environ["PYTHONPYCACHEPREFIX"] = str(folder)
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder


def run_environment(engine_cache: Path, local_ranks: int | None = None) -> dict[str, str]:
    """The variables a run sets where the user has not: cuBLAS without a workspace (see
    CUBLAS_WITHOUT_WORKSPACE); inductor's kernel cache beside the engine cache, so that the
    kernels an engine build makes (C++ on CPUs, Triton on GPUs) are found again with its artifacts; and
    inductor's compile workers (see compile_workers_environment)."""
    return {**CUBLAS_WITHOUT_WORKSPACE, "TORCHINDUCTOR_CACHE_DIR": str(engine_cache / "inductor"),
            **compile_workers_environment(local_ranks)}


def compile_workers_environment(local_ranks: int | None = None) -> dict[str, str]:
    """Inductor's compile workers started only when there are kernels to compile, and this host's cores shared
    between its ranks (`local_ranks`, default torchrun's LOCAL_WORLD_SIZE).

    By default inductor starts a pool of min(32, cores) worker processes at a process's first compile, whether or
    not its kernels are cached (TORCH_WARM_POOL), in every rank: 64 processes importing torch beside the 2 ranks of
    a 32-core GPU host, for a warm engine cache that compiles no kernel, and a pool to stop at the exit. Without the
    warm-up the pool starts at the first kernel that must be compiled; with one thread (a core per rank or fewer)
    kernels compile in the rank's own process."""
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"TORCH_WARM_POOL": "0", "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, min(32, cores // max(1, local_ranks))))}


def set_environment(values: dict[str, str], environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each of `values` that the user has not set in `environ` (the two cuBLAS variables together:
    either one set by the user keeps both as they are); returns what was set. For entry points,
    before their first cuBLAS call and first compile."""
    skip = set(CUBLAS_WITHOUT_WORKSPACE) if any(name in environ for name in CUBLAS_WITHOUT_WORKSPACE) else set()
    applied = {name: value for name, value in values.items() if not _user_set(name, environ) and name not in skip}
    environ.update(applied)
    return applied


def _user_set(name: str, environ: MutableMapping[str, str]) -> bool:
    """Whether `name` in `environ` is the user's choice. Torch fills in TORCHINDUCTOR_CACHE_DIR with
    inductor's default folder when parts of it are imported (torch._dynamo in torch 2.13), and a process
    passes the value on to the processes it starts: that value is not a choice, whatever set it. Taking
    it for one sends the kernels to the machine-wide folder, where a "cold" engine cache finds them warm
    (served ranks on GPUs compiled there: docs/benchmarks.md, "The application on GPUs")."""
    value = environ.get(name)
    if name == "TORCHINDUCTOR_CACHE_DIR" and value:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(value) != os.path.abspath(default_cache_dir())
    return value is not None


@dataclass(kw_only=True, frozen=True, slots=True)
class EngineOptions:
    """How a rank's transformer is turned into an engine (engines.levers.compile); written as a label,
    e.g. "inductor-blocks+overlap+cudagraph"."""

    backend: str = "eager"
    """"eager", "inductor" or "tensorrt"."""
    scope: str = "whole"
    """"whole" (one fullgraph compile of the rank forward) or "blocks" (each repeated block)."""
    cuda_graph: bool = False
    """Capture the whole rank forward into one CUDA graph per input signature (CUDA only)."""
    block_graphs: bool = False
    """inductor-blocks only: each compiled block replays its own CUDA graph (inductor's CUDA graph trees, which
    hand one block's outputs to the next without copies), and the loop over the blocks stays in Python, so a
    step cache still decides between them (keeps_block_loop). On CPUs inductor captures nothing."""
    overlap: bool = False
    """inductor only: keep the program's order of collectives and compute (inductor's locality and
    peak-memory reorderings off). Blocks that write their compute between a collective's start and
    its wait (pipelines.flux.blocks.OverlappedSingleBlock) then run it during the transfer; with the
    default reorderings inductor moves that compute after the wait (tests/test_engines_flux_overlap.py)."""

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, BACKENDS)
        check_choice("compile scope", self.scope, SCOPES)
        if self.scope == "blocks" and self.backend == "eager":
            raise ValueError("the eager backend compiles nothing: it has no -blocks form")
        if self.overlap and self.backend != "inductor":
            raise ValueError("+overlap applies to the inductor backend only")
        if self.block_graphs and (self.backend != "inductor" or self.scope != "blocks"):
            raise ValueError("+blockgraph applies to inductor-blocks only (a CUDA graph per compiled block)")
        if self.block_graphs and self.cuda_graph:
            raise ValueError("+blockgraph and +cudagraph exclude each other: a CUDA graph per block, or one for the "
                             "whole forward")

    @property
    def keeps_block_loop(self) -> bool:
        """Whether the loop over the transformer's blocks stays in Python, as a step cache needs (it decides
        between the blocks): per-block compiled engines (with a CUDA graph per block or none), or eager, without
        a whole-forward CUDA graph."""
        return not self.cuda_graph and (self.scope == "blocks" or self.backend == "eager")

    @property
    def label(self) -> str:
        """Short name, e.g. "eager", "inductor", "inductor-blocks+overlap+cudagraph"."""
        name = self.backend + ("-blocks" if self.scope == "blocks" else "")
        return (name + ("+overlap" if self.overlap else "") + ("+cudagraph" if self.cuda_graph else "")
                + ("+blockgraph" if self.block_graphs else ""))

    @classmethod
    def parse(cls, text: str) -> EngineOptions:
        """Inverse of `label`: "inductor-blocks+overlap+cudagraph" -> EngineOptions(...); ValueError
        naming what is wrong."""
        name, *flags = text.split("+")
        unknown = set(flags) - {"overlap", "cudagraph", "blockgraph"}
        if unknown:
            raise ValueError(f"unknown engine option(s) {', '.join(sorted(unknown))} in {text!r}; "
                             "options are +overlap, +cudagraph and +blockgraph")
        backend, _, scope = name.partition("-")
        if scope not in ("", "blocks"):
            raise ValueError(f"{text!r} is not an engine; use eager, inductor, inductor-blocks or tensorrt(-blocks), "
                             "optionally with +overlap (inductor) and +cudagraph or +blockgraph (inductor-blocks)")
        return cls(backend=backend, scope="blocks" if scope else "whole", cuda_graph="cudagraph" in flags,
                   overlap="overlap" in flags, block_graphs="blockgraph" in flags)


CACHES = {"fbcache": 0.08}
"""Step caches (engines.levers.step_cache) and their default thresholds. fbcache: first-block cache; 0.08 is
ParaAttention's and cache-dit's FLUX default (diffusers' hook defaults to 0.05)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class CacheOptions:
    """A step cache and its threshold (engines.levers.step_cache); written as "fbcache" or "fbcache:0.12"."""

    name: str = "fbcache"
    """One of CACHES."""
    threshold: float = CACHES["fbcache"]
    """A step reuses the cached blocks when its first block's residual changed by less than this
    (relative): higher skips more steps and strays further from the full computation."""

    def __post_init__(self) -> None:
        check_choice("step cache", self.name, CACHES)
        if not self.threshold > 0:
            raise ValueError(f"a step cache threshold is a relative change above 0, got {self.threshold}")

    @property
    def label(self) -> str:
        return f"{self.name}:{self.threshold:g}"

    @classmethod
    def parse(cls, text: str) -> CacheOptions:
        """Inverse of `label`; the threshold may be left out (the cache's default)."""
        name, _, threshold = text.partition(":")
        check_choice("step cache", name, CACHES)
        try:
            value = float(threshold) if threshold else CACHES[name]
        except ValueError as error:
            raise ValueError(f"{text!r}: the threshold after ':' must be a number, e.g. {name}:0.1") from error
        return cls(name=name, threshold=value)


ATTENTION_PRECISIONS = ("full", "fp8", "int8")
"""--attention-precision choices (engines/levers/quantized_attention.py): full = the run's dtype; int8 = SageAttention's
method (K smoothed by its mean, INT8 Q·Kᵀ with per-block scales, FP16 P·V); fp8 = e4m3 Q, K, V with per-block
scales (K smoothed too)."""

FULL_PRECISION_EDGE_STEPS = 1
"""With a quantized attention precision, the first and the last this many denoising steps still run full
precision: the first steps lay out the whole image from noise, the last ones set its finest detail, and xDiT
warns that FP8 attention alone can leave artifacts there (it keeps those steps in higher precision). One each
keeps 26 of a 28-step run's steps quantized, 6 of an 8-step one's."""


def attention_precision_at(precision: str, index: int, total: int) -> str:
    """The attention precision of denoising step `index` of `total` in a run of `precision`: full precision on
    the first and last FULL_PRECISION_EDGE_STEPS steps, `precision` on the others."""
    edge = index < FULL_PRECISION_EDGE_STEPS or index >= total - FULL_PRECISION_EDGE_STEPS
    return "full" if edge else precision


SPLIT_VAE = ("auto", "on", "off")
"""--split-vae choices (RunOptions.split_vae)."""


def splits_vae(choice: str, media: str) -> bool:
    """Whether --split-vae `choice` splits the VAE of a model making `media` ("image" or "video").

    "auto" splits video VAEs only, as measured on one H100 (2026-11-25, random weights, each part run
    alone): Cosmos-Predict2's Wan decode of 93x704x1280 takes 8.50 s whole and 4.69 s / 2.87 s for the
    largest of 2 / 4 parts; FLUX.1's 1024² decode takes 0.090 s whole and 0.113 s / 0.089 s per part,
    since every part repeats the whole-latent mid-block: no gain before the exchanges are paid."""
    return choice == "on" or (choice == "auto" and media == "video")


LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
LORA_MAX_SCALE = 10.0
"""Largest |scale| a LoRA may be used with (beyond it images are noise, and typos like 80 for 0.8 are caught)."""


class LoraError(ValueError):
    """A LoRA file or choice this run cannot use, with a message for the person who gave it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraFile:
    """One `--lora NAME=PATH[,PATH_2][:SCALE]`: the name requests use, the file, its scale when a request names no
    LoRA; for a two-expert model (Wan 2.2 A14B) a second file may adapt its second, low-noise expert."""

    name: str
    path: Path
    scale: float = 1.0
    path_2: Path | None = None
    """The second expert's file (Wan 2.2 LoRAs come as a high-noise and a low-noise file); None: `path` adapts
    every transformer of the model."""

    def for_expert(self, index: int) -> LoraFile:
        """This LoRA as its file for transformer `index` of a model (0: the first, or only, one)."""
        if index == 0 or self.path_2 is None:
            return LoraFile(name=self.name, path=self.path, scale=self.scale)
        return LoraFile(name=self.name, path=self.path_2, scale=self.scale)

    @classmethod
    def parse(cls, text: str) -> LoraFile:
        """'style=/loras/style.safetensors:0.8' -> LoraFile('style', that path, 0.8); no ':SCALE' is 1;
        'fast=high.safetensors,low.safetensors' -> one file for each expert of a two-expert model."""
        name, equals, rest = text.partition("=")
        if not equals or not rest:
            raise LoraError(f"--lora takes NAME=PATH[,PATH_2][:SCALE], e.g. style=loras/style.safetensors:0.8; "
                            f"got {text!r}")
        if not LORA_NAME.fullmatch(name):
            raise LoraError(f"LoRA name {name!r}: letters, digits, '_', '.' and '-' only (up to 64, not first)")
        path, scale = rest, 1.0
        head, colon, tail = rest.rpartition(":")
        if colon and head:
            try:
                path, scale = head, float(tail)
            except ValueError:
                pass  # a ':' of the path itself
        check_lora_scale(name, scale)
        paths = path.split(",")
        if len(paths) > 2 or not all(paths):
            raise LoraError(f"--lora {name}: one file, or two separated by ',' (a two-expert model's high-noise and "
                            f"low-noise files); got {path!r}")
        return cls(name=name, path=Path(paths[0]).expanduser(), scale=scale,
                   path_2=Path(paths[1]).expanduser() if len(paths) == 2 else None)


def check_lora_scale(name: str, scale: float) -> None:
    """LoraError unless `scale` is a finite number within +-LORA_MAX_SCALE."""
    if not (abs(scale) <= LORA_MAX_SCALE):  # NaN fails too
        raise LoraError(f"LoRA {name}'s scale must be a number from -{LORA_MAX_SCALE:g} to {LORA_MAX_SCALE:g}, "
                        f"got {scale}")


@dataclass(kw_only=True, frozen=True, slots=True)
class RunOptions:
    """How a run spreads its models over the ranks and turns their transformers into engines: the
    options `generate`, `serve`, `batch` and `build` share, checked once here."""

    device: str | None = None
    """"cuda", "cuda:1", "cpu", or None: this rank's GPU when there is one, else the CPU."""
    strategy: str = DEFAULT_STRATEGY
    """One of STRATEGIES."""
    cfg_parallel: bool = False
    """Guidance-batched (Cosmos-style) models: the conditional and unconditional branches run on two
    halves of the ranks, each half splitting the sequence by `strategy`."""
    all_to_all: str = DEFAULT_TRANSPORT
    """One of TRANSPORTS."""
    backend: str | None = None
    """An EngineOptions label; None picks default_backend for the device."""
    engine_cache: Path | None = None
    """Engine cache folder; None: engine_cache_dir's default."""
    rank_timeout: float = DEFAULT_RANK_TIMEOUT
    """Seconds a rank waits for the others at an agreement point."""
    fp8: bool = False
    """The linear layers of the transformer's repeated blocks run as FP8 GEMMs (engines/levers/fp8.py): faster,
    approximate. With `tp`, each rank quantizes its shards with the scales one process uses."""
    cache: str | None = None
    """A CacheOptions label ("fbcache", "fbcache:0.12"): steps whose first block barely changed skip the
    other blocks (engines/levers/step_cache.py): faster, approximate. None: every step computed."""
    tp: int = 1
    """Ranks that split each transformer block's weights (tensor parallelism, engines/parallel/tensor_parallel.py);
    the other axes split the rest of the ranks as without it."""
    split_vae: str = "auto"
    """One of SPLIT_VAE. With several ranks, "on": each rank decodes a band of the image's rows and rank 0
    gathers them (pipelines/split_vae.py: equal to one rank's decode within one 8-bit level in float32),
    and a Cosmos-Predict2 input is encoded so; every rank then holds the VAE. "off": rank 0 alone holds
    the VAE and runs it. "auto": "on" for video models, "off" for image models (splits_vae)."""
    loras: tuple[LoraFile, ...] = ()
    """LoRA files every transformer carries (engines/weights/lora.py), chosen and weighted per request."""
    attention_precision: str = "full"
    """One of ATTENTION_PRECISIONS: the transformer's attention kernels at full precision, or quantized ("fp8",
    "int8": faster on GPUs, approximate) on every step but the first and last FULL_PRECISION_EDGE_STEPS; a
    request may ask for full precision (GenerationRequest.quantized_attention)."""

    def __post_init__(self) -> None:
        check_choice("--attention-precision", self.attention_precision, ATTENTION_PRECISIONS)
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ValueError(f"--tp must be a positive integer, got {self.tp!r}")
        check_choice("--split-vae", self.split_vae, SPLIT_VAE)
        check_choice("strategy", self.strategy, STRATEGIES)
        check_choice("all-to-all transport", self.all_to_all, TRANSPORTS)
        engine = EngineOptions.parse(self.backend) if self.backend is not None else None
        if not self.rank_timeout > 0:
            raise ValueError(f"rank timeout must be positive, got {self.rank_timeout}")
        if self.cache is not None:
            CacheOptions.parse(self.cache)
            if engine is not None and not engine.keeps_block_loop:
                raise ValueError(f"--cache decides between steps outside the compiled graphs, so it needs the block "
                                 f"loop outside them: use --backend eager, inductor-blocks or "
                                 f"inductor-blocks+blockgraph (a CUDA graph per block), not {engine.label}")

    @property
    def lora_defaults(self) -> tuple[tuple[str, float], ...]:
        """(name, scale) of each LoRA: what a request that chooses none uses (MediaLimits.loras)."""
        return tuple((lora.name, lora.scale) for lora in self.loras)

    def splits_vae(self, media: str) -> bool:
        """Whether a model making `media` ("image" or "video") splits its VAE over the ranks (with several)."""
        return splits_vae(self.split_vae, media)

    @property
    def step_cache(self) -> CacheOptions | None:
        """The step cache in effect, or None."""
        return CacheOptions.parse(self.cache) if self.cache is not None else None

    def engine(self, device_type: str) -> EngineOptions:
        """The engine this run builds on a `device_type` ("cuda" or "cpu") rank."""
        return EngineOptions.parse(self.backend or default_backend(device_type, cache=self.cache is not None))

    @property
    def cache_dir(self) -> Path:
        """The engine cache folder in effect."""
        return engine_cache_dir(self.engine_cache)
