"""Benchmark: one transformer forward; 1 GPU, ours per plan (+CFG), diffusers-native Ulysses and peers (FLUX).

One launch measures every mode: the 1-GPU baseline runs on rank 0 alone while the other ranks
wait at a barrier, then all ranks run each parallel mode, then diffusers' own context
parallelism (then undone: the rows after it run rank 0's model alone for their error figures), then the peers asked
for with --peers (xDiT, cache-dit: benchmarks/peers.py), each eager and compiled as it advises.

    torchrun --nproc-per-node 2 -m benchmarks.step --model flux-dev --out flux.json
    torchrun --nproc-per-node 2 -m benchmarks.step --model cosmos-predict2-2b-video2world --out cosmos.json
    torchrun --nproc-per-node 2 -m benchmarks.step --all-to-all nccl,copy-engine --out transports.json
    torchrun --nproc-per-node 2 -m benchmarks.step --strategies "" --no-diffusers --peers xdit --out xdit.json
    torchrun --nproc-per-node 2 -m benchmarks.step --model flux2-dev --strategies ulysses --no-cfg --tp 2 --out tp.json
    torchrun --nproc-per-node 2 -m benchmarks.step --model cosmos3-super --video 189x720x1280 --text-tokens 300 \\
        --no-cfg --tp 2 --tp-only --fp8 parallel --backends inductor-blocks --warmup 1 --iters 2 --out super.json
    torchrun --nproc-per-node 2 -m benchmarks.step --fp8 parallel --cached-step --backends inductor-blocks --out x.json
    python -m benchmarks.step --model flux-dev                    # 1 GPU only
    torchrun --nproc-per-node 1 -m benchmarks.step --strategies "" --peers xdit   # xDiT on 1 GPU
    torchrun --nproc-per-node 2 -m benchmarks.step --no-diffusers --lora-rank 64 --fp8 parallel --out lora.json
    torchrun --nproc-per-node 2 -m benchmarks.step --no-diffusers --attention-precision int8 --fp8 --out qattn.json
    torchrun --nproc-per-node 2 -m benchmarks.step --tiny         # CPU, gloo, tiny configs

Weights are random bf16 (no download); timings are of the forward only: CUDA events around
each call, warmup first (at least 3 calls for peers: CUDA graphs of mode="reduce-overhead" are
recorded at the second), median of the timed calls, the slowest rank's median. Parallel ranks
start each call together on the CPU and, on GPUs, on the devices (start_together). A peer that cannot
run gets rows whose "error" says why; its compiled rows carry a "note" with its exact recipe. The
1 GPU mode runs the model through its family's adapter on a mesh of one rank (no exchange). Rows
name their plan (with its K/V exchange) and transport.

--lora-rank R (measure_lora): after our rows (and after the FP8 ones), the same 1 GPU and plans with a random rank-R
LoRA: "unfused" as the app runs one (engines/weights/lora.py: a diffusers/PEFT file read, attached, selected at scale
1), with the seconds LoraSet.select takes to switch it on and off (switch_s, switch_off_s); then "fused", merged into
the weights (merge_lora_terms), with the seconds one merge and one unmerge of the whole transformer take (merge_s,
unmerge_s). Every row names its LoRA mode ("lora": none, unfused or fused) and rank.

--attention-precision int8|fp8 (measure_attention_precision): the same 1 GPU and plans with every attention quantized
(engines/levers/quantized_attention.py), after the bf16 rows and again after the FP8 ones; each row carries its output's
relative error against full precision on the same weights (rel_error_attention).

--tp N (measure_tp): after every other row, each block's weights split over N ranks, for the plans of N (the one
tp plan on N ranks), every backend; with --fp8, then the same rows with the split linears made FP8 in place, modes
"... fp8" (each rank quantizes its shards, a row-parallel one's scales taken over whole rows: engines/levers/fp8.py).
--tp-only: those rows alone, of a transformer built split (build_split, as engines/weights/sharded_loading.py loads
one): no rank ever holds the whole model, so a model too big for one GPU (Cosmos 3 Super, ~119 GiB in bf16) runs on the
ranks that hold its shares; the rows carry each rank's peak memory (peak_gib_per_rank).

Entry point: main() sets cuBLAS's variables (and with --cache-dir inductor's cache folder) as the app
does (engines.options.run_environment), before the first cuBLAS call and the first compile.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import diffusers
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.inputs import (
    BenchModel,
    bench_model,
    benchmarkable,
    build_random,
    fill_random_,
    model_shapes,
    parameters_on_meta,
)
from benchmarks.peers import (
    PEERS,
    Peer,
    compile_peer,
    compiler_settings_restored,
    import_peer,
    parallelize_peer,
    peer_mode,
    set_input_shape,
    unavailable_reason,
)
from engines.levers.compile import prepare_engine
from engines.levers.fp8 import is_fp8
from engines.options import (
    CUBLAS_WITHOUT_WORKSPACE,
    STRATEGIES,
    TRANSPORTS,
    EngineOptions,
    run_environment,
    set_environment,
)
from engines.parallel.distributed import ParallelContext, init_parallel, shutdown
from engines.parallel.parallelize import parallelize_transformer
from engines.parallel.plan import ParallelPlan
from engines.parallel.tensor_parallel import split_weights, take
from engines.weights.lora import (
    LoraDelta,
    LoraFile,
    LoraSet,
    attach_loras,
    check_lora_files,
    detach_loras,
    meta_transformer,
)
from pipelines.family import load
from pipelines.transformer_inputs import Shape
from pipelines.work import counting_on_meta

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense, per GPU
PEER_WARMUP = 3  # torch.compile(mode="reduce-overhead") records its CUDA graph at the 2nd call, replays from the 3rd
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "net.0.proj", "net.2", "proj_mlp", "proj_out")
"""The linears of a repeated block that the benchmark's LoRA targets, by how their names within the block end: every
attention's projections and every feed-forward's (those FLUX.1 LoRAs do; Wan's self- and cross-attention and ffn
alike), not the modulation's."""
SWITCHES = 5
"""LoraSet.select calls timed each way (the median is kept)."""


def weights_dtype(tiny: bool) -> torch.dtype:
    """The dtype of the benchmark's random weights and inputs: float32 for --tiny (CPU ranks), else bfloat16."""
    return torch.float32 if tiny else torch.bfloat16


def count_flops(spec: BenchModel, shape: Shape, batch: int) -> float | None:
    """FLOPs of one forward, counted on the meta device (no memory, no compute)."""
    try:
        with torch.device("meta"):
            model = torch.nn.Module.to(spec.model_class(**spec.config), torch.bfloat16)
        forward = single_process_forward(spec, model, torch.device("meta"))
        kwargs, _ = spec.inputs(shape, batch=batch, device=torch.device("meta"), dtype=torch.bfloat16)
        with FlopCounterMode(display=False) as counter, torch.no_grad(), counting_on_meta():
            forward(**kwargs)
        return float(counter.get_total_flops())
    except Exception as error:  # FLOPs only feed the MFU column; never lose the timings for them
        print(f"[benchmark] FLOP count failed for {spec.name} {shape.label}: {error!r}", file=sys.stderr)
        return None


def single_process_forward(spec: BenchModel, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The 1-GPU forward: the family's adapter on a mesh of one rank (the model's own submodules in
    its own order, no exchange), as the app runs one process."""
    local = ParallelContext(rank=0, world_size=1, local_rank=0, device=device, group=None, control_group=None)
    return parallelize_transformer(model, local, ParallelPlan(), load(spec.family.parallelize))


def undo_diffusers_parallelism(model: torch.nn.Module) -> None:
    """Take diffusers' context parallelism (enable_parallelism) off `model` again: its split and gather hooks
    (diffusers' own remove_context_parallel) and its attention processors' config. Left on, the next forward that
    rank 0 runs alone (the 1-GPU error figures of --attention-precision and --fp8) waits in an all-to-all that the
    other ranks never join."""
    from diffusers.hooks.context_parallel import remove_context_parallel

    if getattr(model, "_parallel_config", None) is None:
        return
    remove_context_parallel(model, model._cp_plan)
    for module in model.modules():
        if getattr(getattr(module, "processor", None), "_parallel_config", None) is not None:
            module.processor._parallel_config = None
    model._parallel_config = None


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (CUDA; nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_together(device: torch.device, group: dist.ProcessGroup | None,
                   device_group: dist.ProcessGroup | None) -> None:
    """Return when every rank of `group` is here with an idle device; with `device_group` (the
    ranks' NCCL group), when their GPUs are too.

    The CPU barrier alone releases the ranks up to a millisecond or more apart: in a profile of
    FLUX on 2 GPUs (2x H200, 2026-11-22) rank 1's first K/V exchange waited 1.3 ms
    for rank 0, and the slowest rank's time then counts that skew, which a generation loop does
    not pay at every step (its ranks stay in step; the host runs ahead). A one-element all-reduce
    on the GPUs, waited for by each host, releases the ranks together; the time measured is then
    one call's, launch included, as for 1 GPU.
    """
    sync(device)
    if group is not None:
        dist.barrier(group=group)
    if device_group is not None and device.type == "cuda":
        dist.all_reduce(torch.zeros(1, device=device), group=device_group)
        sync(device)


def time_forward(forward: Callable[..., Any], kwargs: dict[str, Any], *, device: torch.device,
                 group: dist.ProcessGroup | None, warmup: int, iters: int,
                 device_group: dist.ProcessGroup | None = None) -> tuple[float, float, float]:
    """Median milliseconds of `forward(**kwargs)`, peak GiB allocated, and the pipelined
    milliseconds per call, on this rank.

    Ranks of `group` start every call together (start_together), so the median is the latency of
    one call. The pipelined time is that of `iters` calls issued back to back (started together
    once), divided by `iters`: a generation loop's rate, where the host queues the next call while
    the GPUs run this one.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    with torch.no_grad():
        for i in range(warmup + iters):
            start_together(device, group, device_group)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                forward(**kwargs)
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                forward(**kwargs)
                elapsed = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                times.append(elapsed)
        start_together(device, group, device_group)
        t0 = time.perf_counter()
        for _ in range(iters):
            forward(**kwargs)
        sync(device)
        pipelined = (time.perf_counter() - t0) * 1e3 / iters
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return statistics.median(times), peak, pipelined


def profile_forward(forward: Callable[..., Any], kwargs: dict[str, Any], *, device: torch.device,
                    group: dist.ProcessGroup | None, path: Path,
                    device_group: dist.ProcessGroup | None = None) -> None:
    """Profile one call; write `path`.json (chrome trace) and `path`.txt (top ops by self time)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    start_together(device, group, device_group)
    with torch.profiler.profile(activities=activities) as prof, torch.no_grad():
        forward(**kwargs)
        sync(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(f"{path}.json")
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    Path(f"{path}.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=25))


def gather_objects(ctx: ParallelContext, value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank (over the control group; [value] in one process)."""
    if not ctx.is_distributed:
        return [value]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, value, group=ctx.control_group)
    return out


def mode_label(plan: ParallelPlan, transport: str) -> str:
    """Row name of our parallel mode, e.g. "ours ring-2", "ours allgather-2 copy-engine": the transport
    is named when it is not NCCL and the plan has exchanges for it to carry."""
    named = transport != "nccl" and plan.has_exchanges
    return f"ours {plan.label}" + (f" {transport}" if named else "")


def our_plans(ctx: ParallelContext, num_heads: int, strategies: list[str], cfg: bool, *, tp: int = 1
              ) -> list[ParallelPlan]:
    """Distinct plans to measure on ctx.world_size ranks (strategies that degenerate are skipped); with `tp`,
    the plans that split each block's weights over tp ranks (on as many ranks as tp, the one tp plan)."""
    n = ctx.world_size
    plans: list[ParallelPlan] = []
    if n == 1:
        return plans
    if tp == n:
        return [ParallelPlan(tp=tp)]
    for strategy in strategies:
        plan = ParallelPlan.auto(n, num_heads, strategy=strategy, tp=tp)
        if plan.strategy == strategy and plan not in plans:
            plans.append(plan)
    if cfg and (n // tp) % 2 == 0:
        plan = ParallelPlan.auto(n, num_heads, cfg=2, tp=tp)
        if plan not in plans:
            plans.append(plan)
    return plans


def run_model(spec: BenchModel, shapes: list[Shape], args: argparse.Namespace, ctx: ParallelContext,
              *, cfg: bool, rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Measure every mode x backend of one model on every shape; rows are complete on rank 0.

    `rows` (if given) receives each row as soon as it is measured (the caller may save partial
    results); the same list is returned.
    """
    device, dtype = ctx.device, weights_dtype(args.tiny)
    batch = args.batch or spec.family.bench.batch
    adapter = load(spec.family.parallelize)
    built = {s.label: spec.inputs(s, batch=batch, device=device, dtype=dtype) for s in shapes}
    inputs = {label: kwargs for label, (kwargs, _) in built.items()}
    tokens = {label: count for label, (_, count) in built.items()}
    flops = {s.label: count_flops(spec, s, batch) for s in shapes}
    rows = [] if rows is None else rows
    on_row = getattr(args, "on_row", None)
    references: dict[tuple[str, str], torch.Tensor] = {}
    """Rank 0's 1-GPU output of each (reference name, shape) that a row kept, which the parallel rows of that name
    are checked against: a plan that computes something else shows in its row, not only in its time."""

    def record(mode: str, shape: Shape, gpus: int, forward: Callable[..., Any] | None, group: Any,
               options: EngineOptions, error: str | None = None, *, backend: str | None = None,
               note: str | None = None, warmup: int | None = None, plan: ParallelPlan | None = None,
               transport: str | None = None, cached: bool = False, extra: dict[str, Any] | None = None,
               keep: str | None = None, check: str | None = None) -> None:
        """Time one row (`backend` names it when `forward` is compiled by someone else than `options`;
        `cached`: the step a step cache skips, CachedStep; `extra`: more fields of the row, e.g. its LoRA). `keep`: a
        1-GPU row keeps its output as that reference (its first backend's); `check`: the row's output is compared
        with that reference (vs_1_gpu: ||out - reference|| / ||reference||; the same on every rank: the extra call
        is collective)."""
        ms, peak, build_s, pipelined, vs_1_gpu = float("nan"), 0.0, None, float("nan"), None
        label = backend or options.label
        compiling = CompileSeconds()
        if forward is not None and error is None:
            engine = timed = None
            try:
                engine = prepare_engine(forward, options, repeated_blocks=spec.family.compiled_blocks,
                                        cache_dir=args.cache_dir, rank=ctx.rank if gpus > 1 else 0)
                parallel_group = dist.group.WORLD if gpus > 1 else None
                timed = CachedStep(engine, spec.family, group=parallel_group) if cached else engine
                device_group = ctx.group if group is not None else None
                ms, peak, pipelined = time_forward(timed, inputs[shape.label], device=device, group=group,
                                        warmup=args.warmup if warmup is None else warmup, iters=args.iters,
                                        device_group=device_group)
                build_s = next(iter(engine.builds.values())).seconds
                compiling.stop()
                if keep and (keep, shape.label) not in references:  # one more call: the reference, once
                    references[keep, shape.label] = first_output(timed, inputs[shape.label]).float()
                elif check:  # one more call (collective): the output the row's times are of
                    out = first_output(timed, inputs[shape.label]).float()
                    if (check, shape.label) in references:
                        reference = references[check, shape.label]
                        vs_1_gpu = float((out - reference).norm() / reference.norm())
                if args.profile:
                    # plain file names (labels hold "+", which some file transfers refuse)
                    slug = re.sub(r"[^A-Za-z0-9._-]", "_",
                                  "_".join(x.replace(" ", "-") for x in (spec.name, mode, label, shape.label)))
                    profile_forward(engine, inputs[shape.label], device=device, group=group,
                                    path=args.profile / f"{slug}.rank{ctx.rank}", device_group=device_group)
            except Exception as exc:  # keep the other modes' numbers; this row says what failed
                error = repr(exc)[:2000]
            finally:
                if isinstance(timed, CachedStep):
                    timed.cache.remove()
                if engine is not None:
                    engine.release()
                torch._dynamo.reset()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        results = gather_objects(ctx, (ms, peak, error, build_s, pipelined))
        ran = results[:gpus]  # the 1-GPU mode runs on rank 0 only
        errors = [r[2] for r in ran if r[2]]
        builds = [r[3] for r in ran if r[3] is not None]
        rows.append(dict(
            model=spec.name, mode=mode, backend=label, shape=shape.label, tokens=tokens[shape.label],
            plan=plan.label if plan is not None else None,
            all_to_all=transport if plan is not None and plan.has_exchanges else None,
            batch=batch, text_tokens=shape.text_tokens, gpus=gpus,
            ms=max(r[0] for r in ran), ms_per_rank=[r[0] for r in ran], pipelined_ms=max(r[4] for r in ran),
            peak_gib=max(r[1] for r in ran), peak_gib_per_rank=[r[1] for r in ran], flops=flops[shape.label],
            build_s=max(builds) if builds else None, error=errors[0] if errors else None, note=note,
            adapter=spec.family.parallelize.partition(":")[2] if plan is not None else None,
            graphs=compiling.graphs if ctx.is_main else None, build_phases=compiling.phases if ctx.is_main else None,
            vs_1_gpu=vs_1_gpu, **{"lora": "none", **(extra or {})},
        ))
        if ctx.is_main:
            print(f"[benchmark] {spec.name} {mode} [{label}] {shape.label}: {rows[-1]['ms']:.1f} ms"
                  f" (ranks {', '.join(f'{t:.1f}' for t in rows[-1]['ms_per_rank'])};"
                  f" back to back {rows[-1]['pipelined_ms']:.1f} ms/call)"
                  + (f" (build {rows[-1]['build_s']:.1f} s)" if rows[-1]["build_s"] else "")
                  + (f" (vs 1 GPU {vs_1_gpu:.2e})" if vs_1_gpu is not None else "")
                  + (f" ERROR {rows[-1]['error']}" if rows[-1]["error"] else ""), file=sys.stderr, flush=True)
            if on_row is not None:
                on_row(rows)

    backends = [EngineOptions.parse(b) for b in args.backends]
    if not args.tiny and device.type != "cuda":
        backends = [b for b in backends if not b.cuda_graph]
    bf16 = args.fp8 != "alone"  # '--fp8 alone': the FP8 rows and nothing before them
    heads = spec.config["num_attention_heads"]
    if args.tp_only:  # 6. alone, on a model built split: no rank holds the whole model
        measure_tp(spec, None, shapes, backends, ctx, record, tp=args.tp, strategies=args.strategies, fp8=args.fp8,
                   adapter=adapter, dtype=dtype)
        return rows
    model = build_random(spec, device=device, dtype=dtype)
    # 1. one GPU: rank 0 alone; the others wait at the gather in record()
    single_rows = not args.no_single  # the 1 GPU rows (of every step below)
    single = single_process_forward(spec, model, device) if ctx.is_main and bf16 and single_rows else None
    for options in backends if bf16 and single_rows else []:
        for shape in shapes:
            record("1 GPU", shape, 1, single, None, options, keep="bf16")
    # the same, on a step that a step cache skips (engines/levers/step_cache.py)
    if args.cached_step and bf16 and single_rows:
        for options in (b for b in backends if b.keeps_block_loop):
            for shape in shapes:
                record("1 GPU cached step", shape, 1, single, None, options, cached=True)
    if single is not None:
        single.restore()
    if args.diffusers_forward and bf16:  # the diffusers model itself, called as its pipeline calls it
        for shape in shapes:
            record("diffusers forward", shape, 1, model if ctx.is_main else None, None, EngineOptions())
    # 2. ours, each plan over all ranks, with each transport (plans that exchange: Ulysses, ring passes)
    modes = [(plan, transport) for plan in our_plans(ctx, heads, args.strategies, cfg)
             for transport in (args.all_to_all if plan.has_exchanges else ["nccl"])]
    for plan, transport in modes if bf16 else []:
        parallel = parallelize_transformer(model, ctx, plan, adapter, all_to_all=transport)
        mode = mode_label(plan, transport)
        for options in backends:
            for shape in shapes:
                record(mode, shape, ctx.world_size, parallel, ctx.control_group, options, plan=plan,
                       transport=transport, check="bf16")
        if args.cached_step:  # a skipped step's cost, its decision agreed over the ranks
            for options in (b for b in backends if b.keeps_block_loop):
                for shape in shapes:
                    record(f"{mode} cached step", shape, ctx.world_size, parallel, ctx.control_group, options,
                           plan=plan, transport=transport, cached=True)
        parallel.restore()
    # 2b. --lora-rank: the same 1 GPU and plans with a LoRA, unfused (the app's) and merged into the weights
    if args.lora_rank and bf16:
        measure_lora(spec, model, shapes, inputs, backends, ctx, record, rank=args.lora_rank, modes=modes,
                     adapter=adapter, single=single_rows)
    # 3. diffusers-native Ulysses (families whose record says it runs them; CUDA only: it divides by the
    # accelerator count; not with --tp, whose runs compare tp with our plans alone), taken off the model after its rows
    if (spec.family.bench.diffusers_parallel and ctx.is_distributed and device.type == "cuda" and not args.no_diffusers
            and args.tp == 1 and bf16):
        from diffusers import ContextParallelConfig

        setup_error = None
        try:
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ctx.world_size))
        except Exception as exc:  # same on every rank (before any collective): report it in the rows
            setup_error = repr(exc)
        for shape in shapes:
            # eager only: diffusers' own CLI skips torch.compile with context parallelism
            record(f"diffusers ulysses-{ctx.world_size}", shape, ctx.world_size, model, ctx.control_group,
                   EngineOptions(), error=setup_error)
        undo_diffusers_parallelism(model)
    # 4. peers (xDiT, cache-dit), last of all: they change process-wide state (compiler settings,
    # xDiT's process groups) and are the likeliest to fail.
    for name in args.peers if bf16 else []:
        measure_peer(PEERS[name], spec, model, shapes, ctx, record, warmup=max(args.warmup, PEER_WARMUP))
    # 4b. --attention-precision: the same weights with quantized attention (engines/levers/quantized_attention.py), 1
    # GPU and each plan of step 2, every backend; each row carries the relative error of its eager output (1 GPU)
    if args.attention_precision and bf16:
        measure_attention_precision(spec, model, shapes, inputs, backends, ctx, record, args.attention_precision,
                                    modes=modes, adapter=adapter, single=single_rows)
    # 5. --fp8: the same weights with the blocks' linears made FP8 in place (engines/levers/fp8.py), 1 GPU (unless
    # --fp8 parallel) and each plan of step 2, every backend; each row carries the relative error of the FP8
    # eager output against the bf16 eager one. With --attention-precision, then the same with quantized attention.
    if args.fp8:
        # the 1-GPU FP8 rows: with 'all', and with 'alone' on one rank (whose only FP8 rows they are)
        fp8_single = single_rows and (args.fp8 == "all" or (args.fp8 == "alone" and ctx.world_size == 1))
        measure_fp8(spec, model, shapes, inputs, backends, ctx, record, unfused=args.fp8_unfused,
                    single=fp8_single, modes=modes, adapter=adapter, linear=args.fp8_linear)
        if args.attention_precision:
            measure_attention_precision(spec, model, shapes, inputs, backends, ctx, record, args.attention_precision,
                                        modes=modes, adapter=adapter, single=fp8_single, suffix=" fp8")
        if args.lora_rank:  # the LoRA on the FP8 model, as the app attaches it (after quantizing)
            measure_lora(spec, model, shapes, inputs, backends, ctx, record, rank=args.lora_rank, modes=modes,
                         adapter=adapter, single=fp8_single, suffix=" fp8")
    # 6. --tp: each block's weights split over tp ranks, last of all (the split is made in place and not undone); with
    # --fp8 the whole model is FP8 by now (step 5) and a split model is quantized after its split: it is built split
    if args.tp > 1:
        if args.fp8:
            single = parallel = model = None  # every reference to the whole model, so that it is freed first
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        measure_tp(spec, model, shapes, backends, ctx, record, tp=args.tp, strategies=args.strategies, fp8=args.fp8,
                   adapter=adapter, dtype=dtype)
    del model
    # The model is also held in reference cycles (diffusers' parallelism hooks, compiled wrappers):
    # without a collection the next model's rows counted this one's weights in their peak memory
    # (Cosmos-2B after FLUX: 29-37 GiB per rank instead of 11-15).
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


class CompileSeconds:
    """Where a row's build went, from torch's own compile counters (torch._dynamo.utils.compilation_time_metrics and
    counters["stats"]["unique_graphs"]) between this object's making and stop(): `graphs`, how many graphs dynamo
    made (a block class is one unless something recompiles), and `phases`, the seconds of each compile phase that
    took at least `least` (phases nest: inductor's "compile_fx_inner" holds its "Scheduler.codegen", which holds
    "async_compile.wait", the wait for the kernels' compilers). Empty where nothing compiled (a cache hit keeps
    dynamo's trace)."""

    def __init__(self, least: float = 0.5) -> None:
        from torch._dynamo.utils import compilation_time_metrics, counters

        self._metrics, self._counters, self._least = compilation_time_metrics, counters, least
        self._start = {name: sum(times) for name, times in compilation_time_metrics.items()}
        self._graphs = counters["stats"]["unique_graphs"]
        self.graphs: int | None = None
        self.phases: dict[str, float] = {}

    def stop(self) -> None:
        self.graphs = self._counters["stats"]["unique_graphs"] - self._graphs
        spent = {name: sum(times) - self._start.get(name, 0.0) for name, times in self._metrics.items()}
        self.phases = {name: round(seconds, 2) for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1])
                       if seconds >= self._least}


class CachedStep:
    """A transformer call that a step cache skips: step 1 of 3 of a request whose step 0 ran, under a
    threshold no change reaches. It runs what such a step costs: the embedders, the first block, the change
    measured and agreed on over `group`'s ranks (None: one process), the cached residual added, the final
    layer."""

    def __init__(self, engine: Any, family: Any, group: Any = None) -> None:
        from engines.levers.step_cache import install_step_cache
        from engines.options import CacheOptions

        self.engine = engine
        self.cache = install_step_cache(engine, CacheOptions(threshold=1e30), block_lists=family.repeated_blocks,
                                        outputs=family.block_outputs, stream=family.cache_stream, group=group)
        self._primed = False

    def __call__(self, **kwargs: Any) -> Any:
        if not self._primed:  # step 0: every block runs (and the engine builds)
            with self.cache.step(0, 3):
                self.engine(**kwargs)
            self._primed = True
        with self.cache.step(1, 3):
            return self.engine(**kwargs)


def first_output(forward: Callable[..., Any], kwargs: dict[str, Any]) -> torch.Tensor:
    """The first tensor `forward(**kwargs)` returns (the model's sample)."""
    with torch.no_grad():
        out = forward(**kwargs)
    return next(leaf for leaf in torch.utils._pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor))


def record_everywhere(model: nn.Module, shapes: list[Shape], backends: list[EngineOptions], ctx: ParallelContext,
                      record: Callable[..., None], *, mode: str, one_gpu: Any, single: bool,
                      modes: list[tuple[ParallelPlan, str]], adapter: Any, note: str | None = None,
                      extra: dict[str, dict[str, Any]]) -> None:
    """Rows of `model` as it is now, every backend: on rank 0's GPU alone through `one_gpu` (`single`; restored
    after, None on the other ranks) and on all ranks for each (plan, transport) of `modes`; `mode` ends each row's
    mode name, `extra` gives each shape's rows more fields."""
    for options in backends if single else []:
        for shape in shapes:
            record(f"1 GPU{mode}", shape, 1, one_gpu, None, options, note=note, extra=extra[shape.label],
                   keep=f"1 GPU{mode}")
    if one_gpu is not None:
        one_gpu.restore()
    for plan, transport in modes:
        parallel = parallelize_transformer(model, ctx, plan, adapter, all_to_all=transport)
        for options in backends:
            for shape in shapes:
                record(f"{mode_label(plan, transport)}{mode}", shape, ctx.world_size, parallel, ctx.control_group,
                       options, plan=plan, transport=transport, note=note, extra=extra[shape.label],
                       check=f"1 GPU{mode}" if single else None)
        parallel.restore()


def measure_fp8(spec: BenchModel, model: torch.nn.Module, shapes: list[Shape], inputs: dict[str, dict[str, Any]],
                backends: list[EngineOptions], ctx: ParallelContext, record: Callable[..., None],
                *, unfused: bool = False, single: bool = True,
                modes: list[tuple[ParallelPlan, str]] = (), adapter: Any = None, linear: str = "torchao") -> None:
    """FP8 rows: quantize `model` in place (engines.levers.fp8.quantize_fp8, its `linear`: torchao or scaled-mm), time
    each backend on rank 0's GPU alone (`single`) and on all ranks for each (plan, transport) of `modes`; note the
    relative error ||fp8 - bf16|| / ||bf16|| of one eager call's output (1 GPU) against the unquantized model's.
    With `unfused`, rows "... fp8 unfused" come first, from a copy quantized without fusing the projections that
    share an input (engines.levers.fp8.quantize_fp8's fuse=False): quantizing is in place, and fusing has to come before
    it."""
    from engines.levers.fp8 import quantize_fp8

    reference: dict[str, torch.Tensor] = {}
    if ctx.is_main:
        one_gpu = single_process_forward(spec, model, ctx.device)
        reference = {s.label: first_output(one_gpu, inputs[s.label]).float() for s in shapes}
        one_gpu.restore()
    for suffix, fuse in ([(" unfused", False)] if unfused else []) + [("", True)]:
        quantized = model if fuse else copy.deepcopy(model)
        layers = quantize_fp8(quantized, spec.family.compiled_blocks, fuse=fuse, linear=linear)
        one_gpu = single_process_forward(spec, quantized, ctx.device) if ctx.is_main else None
        errors: dict[str, float] = {}
        if one_gpu is not None:
            for s in shapes:
                out = first_output(one_gpu, inputs[s.label]).float()
                errors[s.label] = float((out - reference[s.label]).norm() / reference[s.label].norm())
        record_everywhere(quantized, shapes, backends, ctx, record, mode=f" fp8{suffix}", one_gpu=one_gpu,
                          single=single, modes=modes, adapter=adapter, note=f"{layers} FP8 linears ({linear})",
                          extra={s.label: {"rel_error": errors.get(s.label)} for s in shapes})
        del quantized, one_gpu  # the unfused copy's memory is free before the fused rows
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()


def measure_attention_precision(spec: BenchModel, model: torch.nn.Module, shapes: list[Shape],
                                inputs: dict[str, dict[str, Any]], backends: list[EngineOptions], ctx: ParallelContext,
                                record: Callable[..., None], precision: str, *, modes: list[tuple[ParallelPlan, str]],
                                adapter: Any, single: bool = True, suffix: str = "") -> None:
    """Rows of `model` as it is (bf16, or FP8 linears: `suffix`) with every attention at `precision` (engines.
    quantized_attention.attention_precision, as the app's steps between the first and last run it), modes
    "...{suffix} attention {precision}"; each carries the relative error of one eager 1-GPU call's output against
    the same model's at full precision (rel_error_attention)."""
    from engines.levers.quantized_attention import attention_precision

    errors: dict[str, float] = {}
    if ctx.is_main:
        one_gpu = single_process_forward(spec, model, ctx.device)
        for s in shapes:
            full = first_output(one_gpu, inputs[s.label]).float()
            with attention_precision(precision):
                out = first_output(one_gpu, inputs[s.label]).float()
            errors[s.label] = float((out - full).norm() / full.norm())
        one_gpu.restore()
    with attention_precision(precision):
        one_gpu = single_process_forward(spec, model, ctx.device) if ctx.is_main and single else None
        record_everywhere(model, shapes, backends, ctx, record, mode=f"{suffix} attention {precision}",
                          one_gpu=one_gpu, single=single, modes=modes, adapter=adapter,
                          extra={s.label: {"attention": precision, "rel_error_attention": errors.get(s.label)}
                                 for s in shapes})


def build_split(spec: BenchModel, *, tp: int, rank: int, device: torch.device, dtype: torch.dtype, seed: int = 0
                ) -> nn.Module:
    """Rank `rank`'s share (of `tp`) of build_random's model (the same seed gives the same values), split by its
    family's tensor-parallel split, built the way engines/weights/sharded_loading.py's load_split loads a checkpoint.

    The model is made with its parameters on the meta device (buffers computed in __init__, such as Cosmos 3's
    rotary tables, stay real), its linears split at their local shapes (split_weights on meta tensors), and each
    parameter then made on `device`: build_random's values, drawn in its order, one whole parameter at a time of
    which this rank keeps its slices. So no rank holds the whole model; the largest parameter (Cosmos 3's text
    embedding, 1.5 GiB of Super's 119) is the most that is ever held beside the rank's share.
    """
    with parameters_on_meta():
        model = spec.model_class(**spec.config)
    whole = [(name, tuple(parameter.shape)) for name, parameter in model.named_parameters()]
    split = load(spec.family.tensor_parallel)(model, tp)
    split_weights(model, split, tp=tp, rank=rank)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, shape in whole:
            owner_name, _, attribute = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            local = tuple(owner._parameters[attribute].shape)
            # build_random's value: drawn whole where it is drawn (to keep the generator's order), then this rank's
            # slices; a constant one (a bias, a norm scale) made at its local shape
            drawn = len(shape) > 1 and not name.endswith("bias")
            value = torch.empty(shape if drawn else local, dtype=dtype, device=device)
            fill_random_(name, value, generator)
            ranges = split.parameter_ranges(name, shape, tp, rank) if drawn and tp > 1 else None
            value = value if ranges is None else take(value, *ranges)
            if tuple(value.shape) != local:
                raise ValueError(f"{name}: made {tuple(value.shape)}, the split model keeps {local} on this rank")
            owner._parameters[attribute] = nn.Parameter(value, requires_grad=False)
    left = [name for name, parameter in model.named_parameters() if parameter.is_meta]
    if left:  # a parameter the split added or renamed, which the whole model does not have
        raise ValueError(f"the split model has parameters the whole one has not: {left[:5]}")
    # nn.Module.to, not diffusers' override (as build_random): the buffers, cast to `dtype` as a checkpoint load would
    model = nn.Module.to(model, device=device, dtype=dtype)
    return model.eval().requires_grad_(False)


def measure_tp(spec: BenchModel, model: nn.Module | None, shapes: list[Shape], backends: list[EngineOptions],
               ctx: ParallelContext, record: Callable[..., None], *, tp: int, strategies: list[str], fp8: str | None,
               adapter: Any, dtype: torch.dtype) -> None:
    """--tp rows: each block's weights split over `tp` ranks, each plan of `tp` (our_plans, with `strategies` for the
    other ranks), every backend; with `fp8`, then the same rows with the split linears made FP8 in place (modes
    "... fp8"; 'alone': those only), each rank's shards quantized over the ranks' group as the app does for a model
    loaded split (engines.levers.fp8.quantize_fp8's group: a row-parallel shard's scales over whole rows).

    `model`: the whole model, split in place (not undone); None: built split (build_split), no rank holding the
    whole. Rows have no rel_error: a reference output would cost an extra eager call of a model this big, per shape.
    """
    from engines.levers.fp8 import quantize_fp8

    note, built = None, {}
    if model is None:
        model = build_split(spec, tp=tp, rank=ctx.rank % tp, device=ctx.device, dtype=dtype)  # tp: the innermost axis
        gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        note, built = f"built split: {gib:.2f} GiB of parameters per rank", {"param_gib": gib}
    plans = our_plans(ctx, spec.config["num_attention_heads"], strategies or ["ulysses"], False, tp=tp)
    modes = [(plan, "nccl") for plan in plans]
    extra = {shape.label: dict(built) for shape in shapes}
    if fp8 != "alone":
        record_everywhere(model, shapes, backends, ctx, record, mode="", one_gpu=None, single=False, modes=modes,
                          adapter=adapter, note=note, extra=extra)
    if fp8:
        # The compiled engines of the rows above are released (record): the FP8 weights replace bf16 ones in place.
        layers = quantize_fp8(model, spec.family.compiled_blocks, group=ctx.group)
        fp8_note = f"{layers} FP8 linears (scaled-mm)" + (f"; {note}" if note else "")
        record_everywhere(model, shapes, backends, ctx, record, mode=" fp8", one_gpu=None, single=False, modes=modes,
                          adapter=adapter, note=fp8_note, extra=extra)
    del model
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def write_random_lora(spec: BenchModel, rank: int, path: Path, *, seed: int = 0) -> Path:
    """A random rank-`rank` LoRA of `spec`'s transformer (LORA_TARGETS in every repeated block) written to `path` as a
    diffusers/PEFT safetensors file in bfloat16, as LoRAs come: A ~ N(0, 1/in), B small and non-zero (alpha = rank)."""
    from safetensors.torch import save_file

    prefixes = tuple(f"{name}." for name in spec.family.repeated_blocks)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in meta_transformer(spec.model_class, spec.config).named_modules():
        parts = name.split(".", 2)  # list name, index, the name within the block
        if not (isinstance(module, nn.Linear) and name.startswith(prefixes) and len(parts) == 3
                and any(parts[2] == t or parts[2].endswith("." + t) for t in LORA_TARGETS)):
            continue
        down = torch.randn(rank, module.in_features, generator=generator) * module.in_features ** -0.5
        up = torch.randn(module.out_features, rank, generator=generator) * 0.1 * rank ** -0.5
        state[f"transformer.{name}.lora_A.weight"] = down.to(torch.bfloat16)
        state[f"transformer.{name}.lora_B.weight"] = up.to(torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def attach_random_lora(spec: BenchModel, model: nn.Module, rank: int, folder: Path) -> LoraSet:
    """The app's LoRA path (pipelines.stages use_loras) on `model`, FP8 already or not: a random rank-`rank` file
    (write_random_lora) read and checked against the transformer's config, attached at scale 0."""
    path = write_random_lora(spec, rank, folder / f"lora-{rank}.safetensors")
    weights = check_lora_files([LoraFile(name=f"random-{rank}", path=path)], spec.model_class, spec.config)
    dtype = next(p.dtype for p in model.parameters() if not is_fp8(p))  # the run's (FP8 layers' are bf16)
    return attach_loras(model, weights, dtype=dtype)


@torch.no_grad()
def merge_lora_terms(model: nn.Module, terms: dict[str, LoraDelta], *, sign: float = 1.0) -> None:
    """Add each LoRA term B (s * A) (detach_loras' terms, sign -1: subtract it) into its layer's weight in place, in
    float32 then cast. An FP8 weight is dequantized with its per-row scales, summed, cast to bfloat16 (what FP8
    weights are quantized from) and quantized per row again with torchao's scale and rounding (engines.levers.fp8's),
    its float8 data and scales written in place: the same tensors, so compiled engines and CUDA graphs keep them."""
    from engines.levers.fp8 import _scale_of
    from engines.levers.fp8_matmul import quantize_rows

    for name, term in terms.items():
        layer = model.get_submodule(name)
        weight = layer.weight
        delta = (term.up.float() * term.scales.float()) @ term.down.float()
        if weight.dtype == torch.float8_e4m3fn:  # an Fp8Linear: float8 data, its scales beside it
            high = (weight.float() * layer.weight_scale + sign * delta).to(torch.bfloat16)
            data, scale = quantize_rows(high)
            weight.copy_(data)
            layer.weight_scale.copy_(scale)
        elif is_fp8(weight):  # torchao's Float8Tensor
            from torchao.quantization.quant_primitives import _quantize_affine_float8

            high = (weight.qdata.float() * weight.scale.float() + sign * delta).to(weight.dtype)
            scale = _scale_of(high.abs().amax(dim=1, keepdim=True))
            weight.qdata.copy_(_quantize_affine_float8(high, scale))
            weight.scale.copy_(scale)
        else:
            weight.copy_((weight.float() + sign * delta).to(weight.dtype))


def timed_seconds(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds `fn()` takes, its device work included (synchronized before and after)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def measure_lora(spec: BenchModel, model: nn.Module, shapes: list[Shape], inputs: dict[str, dict[str, Any]],
                 backends: list[EngineOptions], ctx: ParallelContext, record: Callable[..., None], *, rank: int,
                 modes: list[tuple[ParallelPlan, str]], adapter: Any, single: bool = True, suffix: str = "") -> None:
    """LoRA rows on `model` as it is (FP8 or not), on rank 0's GPU alone (`single`) and on all ranks for each (plan,
    transport) of `modes`, every backend; `model` is left without LoRA (its weights as before, up to rounding).

    "unfused": a random rank-`rank` LoRA attached as the app does (attach_random_lora) and selected at scale 1;
    switch_s / switch_off_s: the median seconds of LoraSet.select to it / to none. "fused": the same terms merged
    into the weights (merge_lora_terms), no LoRA layers; merge_s / unmerge_s: one merge / unmerge of the whole
    transformer; fused_rel_diff: ||fused - unfused|| / ||unfused|| of one eager 1 GPU output. Times are the
    slowest rank's."""
    import tempfile

    def slowest(seconds: float) -> float:
        return max(gather_objects(ctx, seconds))

    def rows_of(kind: str, extra: dict[str, Any], reference: dict[str, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
        mode = f"{suffix} lora-{rank} {kind}"
        one_gpu = single_process_forward(spec, model, ctx.device) if ctx.is_main else None
        outputs = {s.label: first_output(one_gpu, inputs[s.label]).float() for s in shapes} if one_gpu else {}
        shape_extra = {s.label: dict(extra) for s in shapes}
        for label, out in outputs.items() if reference else ():
            shape_extra[label]["fused_rel_diff"] = float((out - reference[label]).norm() / reference[label].norm())
        record_everywhere(model, shapes, backends, ctx, record, mode=mode, one_gpu=one_gpu, single=single,
                          modes=modes, adapter=adapter, extra=shape_extra)
        return outputs

    with tempfile.TemporaryDirectory(prefix="lora-bench-") as folder:
        loras = attach_random_lora(spec, model, rank, Path(folder))
    chosen = [(loras.names[0], 1.0)]
    on, off = [], []
    for _ in range(SWITCHES):
        off.append(timed_seconds(lambda: loras.select([]), ctx.device))
        on.append(timed_seconds(lambda: loras.select(chosen), ctx.device))
    extra = dict(lora_rank=rank, lora_layers=loras.layers, switch_s=slowest(statistics.median(on)),
                 switch_off_s=slowest(statistics.median(off)))
    unfused = rows_of("unfused", dict(lora="unfused", **extra))
    terms = detach_loras(model)
    merge_s = slowest(timed_seconds(lambda: merge_lora_terms(model, terms), ctx.device))
    unmerge_s = slowest(timed_seconds(lambda: merge_lora_terms(model, terms, sign=-1.0), ctx.device))
    merge_lora_terms(model, terms)
    rows_of("fused", dict(lora="fused", lora_rank=rank, lora_layers=loras.layers, merge_s=merge_s,
                          unmerge_s=unmerge_s), reference=unfused)
    merge_lora_terms(model, terms, sign=-1.0)
    terms = None  # freed before the next model
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def agreed_error(ctx: ParallelContext, error: str | None) -> str | None:
    """Every rank's errors joined (None when no rank failed): the same answer on every rank."""
    errors = [e for e in gather_objects(ctx, error) if e]
    return "; ".join(dict.fromkeys(errors)) or None


def measure_peer(peer: Peer, spec: BenchModel, model: torch.nn.Module, shapes: list[Shape],
                 ctx: ParallelContext, record: Callable[..., None], *, warmup: int) -> None:
    """Rows of one peer on every shape: eager, then compiled as the peer advises (benchmarks/peers.py).

    A peer that cannot run (not installed, no CUDA, import or set-up error) gets rows that say why.
    All ranks agree on each stage's outcome (import, set-up, compile) before the next one, so a
    failure on one rank never leaves another waiting in a collective the first will not join.
    """
    mode = peer_mode(peer, ctx.world_size)
    error = agreed_error(ctx, unavailable_reason(peer, ctx, spec))
    if error is None:
        error = agreed_error(ctx, _attempt(import_peer, peer))
    with compiler_settings_restored():
        transformer = None
        if error is None:
            first = shapes[0]
            try:
                transformer = parallelize_peer(peer, spec, model, ctx, height=first.height, width=first.width,
                                               text_tokens=first.text_tokens)
            except Exception as exc:  # recorded in the rows, agreed below
                error = repr(exc)[:2000]
            error = agreed_error(ctx, error)
        for backend in ("eager", peer.compiled_backend):
            forward, note = transformer, None
            if backend != "eager":
                note = peer.compile_note
                if error is None:
                    try:
                        forward = compile_peer(peer, transformer)
                    except Exception as exc:
                        forward, error = None, repr(exc)[:2000]
                    error = agreed_error(ctx, error)
            for shape in shapes:
                shape_error = error
                if error is None:
                    shape_error = agreed_error(ctx, _attempt(set_input_shape, peer, height=shape.height,
                                                              width=shape.width, text_tokens=shape.text_tokens))
                record(mode, shape, ctx.world_size, forward, ctx.control_group, EngineOptions(), error=shape_error,
                       backend=backend, note=note, warmup=warmup)


def _attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """None if fn(*args, **kwargs) returns, else its exception's repr."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # e.g. a peer's missing dependency
        return repr(exc)[:2000]
    return None


def finish(rows: list[dict[str, Any]], device: torch.device) -> list[dict[str, Any]]:
    """Add speedup vs the 1-GPU row of the same model, shape and backend, and MFU where the peak is known."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    base = {(r["model"], r["shape"], r["backend"]): r["ms"] for r in rows if r["mode"] == "1 GPU"}
    for r in rows:
        b = base.get((r["model"], r["shape"], r["backend"]))
        r["speedup"] = b / r["ms"] if b and r["ms"] == r["ms"] and r["ms"] > 0 else None
        r["mfu"] = r["flops"] / (r["ms"] / 1e3 * r["gpus"] * peak) if peak and r["flops"] and r["ms"] > 0 else None
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Compact text table of the rows."""
    head = (f"{'model':<11} {'mode':<34} {'backend':<26} {'shape':<13} {'tokens':>7} {'ms':>9} {'speedup':>8} "
            f"{'MFU':>6} {'peak GiB':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        mfu = f"{r['mfu']:.0%}" if r["mfu"] else "-"
        lines.append(f"{r['model']:<11} {r['mode']:<34} {r['backend']:<26} {r['shape']:<13} {r['tokens']:>7} "
                     f"{r['ms']:>9.1f} {speed:>8} {mfu:>6} {r['peak_gib']:>9.1f}"
                     + (f"  ERROR {r['error']}" if r["error"] else "")
                     + (f"  rel. error {r['rel_error']:.4f}" if r.get("rel_error") is not None else ""))
    return "\n".join(lines)


def comma_list(parser: argparse.ArgumentParser, text: str, what: str, choices: tuple[str, ...]) -> list[str]:
    """The items of a comma-separated option; parser.error (exit 2) names the first one not in `choices`."""
    items = [item for item in text.split(",") if item]
    for item in items:
        if item not in choices:
            parser.error(f"unknown {what} {item!r}; choose from {', '.join(choices)}")
    return items


def engine_labels(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The engine labels of a comma-separated --backends; parser.error names the first bad one and why."""
    labels = [label for label in text.split(",") if label]
    for label in labels:
        try:
            EngineOptions.parse(label)
        except ValueError as error:
            parser.error(f"bad backend {label!r}: {error}")
    return labels


def parse_args(argv: list[str] | None = None, *, world_size: int | None = None) -> argparse.Namespace:
    """Command-line options; `world_size`: the run's ranks (default: torchrun's WORLD_SIZE, 1 without it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux-dev",
                   help=f"comma-separated registered checkpoints: {', '.join(benchmarkable())} (default flux-dev; "
                        "random weights of the published architecture)")
    p.add_argument("--sizes", default=None,
                   help="image sizes HxW, comma-separated (default: the family's, e.g. 1024x1024,2048x2048)")
    p.add_argument("--video", default=None,
                   help="video sizes FxHxW, comma-separated (default: the family's, e.g. 93x704x1280)")
    p.add_argument("--text-tokens", type=int, default=512, help="text tokens (T5), default 512")
    p.add_argument("--batch", type=int, default=0,
                   help="batch (default: the family's: 1, or 2 = cond+uncond for guidance-batched families)")
    p.add_argument("--strategies", default="ulysses,ring,allgather,ulysses-ring",
                   help=f"comma-separated, of {', '.join(STRATEGIES)}")
    p.add_argument("--cfg", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure CFG-parallel plans (default: on for guidance-batched families, Cosmos)")
    p.add_argument("--all-to-all", default="nccl",
                   help=f"comma-separated transports of the Ulysses all-to-alls and K/V exchanges to measure: "
                        f"{', '.join(TRANSPORTS)} "
                        "(default nccl; engines/parallel/copy_engine.py)")
    p.add_argument("--no-diffusers", action="store_true", help="skip diffusers-native Ulysses")
    p.add_argument("--no-single", action="store_true",
                   help="skip the 1 GPU rows (each precision's; the error figures still run one eager call on "
                        "rank 0's GPU)")
    p.add_argument("--diffusers-forward", action="store_true",
                   help="also time the diffusers model's own forward on one GPU (eager), beside ours")
    p.add_argument("--peers", default="",
                   help=f"comma-separated peers to measure last: {', '.join(PEERS)} (default none), on the families "
                        "whose record names them (FLUX); each is timed eager and compiled as it advises "
                        "(benchmarks/peers.py); one that cannot run gets rows with the reason")
    p.add_argument("--backends", default="eager",
                   help="comma-separated engine labels (engines.options.EngineOptions): eager, inductor, "
                        "inductor-blocks, inductor+cudagraph, eager+cudagraph, tensorrt, ... (default eager)")
    p.add_argument("--fp8", nargs="?", const="all", default=None, choices=("all", "parallel", "alone"),
                   help="after the other rows, make the blocks' linears FP8 on the same weights "
                        "(engines/levers/fp8.py) "
                        "and time 1 GPU and every plan again with every backend ('--fp8 parallel': the plans "
                        "only; '--fp8 alone': the plans' FP8 rows and no other row, so that with an empty "
                        "--cache-dir they time a cold FP8 build; on one rank, its 1-GPU FP8 rows); rows carry the "
                        "output's relative error")
    p.add_argument("--fp8-unfused", action="store_true",
                   help="with --fp8, first the same FP8 rows without fusing the projections that share an input "
                        "(q/k/v: engines/levers/fp8.py), on a copy of the weights, modes \"... fp8 unfused\"")
    p.add_argument("--fp8-linear", default="scaled-mm", choices=("scaled-mm", "torchao"),
                   help="with --fp8, how the FP8 linears run (engines.levers.fp8.quantize_fp8's linear): "
                        "engines.levers.fp8.Fp8Linear (the app's: plain float8 weights, torch._scaled_mm called "
                        "directly) "
                        "or torchao's Float8Tensor "
                        "weights (the same numbers, a tensor subclass for torch.compile to trace)")
    p.add_argument("--cached-step", action="store_true",
                   help="after the 1-GPU rows and after each plan's, time them again on a step that a step cache "
                        "skips (--cache: engines/levers/step_cache.py), with each backend that keeps the block loop "
                        "in Python")
    p.add_argument("--attention-precision", default=None, choices=("int8", "fp8"),
                   help="after the bf16 rows (and after the FP8 ones, with --fp8), the same 1 GPU and plans with "
                        "every attention at this precision (engines/levers/quantized_attention.py), "
                        "modes \"... attention "
                        "int8\", each with its output's relative error against full precision")
    p.add_argument("--tp", type=int, default=1,
                   help="after every other row, split each block's weights over this many ranks (tensor "
                        "parallelism, engines/parallel/tensor_parallel.py; the rest of the ranks split the sequence by "
                        "each --strategies) and time that; the split is not undone, so it runs last (not with "
                        "--peers or --lora-rank; the diffusers-native rows are left out); with --fp8, then the same "
                        "rows with the split linears made FP8 (\"ours tp-N fp8\"), on a model built split")
    p.add_argument("--tp-only", action="store_true",
                   help="with --tp, time only the --tp rows (bf16, and FP8 with --fp8), on a transformer built "
                        "already split (build_split): no rank ever holds the whole model, so one too big for a GPU "
                        "(cosmos3-super) runs on the ranks that hold its shares; no 1 GPU, other plan, diffusers or "
                        "LoRA row")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="after our rows (and after the FP8 ones), time 1 GPU and every plan again with a random LoRA "
                        "of this rank, unfused as the app runs it and fused into the weights, with the seconds a "
                        "switch and a merge take (measure_lora; default 0: none)")
    p.add_argument("--cache-dir", type=Path, default=None, help="engine cache folder (default: none, always compile)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="tiny configs, float32, on CPU with gloo (a smoke test)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here (rank 0)")
    p.add_argument("--profile", type=Path, default=None,
                   help="after timing each mode, profile one call per rank into this folder (trace + top-ops table)")
    args = p.parse_args(argv)
    args.models = comma_list(p, args.model, "model", tuple(benchmarkable()))
    args.backends = engine_labels(p, args.backends)
    args.peers = comma_list(p, args.peers, "peer", tuple(PEERS))
    args.strategies = comma_list(p, args.strategies, "strategy", STRATEGIES)
    args.all_to_all = comma_list(p, args.all_to_all, "all-to-all transport", TRANSPORTS)
    if args.tp < 1:
        p.error(f"--tp must be >= 1, got {args.tp}")
    # torchrun's: every rank refuses alike, before any collective (benchmarks.cli asks before starting them)
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp > 1 and world % args.tp:
        p.error(f"--tp {args.tp} splits the weights over groups of {args.tp} ranks: the {world} rank(s) of this run "
                f"are not a multiple of it (torchrun --nproc-per-node)")
    if args.tp_only and args.tp < 2:
        p.error("--tp-only times the --tp rows alone, on a model built split: give --tp 2 or more")
    if args.tp_only and (args.diffusers_forward or args.cached_step or args.fp8_unfused):
        p.error("--tp-only times the tp rows alone: it does not combine with --diffusers-forward, --cached-step "
                "or --fp8-unfused")
    if args.tp > 1 and args.fp8 and args.fp8_linear != "scaled-mm":
        p.error("--tp with --fp8 needs --fp8-linear scaled-mm (engines.levers.fp8: torchao's form is not split "
                "by tensor "
                "parallelism)")
    if args.lora_rank < 0:
        p.error(f"--lora-rank must be >= 0, got {args.lora_rank}")
    if args.tp > 1 and args.lora_rank:
        p.error("--lora-rank does not combine with --tp here (the tp split is made after the LoRA rows, in place)")
    if args.tp > 1 and args.peers:
        p.error("--tp does not combine with --peers (a peer's parallelism stays on the model; the split follows it)")
    return args


def main(argv: list[str] | None = None) -> None:
    """Benchmark entry point (see the module docstring)."""
    args = parse_args(argv)
    # As the app runs: cuBLAS without a workspace; inductor's kernels beside the engine cache if one is used.
    set_environment(run_environment(args.cache_dir) if args.cache_dir else CUBLAS_WITHOUT_WORKSPACE)
    ctx = init_parallel("cpu" if args.tiny else None)
    try:
        meta = dict(all_to_all=args.all_to_all,
            command=" ".join(sys.argv), world_size=ctx.world_size, torch=torch.__version__,
            diffusers=diffusers.__version__, cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())) if ctx.device.type == "cuda" else None,
            device=torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
            dtype=str(weights_dtype(args.tiny)).removeprefix("torch."), backends=args.backends, warmup=args.warmup,
            iters=args.iters, cublas_env={name: os.environ.get(name) for name in CUBLAS_WITHOUT_WORKSPACE},
        )

        def save(rows: list[dict[str, Any]]) -> None:
            if args.out:  # after every row, so a run cut short still leaves its numbers
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(dict(meta=meta, rows=finish(rows, ctx.device)), indent=2))

        args.on_row = save
        rows: list[dict[str, Any]] = []
        for name in args.models:
            spec = bench_model(name, tiny=args.tiny)
            shapes = model_shapes(spec, sizes=args.sizes, video=args.video, text_tokens=args.text_tokens,
                                  tiny=args.tiny)
            # by default only guidance-batched calls split (a family of separate guidance calls, Qwen-Image, times
            # one call unless --cfg asks for a batch of two)
            batched = spec.family.guidance_batch and not spec.family.guidance_calls
            cfg = batched if args.cfg is None else args.cfg
            run_model(spec, shapes, args, ctx, cfg=cfg, rows=rows)
        if ctx.is_main:
            rows = finish(rows, ctx.device)
            print(table(rows), flush=True)
            save(rows)
    finally:
        shutdown(ctx)


if __name__ == "__main__":
    from app.commands.cli import exit_with

    main()
    # at once, as the app's commands end: the ranks' teardown is done and bounded (engines.parallel.distributed)
    exit_with(0)
