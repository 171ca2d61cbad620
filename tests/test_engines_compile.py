"""The compile machinery around the engines: the compile-worker pool's teardown (engines.levers.compile_teardown), the
engines' graph limit, and what `generate` says its engines took to build.

Each family's transformer compiled whole (fullgraph=True) on 2 gloo ranks against eager is the conformance suite's
(tests/test_conformance.py); inductor's engines and their cache are tests/test_engines_engine.py's.
"""

from __future__ import annotations

import time

import torch


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


def test_an_engine_refused_for_a_missing_block_list_leaves_the_model_as_it_was(monkeypatch) -> None:
    """prepare_engine finds every block list before it swaps a block: one that is not there leaves no list's blocks
    compiled (the caller keeps its plain model)."""
    import pytest

    from engines.levers import compile as engines_compile
    from engines.options import EngineOptions

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit)
    monkeypatch.setattr(torch._dynamo.config, "accumulated_recompile_limit",
                        torch._dynamo.config.accumulated_recompile_limit)
    model = _Blocks()
    blocks = list(model.blocks)
    with pytest.raises(AttributeError, match="nope"):
        engines_compile.prepare_engine(model, EngineOptions.parse("inductor-blocks"),
                                       repeated_blocks=("blocks", "nope"))
    assert list(model.blocks) == blocks
