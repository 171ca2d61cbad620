"""torch.compile(fullgraph=True) of a sharded tiny transformer on 2 gloo ranks, against eager.

"aot_eager" traces exactly what inductor would receive (Dynamo graph with the functional
collectives, then AOT autograd) without inductor's kernel fusion, so it must match eager
exactly: any graph break fails fullgraph=True, any tracing mistake shows as a difference.
Inductor itself is checked in test_engines_engine.py (compiled engines and their cache).

torch 2.11 (the GPU image) refuses to trace torch._utils._maybe_view_chunk_cat, which funcol's
all-gather calls for a non-zero gather dim; torch 2.13 (here) traces it. The workers make it raise,
so the CPU test fails if the parallel layer ever reaches it again.

Also: engines.levers.compile_teardown.stop_compile_workers, which ends torch 2.11's compile-worker pool at teardown.

Compile with the default (or dynamic=False): every token count then gets its own static graph.
With dynamic=True diffusers' CosmosLearnablePositionalEmbed (extra_pos_embed_type="learnable",
Cosmos 1.0 only) compiles to wrong values even in a single process, a torch/diffusers issue
outside this layer; FLUX and Cosmos-Predict2 configs are unaffected.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tests.helpers import (
    cosmos_inputs,
    flux_inputs,
    join_ranks,
    parallelize,
    randomize,
    spawn_ranks,
    tiny_cosmos,
    tiny_flux,
)
from tests.test_engines_generic import QWEN_TINY, WAN_TINY, qwen_inputs, wan_inputs

# (model, strategy, backend)
CASES = [
    ("flux", "ulysses", "aot_eager"),
    ("flux", "ring", "aot_eager"),
    ("flux", "allgather", "aot_eager"),
    ("cosmos", "ulysses", "aot_eager"),
    ("cosmos", "ring", "aot_eager"),
    ("cosmos", "cfg", "aot_eager"),
    ("wan", "ulysses", "aot_eager"),  # the generic path (engines/parallel/generic.py): hooks and the wrapped dispatch
    ("wan", "ring", "aot_eager"),
    ("qwen", "allgather", "aot_eager"),
]


def _wan() -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**WAN_TINY)


def _qwen() -> torch.nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(**QWEN_TINY)


MODELS = {"flux": tiny_flux, "cosmos": tiny_cosmos, "wan": _wan, "qwen": _qwen}
INPUTS = {"flux": lambda: flux_inputs((3, 3), 5), "cosmos": lambda: cosmos_inputs((3, 3, 3)),
          "wan": lambda: wan_inputs(False), "qwen": lambda: qwen_inputs(False)}


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    join_ranks(rank, world_size, port)
    import torch.distributed._functional_collectives as funcol

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("_maybe_view_chunk_cat reached: torch 2.11's dynamo cannot trace it")

    funcol._maybe_view_chunk_cat = refuse  # test-only: stand in for torch 2.11's graph break
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.plan import ParallelPlan

    ctx = init_parallel("cpu")
    results = []
    for name, strategy, backend in CASES:
        torch.manual_seed(0)
        model = randomize(MODELS[name]())
        torch.manual_seed(1)
        # token counts that 2 does not divide: the padded path is the one compiled
        kwargs = INPUTS[name]()
        plan = ParallelPlan(cfg=2) if strategy == "cfg" else ParallelPlan.auto(world_size, 6, strategy=strategy)
        torch._dynamo.reset()
        with torch.no_grad():
            if name == "qwen":  # its family's record names this adapter
                from engines.parallel.generic import parallelize_joint
                from engines.parallel.parallelize import parallelize_transformer

                parallel = parallelize_transformer(model, ctx, plan, parallelize_joint)
            else:
                parallel = parallelize(model, ctx, plan)
            eager = parallel(**kwargs)[0]
            compiled = torch.compile(parallel, fullgraph=True, backend=backend)(**kwargs)[0]
            parallel.restore()
        results.append(dict(model=name, strategy=strategy, backend=backend,
                            err=(compiled - eager).abs().max().item()))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


def test_compiled_fullgraph_matches_eager(tmp_path: Path) -> None:
    spawn_ranks(_worker, 2, str(tmp_path))
    for rank in range(2):
        for r in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            assert r["err"] == 0.0, r


def test_stop_compile_workers_ends_a_starting_pool_and_its_workers_at_once(monkeypatch) -> None:
    """inductor's own pool, just started (its workers still importing torch, as after a cold compile): killed with
    its workers within the bound, where asking it to stop waits for every worker to start."""
    import torch._inductor.async_compile as async_compile
    from torch._inductor.compile_worker.subproc_pool import SubprocPool

    from engines.levers.compile_teardown import _children, _running, stop_compile_workers

    pool = SubprocPool(2)
    monkeypatch.setattr(async_compile, "_pool_set", [pool])
    pool.submit(sorted, [2, 1])  # a job makes it start its workers
    deadline = time.monotonic() + 30
    while not _children(pool.process.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = _children(pool.process.pid)
    assert workers, "the pool started no workers"
    started = time.monotonic()
    stop_compile_workers()
    assert time.monotonic() - started < 2.5
    assert pool.process.poll() is not None
    assert not any(_running(pid) for pid in workers), "a worker outlived its pool"
    pool.shutdown()  # what the interpreter's exit runs: nothing left to stop, it returns at once


def test_a_teardown_that_cannot_finish_is_bounded_and_says_so(monkeypatch, capsys) -> None:
    """engines.parallel.distributed.shutdown: a process group whose destruction never returns (NCCL with a graph still
    holding its kernels) is given up after the timeout, with a warning naming the rank, and shutdown returns False."""
    import threading

    import torch.distributed as dist

    from engines.parallel import distributed

    never = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: never.wait(60))
    ctx = distributed.ParallelContext(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), group=None,
                                      control_group=None)
    started = time.monotonic()
    try:
        assert distributed.shutdown(ctx, timeout=0.5) is False
    finally:
        never.set()
    assert time.monotonic() - started < 5
    assert "rank 1: the process group's teardown did not finish within 0.5 s" in capsys.readouterr().err


class _Blocks(torch.nn.Module):
    """A model of repeated blocks, as the engines see a transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    @property
    def device(self) -> torch.device:
        return self.blocks[0].weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].weight.dtype

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        for block in self.blocks:
            x = torch.relu(block(x))
        return (x,)


def test_an_engine_builds_a_graph_for_every_signature_past_dynamos_default_limit(monkeypatch) -> None:
    """Static-shape engines make a graph per signature, and all of a process's engines share their blocks' code:
    past dynamo's default of 8 graphs a function, a fullgraph compile fails the call (a server's ninth signature on
    GPUs). Dynamo's own eager backend stands in for inductor here: the limit is dynamo's, and it compiles in
    milliseconds."""
    from engines.levers import compile as engines_compile
    from engines.options import EngineOptions

    monkeypatch.setattr(engines_compile, "_inductor_compile",
                        lambda module, options: torch.compile(module, fullgraph=True, dynamic=False, backend="eager"))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # dynamo's default, restored after
    torch._dynamo.reset()
    reference = _Blocks()
    models = [_Blocks() for _ in range(2)]  # two layouts' models (a server with --replicas auto): one block class
    for model in models:
        model.load_state_dict(reference.state_dict())
    engines = [engines_compile.prepare_engine(model, EngineOptions.parse("inductor-blocks"),
                                              repeated_blocks=("blocks",))
               for model in models]
    for rows in range(1, 11):  # ten signatures
        for engine in engines:
            x = torch.randn(rows, 4)
            torch.testing.assert_close(engine(x=x)[0], reference(x)[0])
    assert all(len(engine.builds) == 10 for engine in engines)
    for engine in engines:
        engine.release()
    torch._dynamo.reset()


def test_generate_says_what_building_its_engines_took() -> None:
    """`generate`'s last line: the seconds of its engines' builds (app.commands.generate.engine_builds), loaded from
    the engine cache or compiled; nothing for an eager transformer or one not built yet."""
    from app.commands.generate import engine_builds
    from engines.levers.compile import BuildRecord, Engine
    from engines.options import EngineOptions

    compiled = Engine(module=torch.nn.Linear(2, 2), options=EngineOptions.parse("inductor-blocks"))
    eager = Engine(module=torch.nn.Linear(2, 2), options=EngineOptions.parse("eager"))
    eager.builds["x"] = BuildRecord(key="", cache_hit=False, seconds=9.0)

    class Pipeline:
        def transformers(self) -> list[tuple[str, Engine]]:
            return [("transformer", compiled), ("transformer_2", eager)]

    assert engine_builds(Pipeline()) == ""
    compiled.builds["a"] = BuildRecord(key="k", cache_hit=True, seconds=1.5)
    assert engine_builds(Pipeline()) == "; engine built in 1.5 s from the engine cache"
    compiled.builds["b"] = BuildRecord(key="k2", cache_hit=False, seconds=2.0)
    assert engine_builds(Pipeline()) == "; engines built in 3.5 s compiled in part"
