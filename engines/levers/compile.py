"""Compile backends of a rank's transformer (eager, inductor, tensorrt) behind one interface: Engine.

    options = EngineOptions.parse("inductor-blocks+cudagraph")     # engines.options
    engine = prepare_engine(parallel_transformer, options, repeated_blocks=("transformer_blocks",),
                            cache_dir=Path("~/.cache/ulysses-studio/engines"))
    out = engine(**same_kwargs_as_diffusers)[0]     # first call per input signature builds (or loads)
    pipeline.use_transformer(engine)

Backends:
- "eager": the reference; nothing is compiled.
- "inductor": torch.compile of the rank's sharded forward with the functional collectives inside
  the graph. scope="whole" compiles the whole forward with fullgraph=True (sharding, blocks,
  gather: one graph); scope="blocks" compiles each repeated transformer block (fullgraph=True),
  which builds once per block class instead of once per model (regional compilation). Which
  ModuleLists hold the repeated blocks is the model family's record's to say (repeated_blocks).
- "tensorrt": torch-tensorrt's dynamo backend (torch.compile(backend="torch_tensorrt")), with its
  distributed tracing for the NCCL collective converters (TensorRT >= 10.16). Import-gated: it is
  written against torch-tensorrt's documented options and has NOT been run here (TensorRT's
  native libraries cannot be installed on these machines).

CUDA graphs per block (block_graphs=True, inductor-blocks): each compiled block is compiled with inductor's
CUDA graphs ("reduce-overhead": CUDA graph trees). The trees copy a call's inputs into static buffers unless
they are an earlier graph's outputs (one block's to the next: no copy) or parameters, and overwrite a graph's
outputs at its next replay; each engine call is one step of the trees (torch.compiler.cudagraph_mark_step_begin),
so the blocks of a call read each other's outputs in place; what the step cache keeps across steps it copies
(engines.levers.step_cache, StepCache.copies). The glue between the blocks (embedders, sharding, the final layer) runs
eagerly. This keeps CUDA graphs with a step cache, whose decision sits between the first block and the rest.

CUDA graphs (cuda_graph=True, any backend, CUDA only): after two warm-up calls, the whole rank
forward (eager glue, compiled graphs and NCCL collectives) is captured into one CUDA graph per
input signature and replayed; inputs are copied into static buffers, outputs cloned out. This
removes the host from the loop, which is what limits small shapes (docs/benchmarks.md). It holds
because: NCCL collectives are capturable (NCCL >= 2.9.6) once the communicator exists, and
init_parallel creates it eagerly (device_id) and the warm-up calls run every collective once; every
shape and split is a Python int fixed by the ShardLayout, so nothing syncs with the host. It does
NOT hold for gloo (CPU) groups, for inputs whose non-tensor values change between calls (a new
signature is captured), or for two engines replaying concurrently on one rank.

Engine cache: with a cache_dir, the first call of each input signature (shapes, dtypes, strides,
non-tensor values) looks for compiler artifacts under cache_dir/<key>/ where key hashes the model
class and config, dtype, device kind, the signature, the plan and rank, the backend options and
the library versions (engines.levers.cache). A hit loads them before compiling (inductor: FX graph,
AOTAutograd and autotuning caches via torch.compiler.load_cache_artifacts, so only dynamo's trace
runs); a miss compiles and saves them. A changed component gives another key: stale artifacts are
never loaded. The kernels inductor builds go to TORCHINDUCTOR_CACHE_DIR, which the entry points
point beside the engine cache (engines.options.run_environment); this module sets no variable.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from engines.levers.cache import EngineCache, input_signature
from engines.levers.quantized_attention import precision_signature
from engines.options import EngineOptions

OVERLAP_INDUCTOR_OPTIONS = {"reorder_for_locality": False, "reorder_for_peak_memory": False}
"""Inductor settings of EngineOptions.overlap: its scheduler then keeps the traced order of independent
nodes. (Its reorder_for_compute_comm_overlap passes were tried first: on a FLUX single block they
moved the MLP into the output all-to-all's window but never into the q/k/v all-to-all's.)"""


class BackendUnavailable(RuntimeError):
    """The requested backend's library is not installed here."""


@dataclass(kw_only=True)
class BuildRecord:
    """What the first call of one input signature did."""

    key: str
    cache_hit: bool
    """True when compiler artifacts were found and loaded before compiling."""
    seconds: float
    """Wall time of the first call(s): compile (or load) plus warm-up and CUDA graph capture."""
    saved: Path | None = None
    """Artifacts written by this build (None on a hit, for eager, or without a cache dir)."""


def tensorrt_available() -> bool:
    """True when torch-tensorrt can be imported (TensorRT's native libraries present)."""
    if importlib.util.find_spec("torch_tensorrt") is None:
        return False
    try:
        importlib.import_module("torch_tensorrt")
    except Exception:  # the bindings install without the native libraries
        return False
    return True


def _require_tensorrt() -> None:
    """BackendUnavailable, with the reason, unless torch-tensorrt can be imported here."""
    if not tensorrt_available():
        raise BackendUnavailable(
            "backend 'tensorrt' needs torch-tensorrt with TensorRT >= 10.16 (its NCCL collective converters); "
            "it is not installed here. Use --backend inductor."
        )


def _tensorrt_compile(fn: Callable[..., Any], dtype: torch.dtype, cache: Path | None) -> Callable[..., Any]:
    """torch-tensorrt dynamo backend with NCCL collective converters (see module docstring; not run here)."""
    _require_tensorrt()
    import torch_tensorrt  # noqa: F401 - registers backend="torch_tensorrt"

    options: dict[str, Any] = {
        "enabled_precisions": {dtype},
        "min_block_size": 1,
        "use_python_runtime": True,
        # trace functional collectives into TensorRT's NCCL/DistCollective layers
        "use_distributed_mode_trace": dist.is_initialized(),
    }
    if cache is not None:
        options.update(cache_built_engines=True, reuse_cached_engines=True, engine_cache_dir=str(cache))
    return torch.compile(fn, backend="torch_tensorrt", dynamic=False, options=options)


class _Graphed:
    """One CUDA graph of `fn` for one input signature: static inputs in, cloned outputs out."""

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any], warmup: int = 2) -> None:
        leaves, self._spec = pytree.tree_flatten(kwargs)
        self._static = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        static_kwargs = pytree.tree_unflatten(self._static, self._spec)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as graph capture requires
            for _ in range(warmup):
                fn(**static_kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._out = fn(**static_kwargs)

    def __call__(self, kwargs: dict[str, Any]) -> Any:
        leaves = pytree.tree_leaves(kwargs)
        for static, x in zip(self._static, leaves):
            if isinstance(static, torch.Tensor):
                static.copy_(x)
        self._graph.replay()
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self._out)


@dataclass(kw_only=True, eq=False)
class Engine:
    """A rank's transformer turned into an engine; called exactly like the diffusers model."""

    module: nn.Module
    """The (parallel) transformer it runs."""
    options: EngineOptions
    cache: EngineCache | None = None
    rank: int = 0
    builds: dict[str, BuildRecord] = field(default_factory=dict)
    """Input signature -> what its first call did."""
    _forward: Callable[..., Any] | None = None
    _graphs: dict[str, _Graphed] = field(default_factory=dict)
    _swapped: list[tuple[nn.ModuleList, int, nn.Module]] = field(default_factory=list)

    @property
    def config(self) -> Any:
        """The diffusers model's config (pipelines read it)."""
        return self.module.config

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype

    @property
    def device(self) -> torch.device:
        return self.module.device

    def __call__(self, **kwargs: Any) -> Any:
        signature = input_signature(kwargs) + precision_signature()
        if signature not in self.builds:
            return self._build(signature, kwargs)
        with torch.no_grad():
            if self.options.cuda_graph:
                return self._graphs[signature](kwargs)
            self._begin_block_graphs()
            return self._forward(**kwargs)

    def _begin_block_graphs(self) -> None:
        """With a CUDA graph per block: one call of the engine is one step of inductor's CUDA graph trees, so a
        block's outputs stay valid while the blocks after it read them. Without it every compiled block's call
        would start a step of its own, and the next block could overwrite the outputs it is reading."""
        if self.options.block_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def forward_guided(self, passes: list[dict[str, Any]]) -> list[Any]:
        """The first output of each of guidance's calls (`passes`, keyword arguments of the model) through
        this engine. A parallel transformer (engines.parallel.wrapper.ParallelTransformer.forward_guided, which splits
        them over CFG groups) is given the engine to run its group's call; a plain model runs them in turn."""
        guided = getattr(self.module, "forward_guided", None)
        if guided is not None:
            return guided(passes, call=self)
        return [self(**kwargs, return_dict=False)[0] for kwargs in passes]

    def _build(self, signature: str, kwargs: dict[str, Any]) -> Any:
        """First call of a signature: load or make artifacts, compile, capture; returns the output."""
        start = time.perf_counter()
        key, hit, saved = "", False, None
        compiled = self.options.backend != "eager"
        if self.cache is not None and compiled:
            key = self.cache.key(self.module, signature, self.options, self.rank)
            hit = self.cache.load(key, self.rank)
        with torch.no_grad(), _in_process_kernels(hit):
            if self.options.cuda_graph:
                self._graphs[signature] = _Graphed(self._forward, kwargs)
                out = self._graphs[signature](kwargs)
            else:
                self._begin_block_graphs()
                out = self._forward(**kwargs)
        if self.module.device.type == "cuda":
            torch.cuda.synchronize(self.module.device)
        if self.cache is not None and compiled and not hit:
            saved = self.cache.save(key, self.rank, dict(signature=signature, options=asdict(self.options)))
        self.builds[signature] = BuildRecord(key=key, cache_hit=hit, seconds=time.perf_counter() - start, saved=saved)
        return out

    def release(self) -> nn.Module:
        """Put compiled blocks back to their plain modules and return the module."""
        for container, index, original in self._swapped:
            container[index] = original
        self._swapped = []
        self._graphs.clear()
        return self.module


@contextmanager
def _in_process_kernels(cached: bool) -> Iterator[None]:
    """With the engine's artifacts in its cache: inductor loads its kernels in this process, with no compile-worker
    pool. Loading a cached graph runs its kernels' async_compile.triton calls, each of which starts inductor's pool of
    worker processes (min(32, cores) processes importing torch) where compile_threads > 1, though nothing is left to
    compile: on 2x H200 (torch 2.11) a warm `launch --nproc 2 generate` then ended 5-8 s after its image, waiting at
    its exit for the pool it had just started, against under 2 s for a cold one."""
    if not cached:
        yield
        return
    from torch._inductor import config

    with config.patch(compile_threads=1):
        yield


RECOMPILE_LIMIT = 512
"""Graphs dynamo may keep for one function (a block class's forward): one per input signature of every engine of the
process. Engines are static-shape by design (a graph, and a CUDA graph, per shape), and a rank's engines share their
blocks' code: a server keeps one engine per layout (all ranks, smaller groups) and calls it at every served size,
frame count and guidance batch, each a graph of its own. Dynamo's default of 8 is a guard against a function that
recompiles by mistake; with fullgraph=True, reaching it fails the call. On 2x H200 (torch 2.11) a `serve` of
tiny-cosmos with `--replicas auto` hit it at its ninth graph: the calibration of its second layout failed, then a
request, on rank 0 alone, and the job ended."""


def allow_a_graph_per_signature() -> None:
    """Raise dynamo's per-function and per-process recompile limits to RECOMPILE_LIMIT (never lowering them)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 16 * RECOMPILE_LIMIT)


def _inductor_compile(module: nn.Module, options: EngineOptions) -> Callable[..., Any]:
    """torch.compile with inductor, fullgraph and static shapes (with overlap: OVERLAP_INDUCTOR_OPTIONS; with
    block_graphs: inductor's CUDA graphs, "reduce-overhead")."""
    settings = {**(OVERLAP_INDUCTOR_OPTIONS if options.overlap else {}),
                **({"triton.cudagraphs": True} if options.block_graphs else {})}
    if settings:
        return torch.compile(module, fullgraph=True, dynamic=False, options=settings)
    return torch.compile(module, fullgraph=True, dynamic=False)


def _inner_model(module: nn.Module) -> nn.Module:
    """The diffusers model inside a ParallelTransformer (or the module itself)."""
    return getattr(module, "model", module)


def prepare_engine(
    transformer: nn.Module,
    options: EngineOptions,
    *,
    repeated_blocks: tuple[str, ...] = (),
    cache_dir: Path | str | None = None,
    rank: int | None = None,
) -> Engine:
    """Turn a rank's transformer (a ParallelTransformer or a plain diffusers model) into an Engine.

    Nothing is compiled yet: torch.compile builds at the first call of each input signature, after
    loading that signature's artifacts from `cache_dir` if they are there (see the module
    docstring). Call the engine once with a request's inputs to build ahead of time.

    Args:
        repeated_blocks: names of the model's ModuleLists of repeated blocks (scope "blocks").
        rank: this process's rank, part of the cache key (default: torch.distributed's, else 0).
    """
    if options.cuda_graph and transformer.device.type != "cuda":
        raise ValueError(f"cuda_graph needs a CUDA transformer, this one is on {transformer.device}")
    if options.backend == "tensorrt":
        _require_tensorrt()
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    cache = EngineCache(Path(cache_dir).expanduser()) if cache_dir is not None else None
    engine = Engine(module=transformer, options=options, cache=cache, rank=rank)
    backend = options.backend
    if backend != "eager":
        allow_a_graph_per_signature()
    if backend == "eager":
        engine._forward = transformer
    elif options.scope == "whole":
        if backend == "inductor":
            engine._forward = _inductor_compile(transformer, options)
        else:
            trt_cache = cache.root / "tensorrt" if cache is not None else None
            engine._forward = _tensorrt_compile(transformer, transformer.dtype, trt_cache)
    else:
        model = _inner_model(transformer)
        if not repeated_blocks:
            raise ValueError(f"no repeated blocks named for {type(model).__name__}; use scope 'whole'")
        # every list is found before a block is swapped, so that a missing one leaves the model as it was
        lists: list[nn.ModuleList] = [model.get_submodule(name)  # a dotted path reaches into a ModuleDict
                                      for name in repeated_blocks]
        for blocks in lists:
            for index, block in enumerate(blocks):
                if backend == "inductor":
                    compiled = _inductor_compile(block, options)
                else:
                    compiled = _tensorrt_compile(block, transformer.dtype, None)
                engine._swapped.append((blocks, index, block))
                blocks[index] = compiled
        engine._forward = transformer
    return engine
