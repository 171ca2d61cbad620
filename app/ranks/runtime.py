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
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.failures import RankLost, StartupError, describe
from app.ranks.stopping import StopRequest
from app.stage_times import StageSeconds
from engines.options import RunOptions
from pipelines.registry import ModelSpec, family_of
from pipelines.requests import MediaLimits, read_limits, uses_guidance_batch

if TYPE_CHECKING:  # the module stays light to import: torch comes in with start_runtime
    from app.ranks.groups import Layout
    from app.ranks.lockstep import LockstepService


@dataclass(frozen=True, kw_only=True)
class ServedModel:
    """A model this run serves, under its service key (its media: "image" or "video")."""

    spec: ModelSpec
    folder: Path
    limits: MediaLimits

    @property
    def key(self) -> str:
        return self.spec.media


def process_seconds() -> float:
    """Seconds since this process started (Linux: its start time in /proc; elsewhere since this module's import)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


@dataclass(frozen=True, kw_only=True)
class StartupSeconds:
    """Where a rank's start went, in wall seconds: the first thing to look at when the first image is slow."""

    imports: float
    """From the process's start to torch and the app's own modules imported."""
    join: float
    """Joining the run: the rendezvous and the process groups."""
    code: float
    """Importing the served families' pipeline modules: diffusers' and transformers' code (which brings
    torch._dynamo, and with transformers whatever it finds installed), before any weight is read."""
    load: float
    """Loading the weights (every rank its share, the components' own modules imported as they come) and agreeing
    that every rank loaded."""
    prepare: float
    """FP8, LoRA, the parallel plans, the engines' wrappers and the step cache (compiling happens at the first call
    of each shape: a request's first step)."""

    def describe(self) -> str:
        """E.g. 'ready in 6.1 s: imports 1.2 s · joining 0.4 s · models' code 2.0 s · weights 2.1 s · engines 0.4 s'."""
        total = self.imports + self.join + self.code + self.load + self.prepare
        return (f"ready in {total:.1f} s: imports {self.imports:.1f} s · joining {self.join:.1f} s · "
                f"models' code {self.code:.1f} s · weights {self.load:.1f} s · engines {self.prepare:.1f} s")


@dataclass(kw_only=True)
class Runtime:
    """What a command needs once its rank has started."""

    layouts: list[Layout]
    """How the ranks may form groups (app.ranks.groups.Layout): one layout, or with `--replicas auto` one per group
    size, every rank as one group first."""
    models: dict[str, ServedModel]
    """Service key -> model."""
    world_size: int
    is_main: bool
    """Rank 0: the rank that talks to the user."""
    backend: str
    """Collective backend, device, dtype and engine, e.g. 'gloo, cpu, float32, eager'."""
    step_cache: str | None = None
    """The step cache the transformers run with (its label, e.g. 'fbcache:0.08'), or None."""
    attention_precision: str = "full"
    """The attention precision the transformers run with (--attention-precision; a request may ask for full)."""
    startup: StartupSeconds | None = None
    """Where this rank's start went."""
    active: int = 0
    """Rank 0: the layout the ranks are in now (regroup moves them)."""

    @property
    def service(self) -> LockstepService:
        """This rank's group's lockstep service in the first layout (every rank as one group where the run regroups),
        for commands that run requests one at a time (generate, build, the calibration)."""
        return self.layouts[0].service

    @property
    def plan(self) -> str:
        """How the first layout's groups split each transformer, e.g. 'allgather-2, all-to-all copy-engine' or
        'none (1 rank)'."""
        return self.layouts[0].plan

    @property
    def replicas(self) -> int:
        return self.layouts[0].replicas

    @property
    def group_size(self) -> int:
        return self.layouts[0].group_size

    @property
    def regroups(self) -> bool:
        """Whether rank 0 moves the ranks between layouts as its queue grows and drains (`--replicas auto`)."""
        return len(self.layouts) > 1

    def regroup(self, index: int) -> None:
        """Rank 0: move every rank to layout `index`. The groups of the layout they are in must be idle: each is
        handed over (its leader answers once its group has left it) and every rank meets on the first layout's
        service, which is the target itself or tells them which layout to form. Raises RankLost if a group's
        leader does not answer."""
        from app.ranks.lockstep import HandOver, Regroup

        if index == self.active:
            return
        current = self.layouts[self.active]
        if self.active != 0:
            for group in current.remote:
                group.hand_over()
            current.service.hand_over(HandOver())
        self.active = index
        if index != 0:
            target = self.layouts[index]
            self.layouts[0].service.hand_over(Regroup(index))
            for group in target.remote:
                group.listen()

    def release(self) -> None:
        """Rank 0, at the end: release every rank from the layout they are in (each leaves the run)."""
        layout = self.layouts[self.active]
        layout.service.stop()
        for group in layout.remote:
            group.release()

    def follow(self) -> None:
        """Every rank but 0: take part in the requests until the run ends (a group's leader runs the ones rank 0
        hands it; the others follow their leader), in whichever layout rank 0 forms."""
        from app.ranks.lockstep import Regroup, Stop

        if not self.regroups:
            self._follow(self.layouts[0])
            return
        while True:
            message = self.layouts[0].service.follow()
            if isinstance(message, Stop):
                return
            if isinstance(message, Regroup) and isinstance(self._follow(self.layouts[message.layout]), Stop):
                return

    @staticmethod
    def _follow(layout: Layout) -> Any:
        """Follow in `layout` until rank 0 ends it: its Stop (the run is over) or HandOver (regroup)."""
        from app.ranks.groups import lead
        from app.ranks.lockstep import HandOver, Stop

        service = layout.service
        if not service.ctx.is_main:
            return service.follow()
        message = lead(service, layout.links[service.ctx.replica])
        if isinstance(message, Stop):
            service.stop()
        else:
            service.hand_over(HandOver())
        return message

    def describe(self, last_step_seconds: float | None = None, computed_steps: tuple[int, int] | None = None,
                 stages: StageSeconds | None = None) -> str:
        """Status line: in plain words the models, what runs them and the last client request's stage times
        (encode, steps, decode, write; else its step time; none yet: says so) with, under a step cache, how many of
        its steps were computed; then the technical details (describe_details)."""
        return f"{self.describe_plainly(last_step_seconds, computed_steps, stages)} · {self.describe_details()}"

    def describe_plainly(self, last_step_seconds: float | None = None,
                         computed_steps: tuple[int, int] | None = None, stages: StageSeconds | None = None) -> str:
        """E.g. "tiny-flux (image) on 2 CPU processes, each with half of every image, full precision (float32) ·
        no request yet"."""
        from app.server import status_words

        models = ", ".join(f"{m.spec.name} ({m.spec.media})" for m in self.models.values())
        device = self.service.ctx.device
        name = None
        if device.type == "cuda":
            import torch

            name = torch.cuda.get_device_name(device)
        media = " or ".join(dict.fromkeys(m.spec.media for m in self.models.values())) or "image"
        shared = status_words.sharing(self.plan, media)
        detail = f" ({shared})" if shared else ""
        if self.regroups:
            shared = f"as one group for a lone request{detail}, as smaller groups side by side while requests wait"
        elif self.replicas > 1:
            shared = f"in {self.replicas} groups of {self.group_size}, each running its own request{detail}"
        what = ", ".join(part for part in (status_words.processes(self.world_size, device.type, name), shared,
                                            status_words.precision(self.backend)) if part)
        if last_step_seconds is None and stages is None:
            last = "no request yet"
        else:
            times = stages.describe() if stages is not None else f"{last_step_seconds * 1000:.0f} ms/step"
            last = f"last request: {times}"
            if computed_steps is not None:
                last += f", {computed_steps[0]} of {computed_steps[1]} steps computed"
        return f"{models} on {what} · {last}"

    def describe_details(self) -> str:
        """The technical part: ranks, groups, plan and backend, e.g. "2 ranks · plan ulysses-2, all-to-all gloo ·
        backend gloo, cpu, float32, eager"."""
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        if self.regroups:
            ranks += " as one group, or smaller groups while requests wait"
            plan = "; ".join(layout.describe() for layout in self.layouts)
        else:
            plan = self.plan
            if self.replicas > 1:
                ranks += f" in {self.replicas} groups of {self.group_size}"
        return f"{ranks} · plan {plan} · backend {self.backend}"

def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_threads_per_rank(local_world_size: int) -> int:
    """This machine's usable cores shared evenly between the ranks on it (at least one each)."""
    return max(1, usable_cores() // max(1, local_world_size))


AUTO = "auto"
"""`--replicas auto`: the ranks as one group while requests come one at a time, as smaller groups while they wait."""


def layout_sizes(world_size: int, replicas: int | str | None, options: RunOptions, device_type: str,
                 hosts: int = 1) -> list[int]:
    """The numbers of groups the run's layouts have: [replicas]; with "auto" every number of equal groups whose size
    the plan allows (a multiple of --tp, of twice it with --cfg-parallel), one group first. None: auto on the GPUs of
    one host, one group per host on several, else one group. A fixed number the ranks cannot form is the caller's to
    refuse."""
    if replicas is None:
        replicas = hosts if hosts > 1 else AUTO if device_type == "cuda" and world_size > 1 else 1
    if replicas != AUTO:
        return [int(replicas)]
    unit = options.tp * (2 if options.cfg_parallel else 1)
    return [count for count in range(1, world_size + 1)
            if world_size % count == 0 and (world_size // count) % unit == 0] or [1]


@contextmanager
def start_runtime(models: list[tuple[ModelSpec, Path]], options: RunOptions, *, stop: threading.Event,
                  replicas: int | str | None = 1) -> Iterator[Runtime]:
    """Join the run (torchrun or single process) and serve `models`; leave it cleanly on exit.

    `replicas`: the ranks form that many equal groups, each with its own plan and lockstep service
    (app.ranks.groups); rank 0 leads the first. "auto" (and None on GPUs): a layout for each group size the plan
    allows (layout_sizes), between which rank 0 moves the ranks as its queue grows and drains (Runtime.regroup):
    every layout holds its own plan's transformer, over the same weights
    (engines.parallel.parallelize.shared_weights_copy), and its own engines.

    Enter it inside app.ranks.stopping.stop_on_signals, so that a Ctrl-C during the (long) imports and
    loads is honoured at the first agreement point instead of ending one rank alone.

    On rank 0, leaving the block releases the followers (their `follow()` returns). A RankLost
    leaves the process group as it is: it cannot be torn down while a collective with a dead peer
    is pending, and the process is about to end anyway.
    """
    import torch
    import transformers

    from engines.levers.fp8 import quiet_torchao_import

    # transformers warns at import that its image processors lack torchvision (we use none of them),
    # and draws a progress bar per loaded component: noise next to our own progress bar. Loading the
    # pipelines imports diffusers' and transformers' quantizers, which import torchao, --fp8 or not.
    quiet_torchao_import()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    from app.ranks.groups import Layout, RemoteGroup, make_links
    from app.ranks.lockstep import LockstepService
    from engines.parallel.distributed import init_parallel, shutdown, split_replicas
    from pipelines.factory import default_dtype, import_pipeline_code, load_pipeline
    from pipelines.prompt_cache import PromptCache

    imported = process_seconds()
    world = init_parallel(options.device)
    joined = process_seconds()
    lost = False
    pipelines: dict[str, Any] = {}
    runtime: Runtime | None = None
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))
        hosts = world.world_size // local_ranks
        counts = layout_sizes(world.world_size, replicas, options, world.device.type, max(hosts, 1))
        if world.world_size % counts[0]:
            raise StartupError(f"--replicas {counts[0]}: {world.world_size} ranks cannot form {counts[0]} equal groups")
        contexts = [split_replicas(world, count) for count in counts]
        links = [make_links(count, world.world_size // count, world.rank) for count in counts]
        for ctx in contexts:
            per_group = f" per group ({ctx.replicas} groups of {ctx.world_size})" if ctx.replicas > 1 else ""
            if ctx.world_size % options.tp:
                # Every rank sees the same world size: all of them stop here, before any collective.
                raise StartupError(f"--tp {options.tp} splits the weights over groups of {options.tp} ranks: the "
                                   f"number of ranks{per_group} must be a multiple of it, this run has "
                                   f"{ctx.world_size}")
            rest = ctx.world_size // options.tp
            if options.cfg_parallel and (rest < 2 or rest % 2):
                needs = "an even number of ranks" if options.tp == 1 else f"an even number of --tp {options.tp} groups"
                raise StartupError(f"--cfg-parallel runs the two guidance branches on two halves of the ranks: it "
                                   f"needs {needs}{per_group}, this run has {rest}")
        if world.device.type == "cpu" and world.is_distributed:
            # torchrun sets OMP_NUM_THREADS=1 when it is unset; CPU ranks share the cores instead.
            torch.set_num_threads(cpu_threads_per_rank(local_ranks))
        dtype = default_dtype(world.device)
        leads = any(ctx.is_main for ctx in contexts)
        """Whether this rank leads a group in some layout: it then encodes prompts and decodes results."""
        # A checkpoint served under its image and its video name is loaded once, and split as a video model.
        keys = {spec.media: (spec.family, Path(folder).resolve()) for spec, folder in models}
        split_keys = {keys[spec.media] for spec, _ in models
                      if any(ctx.is_distributed for ctx in contexts) and options.splits_vae(spec.media)}
        failure = None
        coded = joined
        try:
            for spec, _ in models:
                import_pipeline_code(spec)
            coded = process_seconds()
            loaded = {}
            for spec, folder in models:
                key = keys[spec.media]
                if key not in loaded:
                    # tp is the mesh's innermost axis (engines.parallel.plan): this rank's share is its rank modulo tp
                    loaded[key] = load_pipeline(spec, folder, device=world.device, dtype=dtype,
                                                with_encoders=leads, with_vae=leads or key in split_keys,
                                                tp=options.tp, tp_rank=world.rank % options.tp)
                pipelines[spec.media] = loaded[key]
        except Exception as error:  # reported by every rank together, below
            failure = f"rank {world.rank} could not load {spec.name} from {folder}: {describe(error)}"
        rank_processes = _agree_on_startup(world, failure)
        loaded_at = process_seconds()

        distinct = list({id(p): p for p in pipelines.values()}.values())
        split_media = sorted(media for media in pipelines if keys[media] in split_keys)
        for pipeline in distinct if leads else ():
            pipeline.use_prompt_cache(PromptCache())
        if options.fp8:
            quantize_transformers(distinct, world.group)
        for pipeline in distinct if options.loras else ():  # --lora: after tp and FP8, before plans copy them
            # each model the files that fit it (the check step refused any that fits none of the served models)
            pipeline.use_loras(options.loras, tp=options.tp, tp_rank=world.rank % options.tp, fitting=True)
        # Each layout gets its own pipelines (sharing their components and weights), made before any plan changes
        # the transformers.
        per_layout = [pipelines] + [copy_pipelines(pipelines) for _ in contexts[1:]]
        layouts = []
        for ctx, count, layout_links, served_pipelines in zip(contexts, counts, links, per_layout, strict=True):
            pipes = list({id(p): p for p in served_pipelines.values()}.values())
            for pipeline in pipes:
                if keys[pipeline.spec.media] in split_keys and ctx.is_distributed:
                    pipeline.use_split_vae(ctx.group)
            plan_label = parallelize_pipelines(pipes, ctx, options) if ctx.is_distributed else wrap_one_rank(pipes, ctx)
            engine_label = build_engines(pipes, ctx, options)
            for pipeline in pipes:
                pipeline.attention_precision = options.attention_precision
            if options.cache is not None:
                install_step_caches(pipes, ctx, options)
            service = LockstepService(ctx, served_pipelines, stop=stop, rank_timeout=options.rank_timeout,
                                      rank_processes=rank_processes)
            layouts.append(Layout(replicas=count, world_size=world.world_size, service=service, plan=plan_label,
                                  links=layout_links, named=len(counts) > 1))
        if options.cache is not None:
            engine_label += f", cache {options.step_cache.label}"
        backend = f"{'nccl' if world.device.type == 'cuda' else 'gloo'}, " if world.is_distributed else ""
        precision = str(dtype).removeprefix("torch.") + (" + fp8" if options.fp8 else "") + (
            f" + {options.attention_precision} attention" if options.attention_precision != "full" else "")
        backend += f"{world.device.type}, {precision}, {engine_label}" + (
            f", split VAE ({', '.join(split_media)})" if split_media else "")

        if isinstance(stop, StopRequest):  # a SIGTERM that finds this rank stuck ends it naming the lost rank
            stop.abandon = layouts[0].service.lost_message
        served = {spec.media: ServedModel(spec=spec, folder=folder,
                                          limits=replace(read_limits(spec, folder, cfg_parallel=options.cfg_parallel),
                                                         loras=_lora_defaults(pipelines[spec.media], options)))
                  for spec, folder in models}
        if world.is_main:
            for index, layout in enumerate(layouts):
                layout.remote.extend(RemoteGroup(link, leader=replica * layout.group_size,
                                                 label=layout.label(replica), listen=index == 0)
                                     for replica, link in sorted(layout.links.items()))
        ready = process_seconds()
        runtime = Runtime(layouts=layouts, models=served, world_size=world.world_size, is_main=world.is_main,
                          backend=backend, step_cache=options.step_cache.label if options.cache is not None else None,
                          attention_precision=options.attention_precision,
                          startup=StartupSeconds(imports=imported, join=joined - imported, code=coded - joined,
                                                 load=loaded_at - coded,
                                                 prepare=ready - loaded_at))
        try:
            yield runtime
        except RankLost:
            lost = True
            raise
        finally:
            if world.is_main and not lost:
                runtime.release()
    except RankLost:
        lost = True
        raise
    finally:
        if not lost:
            all_pipelines = [pipelines] + ([] if runtime is None else
                                           [layout.service.pipelines for layout in runtime.layouts[1:]])
            release_engines({id(p): p for served in all_pipelines for p in served.values()}.values())
            shutdown(world)


def copy_pipelines(pipelines: dict[str, Any]) -> dict[str, Any]:
    """The same pipelines for another layout: their components shared, each transformer a module tree of its own over
    the same weights (engines.parallel.parallelize.shared_weights_copy), for that layout's plan to change."""
    import copy

    from engines.parallel.parallelize import shared_weights_copy

    copies: dict[int, Any] = {}
    for pipeline in pipelines.values():
        if id(pipeline) not in copies:
            twin = copy.copy(pipeline)
            for name, module in pipeline.transformers():
                twin.use_transformer(shared_weights_copy(module), name)
            copies[id(pipeline)] = twin
    return {media: copies[id(pipeline)] for media, pipeline in pipelines.items()}


def quantize_transformers(pipelines: Iterable, group=None) -> None:
    """--fp8: each transformer's block linears as FP8 GEMMs (engines/levers/fp8.py), on every rank alike (the same
    weights give the same FP8 weights), before the adapters and engines wrap them; collective over `group`
    (the ranks' tensor group) for transformers loaded split by --tp."""
    from engines.levers.fp8 import quantize_fp8

    for pipeline in pipelines:
        for _, module in pipeline.transformers():
            quantize_fp8(module, family_of(pipeline.spec).compiled_blocks, group=group)


def parallelize_pipelines(pipelines: Iterable, ctx, options: RunOptions) -> str:
    """Swap each pipeline's transformers for its family's context-parallel wrapper (collective);
    returns the plans' description for the status line.

    With options.cfg_parallel, guidance-batched models (their family's record says which) run their
    two guidance branches on two halves of the ranks.
    """
    from engines.parallel.parallelize import parallelize_transformer
    from engines.parallel.plan import ParallelPlan
    from pipelines.family import load

    labels = []
    for pipeline in pipelines:
        family = family_of(pipeline.spec)
        cfg = 2 if options.cfg_parallel and uses_guidance_batch(pipeline.spec) else 1
        heads = pipeline.transformer_config.num_attention_heads
        plan = ParallelPlan.auto(ctx.world_size, heads, strategy=options.strategy, cfg=cfg, tp=options.tp)
        for name, module in pipeline.transformers():
            pipeline.use_transformer(parallelize_transformer(module, ctx, plan, load(family.parallelize),
                                                             all_to_all=options.all_to_all), name)
        # On CPU ranks every exchange is gloo's, whatever --all-to-all names for GPUs.
        labels.append(plan.describe(options.all_to_all if ctx.device.type == "cuda" else "gloo"))
    return " / ".join(dict.fromkeys(labels))


def wrap_one_rank(pipelines: Iterable, ctx) -> str:
    """A one-rank run: the transformers of families whose record asks for it (adapter_at_one_rank) go
    through their adapter on a mesh of this one rank (nothing is split); returns the plan's description,
    'none (1 rank)'."""
    from engines.parallel.parallelize import parallelize_transformer
    from engines.parallel.plan import ParallelPlan
    from pipelines.family import load

    for pipeline in pipelines:
        family = family_of(pipeline.spec)
        for name, module in pipeline.transformers() if family.adapter_at_one_rank else ():
            pipeline.use_transformer(parallelize_transformer(module, ctx, ParallelPlan(), load(family.parallelize)),
                                     name)
    return "none (1 rank)"


def build_engines(pipelines: Iterable, ctx, options: RunOptions) -> str:
    """Turn each pipeline's (parallel) transformer into an engine of options' backend; returns its label.

    Compilation itself happens at the first call of each input shape, from the engine cache when
    `ulysses-studio build` (or an earlier request) left artifacts for it there.
    """
    from engines.levers.compile import prepare_engine

    engine = options.engine(ctx.device.type)
    if engine.backend == "eager" and not engine.cuda_graph:
        return engine.label
    for pipeline in pipelines:
        repeated_blocks = family_of(pipeline.spec).compiled_blocks
        for name, module in pipeline.transformers():
            pipeline.use_transformer(prepare_engine(module, engine, repeated_blocks=repeated_blocks,
                                                    cache_dir=options.cache_dir, rank=ctx.rank), name)
    return engine.label


def install_step_caches(pipelines: Iterable, ctx, options: RunOptions) -> None:
    """--cache: a step cache on each pipeline's transformer, deciding over its group's ranks
    (engines/levers/step_cache.py)."""
    for pipeline in pipelines:
        pipeline.use_step_cache(options.step_cache, ctx.group if ctx.is_distributed else None)


def release_engines(pipelines: Iterable) -> None:
    """Drop the engines' CUDA graphs before the process group is destroyed (engines.parallel.distributed.shutdown).

    A CUDA graph that captured NCCL kernels (the engines' collectives) must go before its
    communicator: on 2x H200 the ranks of a `+cudagraph` backend otherwise hung in
    destroy_process_group() after their last result was written, and 100 s after SIGKILL they
    still held their GPU memory.
    """
    from engines.levers.compile import Engine

    for pipeline in pipelines:
        pipeline.remove_step_caches()  # its wrappers hold the compiled blocks: out first
        for _, module in pipeline.transformers():
            if isinstance(module, Engine):
                module.release()


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


def _lora_defaults(pipeline: Any, options: RunOptions) -> tuple[tuple[str, float], ...]:
    """(name, scale) of the --lora files `pipeline`'s transformer carries (MediaLimits.loras)."""
    names = pipeline.loras[0].names if getattr(pipeline, "loras", None) else ()
    return tuple((name, scale) for name, scale in options.lora_defaults if name in names)
