"""Peers for the benchmark: xDiT (xfuser) and cache-dit context parallelism on the same FLUX model.

Each peer runs the benchmark's random-weight FluxTransformer2DModel, through a copy that shares its
weights (the benchmark's own model keeps its processors and hooks), parallelized over all ranks and
compiled the way the peer's own runner does it:

- xDiT (xfuser 0.7.0 with yunchang): xFuserFlux1Transformer2DWrapper, the FLUX transformer of xDiT's
  runner when PipeFusion is off (xfuser/model_executor/models/runner_models/flux.py), Ulysses degree
  = ranks, attention backend as xDiT picks it (cuDNN SDPA where flash-attn is not installed).
  Compiled: inductor's compute/communication reordering on, then torch.compile of the whole
  transformer with mode="reduce-overhead" (CUDA graphs), as that runner's _compile_model does.
  It runs on 1 GPU too (Ulysses degree 1), and needs CUDA: xfuser does not import without a GPU.
- cache-dit (1.5.3): cache_dit.enable_cache(transformer, parallelism_config=ParallelismConfig(
  ulysses_size=ranks)) with no cache config, so no step caching; attention "native" (its default
  under context parallelism). Compiled: cache_dit.set_compile_configs() and
  transformer.compile_repeated_blocks(), as its example runner's --compile does. Its context
  parallelism needs 2 or more ranks; it runs on gloo CPU ranks too.

The packages are optional: `unavailable_reason` says why a peer cannot run here, and every import
of them happens inside the functions below, so nothing else needs them installed. Both peers change
process-wide compiler settings when they compile; `compiler_settings_restored` puts them back.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.inputs import BenchModel
from engines.parallel.distributed import ParallelContext


@dataclass(kw_only=True, frozen=True)
class Peer:
    """What the benchmark needs to know about one peer."""

    name: str
    """Command-line name."""
    title: str
    """Name in the mode column, e.g. "xDiT" -> "xDiT ulysses-2"."""
    package: str
    """Import name of its package."""
    compiled_backend: str
    """Label of its compiled mode for the backend column: the engine label (engines.options.EngineOptions)
    of the closest compile of ours, or inductor's mode name where we have none."""
    compile_note: str
    """What its compiled mode does exactly."""


PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in (
        Peer(name="xdit", title="xDiT", package="xfuser", compiled_backend="inductor-reduce-overhead",
             compile_note="xDiT runner: reorder_for_compute_comm_overlap, torch.compile(transformer, "
                          "mode='reduce-overhead')"),
        Peer(name="cache-dit", title="cache-dit", package="cache_dit", compiled_backend="inductor-blocks",
             compile_note="cache-dit runner: set_compile_configs(), compile_repeated_blocks(fullgraph=False)"),
    )
}


def unavailable_reason(peer: Peer, ctx: ParallelContext, spec: BenchModel) -> str | None:
    """Why `peer` cannot run on this rank (None when it can). No collective, no import of the peer."""
    if peer.name not in spec.family.bench.peers:
        return f"{peer.title} is not measured on {spec.family.title} models here (their record names no such peer)"
    if importlib.util.find_spec(peer.package) is None:
        return f"{peer.title} is not installed (no module {peer.package!r})"
    if peer.name == "xdit" and ctx.device.type != "cuda":
        return "xDiT needs CUDA (xfuser raises at import without a GPU)"
    if peer.name == "cache-dit" and ctx.world_size < 2:
        return "cache-dit's context parallelism needs 2 or more ranks (ulysses_size=1 is refused)"
    return None


def import_peer(peer: Peer) -> None:
    """Import the peer's modules that `parallelize_peer` uses (raises what the import raises)."""
    if peer.name == "xdit":
        import xfuser.model_executor.models.transformers.transformer_flux  # noqa: F401 - the import is the check
        from xfuser.config import xFuserArgs  # noqa: F401 - the import is the check
    else:
        from cache_dit import ParallelismConfig, enable_cache  # noqa: F401 - the import is the check


def shared_copy(model_class: type[nn.Module], spec: BenchModel, model: nn.Module) -> nn.Module:
    """A new `model_class(**spec.config)` whose parameters are `model`'s own tensors (no memory, no copy)."""
    with torch.device("meta"):
        copy = model_class(**spec.config)
    copy.load_state_dict(model.state_dict(), assign=True)
    return copy.eval().requires_grad_(False)


def parallelize_peer(peer: Peer, spec: BenchModel, model: nn.Module, ctx: ParallelContext, *,
                     height: int, width: int, text_tokens: int) -> nn.Module:
    """The peer's parallel FLUX transformer on this rank, called with diffusers' keyword arguments.

    Collective (process groups are created): every rank calls it. `height`, `width` and
    `text_tokens` describe the first input (xDiT keeps them in its runtime state).
    """
    if peer.name == "xdit":
        return _xdit_transformer(spec, model, ctx, height=height, width=width, text_tokens=text_tokens)
    return _cache_dit_transformer(spec, model, ctx)


def set_input_shape(peer: Peer, *, height: int, width: int, text_tokens: int) -> None:
    """Tell the peer the size of the next inputs (xDiT's runner does this before every generation)."""
    if peer.name == "xdit":
        from xfuser.core.distributed import get_runtime_state

        get_runtime_state().set_input_parameters(height=height, width=width, batch_size=1,
                                                 max_condition_sequence_length=text_tokens,
                                                 split_text_embed_in_sp=True)


def compile_peer(peer: Peer, transformer: nn.Module) -> nn.Module:
    """The peer's compiled transformer, as its runner compiles it (see the module docstring)."""
    if peer.name == "xdit":
        # xfuser runner_models/base_model.py: _enable_compute_comm_overlap, then _compile_model with
        # FLUX's _get_compile_mode() == "reduce-overhead" and _get_compile_dynamic() == None.
        torch._inductor.config.reorder_for_compute_comm_overlap = True
        torch._inductor.config.reorder_for_compute_comm_overlap_passes = [
            "reorder_compute_for_overlap", "sink_waits", "raise_comms",
        ]
        return torch.compile(transformer, mode="reduce-overhead")
    import cache_dit

    # cache_dit/_utils/utils.py maybe_compile_transformer with --compile and no other flag.
    cache_dit.set_compile_configs()
    torch.set_float32_matmul_precision("high")
    transformer.compile_repeated_blocks(fullgraph=False, mode=None, dynamic=False)
    return transformer


@contextmanager
def compiler_settings_restored() -> Iterator[None]:
    """Undo, on leaving, what a peer changed in inductor's and dynamo's settings and the matmul precision."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    saved = {module: module.get_config_copy() for module in (inductor_config, dynamo_config)}
    precision = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        for module, before in saved.items():
            now = module.get_config_copy()
            module.load_config({key: value for key, value in before.items() if now.get(key) != value})
        torch.set_float32_matmul_precision(precision)


def _xdit_transformer(spec: BenchModel, model: nn.Module, ctx: ParallelContext, *, height: int,
                      width: int, text_tokens: int) -> nn.Module:
    import torch.distributed as dist
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from xfuser.config import xFuserArgs
    from xfuser.core.distributed import init_distributed_environment, initialize_runtime_state
    from xfuser.model_executor.models.transformers.transformer_flux import xFuserFlux1Transformer2DWrapper

    # Joins the process group torchrun set up (and creates it on a single rank, where ours has none).
    init_distributed_environment(rank=ctx.rank, world_size=ctx.world_size)
    engine_config, _ = xFuserArgs(ulysses_degree=dist.get_world_size(), ring_degree=1).create_config()
    # The runtime state reads the pipeline's transformer config and VAE scale; a FluxPipeline of the
    # benchmark's model and no other component is what xDiT's runner hands it, minus the encoders.
    # It also creates xDiT's process groups, which the wrapper's attention processors look up.
    pipeline = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
                            tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=model)
    initialize_runtime_state(pipeline, engine_config)
    set_input_shape(PEERS["xdit"], height=height, width=width, text_tokens=text_tokens)
    return shared_copy(xFuserFlux1Transformer2DWrapper, spec, model)


def _cache_dit_transformer(spec: BenchModel, model: nn.Module, ctx: ParallelContext) -> nn.Module:
    from cache_dit import ParallelismConfig, enable_cache
    from diffusers import FluxTransformer2DModel

    transformer = shared_copy(FluxTransformer2DModel, spec, model)
    # No cache_config: cache-dit then applies its parallelism only ("skip cache acceleration").
    return enable_cache(transformer, parallelism_config=ParallelismConfig(ulysses_size=ctx.world_size))


def peer_mode(peer: Peer, world_size: int) -> str:
    """Mode column of a peer's rows, e.g. "xDiT ulysses-2"."""
    return f"{peer.title} ulysses-{world_size}"

