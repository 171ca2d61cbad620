"""One rank's start-up: join the run, load the models, parallelize their transformers, build the service.

The same code runs as a single plain process (one rank, no process group, plain transformer) and as
any rank of a torchrun job. Ranks > 0 load no text encoders: encoding runs once, on rank 0, which keeps
recent encodings (pipelines.prompt_cache), and the encoded prompt is broadcast. The VAE decode (and a
Cosmos-Predict2 input's encode) is split over the ranks (--split-vae on, and auto's default for video
models: every rank loads the VAE; pipelines.split_vae), or runs on rank 0 alone (off, and auto for image
models: ranks > 0 load no VAE).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from app.failures import RankLost, StartupError, describe
from app.stage_times import StageSeconds
from app.stopping import StopRequest
from engines.options import RunOptions
from pipelines.registry import ModelSpec, family_of
from pipelines.requests import MediaLimits, read_limits, uses_guidance_batch

if TYPE_CHECKING:  # the module stays light to import: torch comes in with start_runtime
    from app.groups import Link, RemoteGroup
    from app.lockstep import LockstepService


@dataclass(frozen=True, kw_only=True)
class ServedModel:
    """A model this run serves, under its service key (its media: "image" or "video")."""

    spec: ModelSpec
    folder: Path
    limits: MediaLimits

    @property
    def key(self) -> str:
        return self.spec.media


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """What a command needs once its rank has started."""

    service: LockstepService
    """This rank's group's lockstep service."""
    models: dict[str, ServedModel]
    """Service key -> model."""
    world_size: int
    is_main: bool
    """Rank 0: the rank that talks to the user."""
    plan: str
    """How the ranks split each transformer (its plan), e.g. 'allgather-2, all-to-all copy-engine' or
    'none (1 rank)'."""
    backend: str
    """Collective backend, device, dtype and engine, e.g. 'gloo, cpu, float32, eager'."""
    step_cache: str | None = None
    """The step cache the transformers run with (its label, e.g. 'fbcache:0.08'), or None."""
    replicas: int = 1
    """Groups of ranks, each running its own requests (app.groups)."""
    links: dict[int, Link] = field(default_factory=dict)
    """A group's leader other than rank 0: its channels with rank 0 (under its group's index)."""
    remote: list[RemoteGroup] = field(default_factory=list)
    """Rank 0: a handle on every group it does not lead."""

    @property
    def group_size(self) -> int:
        return self.world_size // self.replicas

    def group_label(self, replica: int) -> str:
        """E.g. "group 2 of 2 (ranks 2-3)"; "" with one group."""
        if self.replicas == 1:
            return ""
        first, last = replica * self.group_size, (replica + 1) * self.group_size - 1
        return f"group {replica + 1} of {self.replicas} ({f'rank {first}' if first == last else f'ranks {first}-{last}'})"

    def follow(self) -> None:
        """Every rank but 0: take part in the requests until the run ends (a group's leader runs the ones rank 0
        hands it; the others follow their leader)."""
        if self.service.ctx.is_main:
            from app.groups import lead

            lead(self.service, self.links[self.service.ctx.replica])
        else:
            self.service.follow()

    def describe(self, last_step_seconds: float | None = None, computed_steps: tuple[int, int] | None = None,
                 stages: StageSeconds | None = None) -> str:
        """Status line: models, ranks, plan, backend and (if known) the last request's stage times (encode,
        steps, decode, write; else its step time) and, with a step cache, how many of its steps were computed."""
        models = ", ".join(f"{m.spec.name} ({m.spec.media})" for m in self.models.values())
        step = "—/step" if last_step_seconds is None else f"{last_step_seconds * 1000:.0f} ms/step"
        if stages is not None:
            step = stages.describe()
        computed = "" if computed_steps is None else f", {computed_steps[0]} of {computed_steps[1]} steps computed"
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        if self.replicas > 1:
            ranks += f" in {self.replicas} groups of {self.group_size}"
        return (f"model {models} · {ranks} · "
                f"plan {self.plan} · backend {self.backend} · last request {step}{computed}")


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_threads_per_rank(local_world_size: int) -> int:
    """This machine's usable cores shared evenly between the ranks on it (at least one each)."""
    return max(1, usable_cores() // max(1, local_world_size))


@contextmanager
def start_runtime(models: list[tuple[ModelSpec, Path]], options: RunOptions, *, stop: threading.Event,
                  replicas: int = 1) -> Iterator[Runtime]:
    """Join the run (torchrun or single process) and serve `models`; leave it cleanly on exit.

    `replicas`: the ranks form that many equal groups, each with its own plan and lockstep service
    (app.groups); rank 0 leads the first.

    Enter it inside app.stopping.stop_on_signals, so that a Ctrl-C during the (long) imports and
    loads is honoured at the first agreement point instead of ending one rank alone.

    On rank 0, leaving the block releases the followers (their `follow()` returns). A RankLost
    leaves the process group as it is: it cannot be torn down while a collective with a dead peer
    is pending, and the process is about to end anyway.
    """
    import torch
    import transformers

    from engines.fp8 import quiet_torchao_import

    # transformers warns at import that its image processors lack torchvision (we use none of them),
    # and draws a progress bar per loaded component: noise next to our own progress bar. Loading the
    # pipelines imports diffusers' and transformers' quantizers, which import torchao, --fp8 or not.
    quiet_torchao_import()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    from app.groups import RemoteGroup, make_links
    from app.lockstep import LockstepService
    from engines.distributed import init_parallel, shutdown, split_replicas
    from pipelines.factory import default_dtype, load_pipeline
    from pipelines.prompt_cache import PromptCache

    world = init_parallel(options.device)
    ctx = world
    lost = False
    pipelines = {}
    try:
        if world.world_size % replicas:
            raise StartupError(f"--replicas {replicas}: {world.world_size} ranks cannot form {replicas} equal groups")
        ctx = split_replicas(world, replicas)
        links = make_links(replicas, ctx.world_size, world.rank)
        per_group = f" per group ({replicas} groups of {ctx.world_size})" if replicas > 1 else ""
        if ctx.world_size % options.tp:
            # Every rank sees the same world size: all of them stop here, before any collective.
            raise StartupError(f"--tp {options.tp} splits the weights over groups of {options.tp} ranks: the number "
                               f"of ranks{per_group} must be a multiple of it, this run has {ctx.world_size}")
        rest = ctx.world_size // options.tp
        if options.cfg_parallel and (rest < 2 or rest % 2):
            needs = "an even number of ranks" if options.tp == 1 else f"an even number of --tp {options.tp} groups"
            raise StartupError(f"--cfg-parallel runs the two guidance branches on two halves of the ranks: it needs "
                               f"{needs}{per_group}, this run has {rest}")
        if ctx.device.type == "cpu" and world.is_distributed:
            # torchrun sets OMP_NUM_THREADS=1 when it is unset; CPU ranks share the cores instead.
            torch.set_num_threads(cpu_threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))))
        dtype = default_dtype(ctx.device)
        # A checkpoint served under its image and its video name is loaded once, and split as a video model.
        keys = {spec.media: (spec.family, Path(folder).resolve()) for spec, folder in models}
        split_keys = {keys[spec.media] for spec, _ in models
                      if ctx.is_distributed and options.splits_vae(spec.media)}
        failure = None
        try:
            loaded = {}
            for spec, folder in models:
                key = keys[spec.media]
                if key not in loaded:
                    # tp is the mesh's innermost axis (engines.plan): this rank's share is its rank modulo tp
                    loaded[key] = load_pipeline(spec, folder, device=ctx.device, dtype=dtype,
                                                with_encoders=ctx.is_main, with_vae=ctx.is_main or key in split_keys,
                                                tp=options.tp, tp_rank=ctx.rank % options.tp)
                pipelines[spec.media] = loaded[key]
        except Exception as error:  # noqa: BLE001 - reported by every rank together, below
            failure = f"rank {world.rank} could not load {spec.name} from {folder}: {describe(error)}"
        rank_processes = _agree_on_startup(world, failure)

        distinct = list({id(p): p for p in pipelines.values()}.values())
        split_media = sorted(media for media in pipelines if keys[media] in split_keys)
        split = [pipelines[media] for media in split_media]
        for pipeline in distinct:
            if pipeline in split:
                pipeline.use_split_vae(ctx.group)
            if ctx.is_main:
                pipeline.use_prompt_cache(PromptCache())
        if options.fp8:
            quantize_transformers(distinct, ctx.group)
        plan_label = "none (1 rank)"
        if ctx.is_distributed:
            plan_label = parallelize_pipelines(distinct, ctx, options)
        else:
            wrap_one_rank(distinct, ctx)
        engine_label = build_engines(distinct, ctx, options)
        if options.cache is not None:
            install_step_caches(distinct, ctx, options)
            engine_label += f", cache {options.step_cache.label}"
        backend = f"{'nccl' if ctx.device.type == 'cuda' else 'gloo'}, " if world.is_distributed else ""
        precision = str(dtype).removeprefix("torch.") + (" + fp8" if options.fp8 else "")
        backend += f"{ctx.device.type}, {precision}, {engine_label}" + (
            f", split VAE ({', '.join(split_media)})" if split_media else "")

        service = LockstepService(ctx, pipelines, stop=stop, rank_timeout=options.rank_timeout,
                                  rank_processes=rank_processes)
        if isinstance(stop, StopRequest):  # a SIGTERM that finds this rank stuck ends it naming the lost rank
            stop.abandon = service.lost_message
        served = {spec.media: ServedModel(spec=spec, folder=folder,
                                          limits=read_limits(spec, folder, cfg_parallel=options.cfg_parallel))
                  for spec, folder in models}
        runtime = Runtime(service=service, models=served, world_size=world.world_size, is_main=world.is_main,
                          plan=plan_label, backend=backend,
                          step_cache=options.step_cache.label if options.cache is not None else None,
                          replicas=replicas, links={} if world.is_main else links)
        if world.is_main:
            runtime.remote.extend(RemoteGroup(link, leader=replica * ctx.world_size,
                                              label=runtime.group_label(replica))
                                  for replica, link in sorted(links.items()))
        try:
            yield runtime
        except RankLost:
            lost = True
            raise
        finally:
            if ctx.is_main and not lost:
                service.stop()
                for group in runtime.remote:
                    group.release()
    except RankLost:
        lost = True
        raise
    finally:
        if not lost:
            release_engines({id(p): p for p in pipelines.values()}.values())
            shutdown(world)


def quantize_transformers(pipelines: Iterable, group=None) -> None:
    """--fp8: each transformer's block linears as FP8 GEMMs (engines/fp8.py), on every rank alike (the same
    weights give the same FP8 weights), before the adapters and engines wrap them; collective over `group`
    (the ranks' tensor group) for transformers loaded split by --tp."""
    from engines.fp8 import quantize_fp8

    for pipeline in pipelines:
        quantize_fp8(pipeline.transformer, family_of(pipeline.spec).repeated_blocks, group=group)


def parallelize_pipelines(pipelines: Iterable, ctx, options: RunOptions) -> str:
    """Swap each pipeline's transformer for its family's context-parallel wrapper (collective);
    returns the plans' description for the status line.

    With options.cfg_parallel, guidance-batched models (their family's record says which) run their
    two guidance branches on two halves of the ranks.
    """
    from engines.parallelize import parallelize_transformer
    from engines.plan import ParallelPlan
    from pipelines.family import load

    labels = []
    for pipeline in pipelines:
        family = family_of(pipeline.spec)
        cfg = 2 if options.cfg_parallel and uses_guidance_batch(pipeline.spec) else 1
        heads = pipeline.transformer_config.num_attention_heads
        plan = ParallelPlan.auto(ctx.world_size, heads, strategy=options.strategy, cfg=cfg, tp=options.tp)
        pipeline.use_transformer(parallelize_transformer(pipeline.transformer, ctx, plan, load(family.parallelize),
                                                         all_to_all=options.all_to_all))
        # On CPU ranks every exchange is gloo's, whatever --all-to-all names for GPUs.
        labels.append(plan.describe(options.all_to_all if ctx.device.type == "cuda" else "gloo"))
    return " / ".join(dict.fromkeys(labels))


def wrap_one_rank(pipelines: Iterable, ctx) -> None:
    """A one-rank run: the transformers of families whose record asks for it (adapter_at_one_rank) go
    through their adapter on a mesh of this one rank (nothing is split)."""
    from engines.parallelize import parallelize_transformer
    from engines.plan import ParallelPlan
    from pipelines.family import load

    for pipeline in pipelines:
        family = family_of(pipeline.spec)
        if family.adapter_at_one_rank:
            pipeline.use_transformer(parallelize_transformer(pipeline.transformer, ctx, ParallelPlan(),
                                                             load(family.parallelize)))


def build_engines(pipelines: Iterable, ctx, options: RunOptions) -> str:
    """Turn each pipeline's (parallel) transformer into an engine of options' backend; returns its label.

    Compilation itself happens at the first call of each input shape, from the engine cache when
    `ulysses-studio build` (or an earlier request) left artifacts for it there.
    """
    from engines.compile import prepare_engine

    engine = options.engine(ctx.device.type)
    if engine.backend == "eager" and not engine.cuda_graph:
        return engine.label
    for pipeline in pipelines:
        repeated_blocks = family_of(pipeline.spec).repeated_blocks
        pipeline.use_transformer(prepare_engine(pipeline.transformer, engine, repeated_blocks=repeated_blocks,
                                                cache_dir=options.cache_dir, rank=ctx.rank))
    return engine.label


def install_step_caches(pipelines: Iterable, ctx, options: RunOptions) -> None:
    """--cache: a step cache on each pipeline's transformer, deciding over its group's ranks (engines/step_cache.py)."""
    for pipeline in pipelines:
        pipeline.use_step_cache(options.step_cache, ctx.group if ctx.is_distributed else None)


def release_engines(pipelines: Iterable) -> None:
    """Drop the engines' CUDA graphs before the process group is destroyed (engines.distributed.shutdown).

    A CUDA graph that captured NCCL kernels (the engines' collectives) must go before its
    communicator: on 2x H200 the ranks of a `+cudagraph` backend otherwise hung in
    destroy_process_group() after their last result was written, and 100 s after SIGKILL they
    still held their GPU memory.
    """
    from engines.compile import Engine

    for pipeline in pipelines:
        if pipeline.step_cache is not None:  # its wrappers hold the compiled blocks: out first
            pipeline.step_cache.remove()
        if isinstance(pipeline.transformer, Engine):
            pipeline.transformer.release()


def _agree_on_startup(ctx, failure: str | None) -> dict[int, tuple[str, int]]:
    """Raise StartupError on every rank if any rank failed to load (no time limit: loads differ in length);
    returns rank -> (host name, pid) of every rank, for naming a rank that dies later."""
    import socket

    here = (socket.gethostname(), os.getpid())
    if not ctx.is_distributed:
        if failure:
            raise StartupError(failure)
        return {ctx.rank: here}
    import torch.distributed as dist

    reports: list[tuple[str | None, tuple[str, int]] | None] = [None] * ctx.world_size
    dist.all_gather_object(reports, (failure, here), group=ctx.control_group)
    failures = [failed for failed, _ in reports if failed]
    if failures:
        raise StartupError("; ".join(failures))
    return {rank: process for rank, (_, process) in enumerate(reports)}
