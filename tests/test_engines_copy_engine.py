"""The copy-engine all-to-all transport (engines/parallel/copy_engine.py): what is refused, and where; who
owns its state (the mesh's CopyEngineTransport, registered by group name until close()); when a
grown buffer's predecessor is freed.

Its results through FLUX, eager and compiled on 2 gloo ranks, are checked beside NCCL's in
tests/test_engines_flux_overlap.py; GPU runs (against NCCL on 2 H200s, and speed) are in
docs/benchmarks.md.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import free_port


def test_unknown_transport_is_refused_before_any_collective() -> None:
    from engines.parallel.distributed import init_parallel
    from engines.parallel.mesh import build_mesh
    from engines.parallel.plan import ParallelPlan

    ctx = init_parallel("cpu")  # no torchrun here: one process, no process group at all
    with pytest.raises(ValueError, match="unknown all-to-all transport 'carrier-pigeon'.*copy-engine"):
        build_mesh(ctx, ParallelPlan(), all_to_all="carrier-pigeon")


def test_copy_engine_needs_one_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.parallel.copy_engine import check_transport

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="one host"):
        check_transport("copy-engine", object(), torch.device("cuda", 0))
    check_transport("nccl", object(), torch.device("cuda", 0))
    check_transport("copy-engine", None, torch.device("cuda", 0))  # one process: nothing to move


class FakeExchange:
    """Stands for copy_engine._Exchange (symmetric memory: GPU only) in the bookkeeping tests."""

    def __init__(self, group_name: str, data_bytes: int, device: torch.device) -> None:
        self.group_name, self.data_bytes = group_name, data_bytes
        self.captured, self.released, self.freed = False, False, False

    def release(self) -> None:
        self.released = True

    def free(self) -> None:
        self.released = self.freed = True


def test_replace_exchange_frees_a_buffer_unless_a_graph_was_captured_on_it() -> None:
    """A buffer too small for a call is replaced; it is freed at once, unless a CUDA graph was
    captured while it was in use: that graph holds its addresses and the peers', and a server
    replays it when a request of its shape comes back, so it is kept (until the mesh closes)."""
    from engines.parallel.copy_engine import replace_exchange

    cpu = torch.device("cpu")
    old = FakeExchange("g", 100, cpu)
    assert replace_exchange(None, 100, capturing=False) == "create"
    assert replace_exchange(old, 80, capturing=False) == "use"
    assert replace_exchange(old, 100, capturing=True) == "use"  # fits: captured graphs may use it
    assert replace_exchange(old, 200, capturing=False) == "free"
    old.captured = True
    assert replace_exchange(old, 200, capturing=False) == "retire"
    for current in (None, old):  # a rendezvous and a barrier cannot be captured
        with pytest.raises(RuntimeError, match="during CUDA graph capture"):
            replace_exchange(current, 200, capturing=True)


def _fake_transport(monkeypatch: pytest.MonkeyPatch, *names: str):  # -> CopyEngineTransport
    """A CopyEngineTransport over groups that only have names, with FakeExchange buffers."""
    from torch.distributed import _symmetric_memory as symm_mem

    from engines.parallel import copy_engine

    monkeypatch.setattr(copy_engine, "_Exchange", FakeExchange)
    monkeypatch.setattr(copy_engine, "_TRANSPORTS_BY_GROUP", {})
    monkeypatch.setattr(symm_mem, "is_symm_mem_enabled_for_group", lambda name: True)  # no process group
    return copy_engine.CopyEngineTransport([SimpleNamespace(group_name=name) for name in names])


def test_a_grown_buffer_is_freed_unless_captured_and_close_frees_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.parallel import copy_engine

    transport = _fake_transport(monkeypatch, "group")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])  # no CUDA here
    cpu = torch.device("cpu")
    small = transport.exchange("group", "gather", 100, cpu)
    assert transport.exchange("group", "gather", 80, cpu) is small and not small.captured  # fits: no new buffer
    bigger = transport.exchange("group", "gather", 200, cpu)
    assert bigger is not small and bigger.data_bytes == 200
    assert small.freed and transport._retired == []  # never captured: freed at once

    capturing[0] = True
    assert transport.exchange("group", "gather", 100, cpu) is bigger and bigger.captured  # a graph holds it now
    assert transport.gathered("group") is bigger
    capturing[0] = False
    biggest = transport.exchange("group", "gather", 300, cpu)
    assert bigger.released and not bigger.freed and transport._retired == [bigger]  # the graph may replay
    assert transport.exchange("group", "gather", 100, cpu) is biggest  # smaller shapes use the big one
    slots = transport.exchange("group", "slots", 100, cpu)
    assert slots is not biggest  # one buffer per kind
    assert copy_engine.transport_for("group") is transport

    transport.close()
    assert biggest.freed and bigger.freed and slots.freed and transport._retired == []
    with pytest.raises(RuntimeError, match="no copy-engine transport"):
        copy_engine.transport_for("group")
    transport.close()  # idempotent


def test_an_exchange_is_made_off_the_calling_thread_and_its_failure_reaches_the_caller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's CUDA graph trees (+blockgraph) put every allocation of the thread that warms a graph up into the
    graphs' pool, and refuse to record while memory there is held by anything but a graph's output: an exchange
    made at an engine's first call is made on a thread of its own (on 2 H200s its tensors failed that check)."""
    import threading

    from engines.parallel import copy_engine

    transport = _fake_transport(monkeypatch, "group")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    made_on = []

    class Recorded(FakeExchange):
        def __init__(self, *args) -> None:
            made_on.append(threading.current_thread())
            super().__init__(*args)

    monkeypatch.setattr(copy_engine, "_Exchange", Recorded)
    transport.exchange("group", "gather", 100, torch.device("cpu"))
    transport.exchange("group", "gather", 200, torch.device("cpu"))  # grown: made anew
    assert len(made_on) == 2 and threading.current_thread() not in made_on

    class Failing(FakeExchange):
        def __init__(self, *args) -> None:
            raise RuntimeError("rendezvous failed")

    monkeypatch.setattr(copy_engine, "_Exchange", Failing)
    with pytest.raises(RuntimeError, match="rendezvous failed"):
        transport.exchange("group", "slots", 100, torch.device("cpu"))


def test_a_group_shared_by_two_meshes_keeps_its_buffers_until_both_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's DeviceMesh gives an axis that spans the whole job the default group, so two meshes
    (two models served at once) may share a group: the ops find one transport for it, and its
    buffers, which graphs of both models may hold, live until the last of those meshes closes."""
    from engines.parallel import copy_engine

    first = _fake_transport(monkeypatch, "shared", "first only")
    second = copy_engine.CopyEngineTransport([SimpleNamespace(group_name="shared"),
                                              SimpleNamespace(group_name="second only")])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert copy_engine.transport_for("shared") is first
    assert copy_engine.transport_for("second only") is second
    buffer = copy_engine.transport_for("shared").exchange("shared", "slots", 100, torch.device("cpu"))
    first.close()
    assert copy_engine.transport_for("shared") is first and not buffer.freed  # the second mesh still uses it
    with pytest.raises(RuntimeError, match="no copy-engine transport"):
        copy_engine.transport_for("first only")
    second.close()
    assert buffer.freed and copy_engine._TRANSPORTS_BY_GROUP == {}


def _worker(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from engines.parallel import copy_engine
    from engines.parallel.collectives import finish
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.mesh import build_mesh
    from engines.parallel.plan import ParallelPlan
    from engines.parallel.wrapper import ParallelTransformer

    ctx = init_parallel("cpu")
    registry = copy_engine._TRANSPORTS_BY_GROUP
    mesh = build_mesh(ctx, ParallelPlan(ulysses=2), all_to_all="copy-engine")
    name = mesh.ulysses_group_name
    assert mesh.copy_engine is not None and copy_engine.transport_for(name) is mesh.copy_engine
    assert copy_engine.transport_for(mesh.ring_group_name) is mesh.copy_engine

    # on CPU the ops run gloo's collectives: the same results
    torch.manual_seed(rank)
    x = torch.randn(2, 3, 4)
    expected = torch.empty_like(x)
    dist.all_to_all_single(expected, x, group=mesh.ulysses_group)
    assert torch.equal(finish(copy_engine.start(x, name)), expected)
    keys, values = [torch.randn(2, 1, 3), torch.randn(1, 1, 3)], [torch.randn(3, 1, 3)]
    pieces = [torch.empty(2, 3, 1, 3) for _ in range(2)]
    dist.all_gather(pieces, torch.stack([torch.cat(keys), torch.cat(values)]), group=mesh.ulysses_group)
    expected = torch.cat(pieces, dim=1)
    finish(copy_engine.start_gather_kv(keys, values, name, 2))
    assert torch.equal(copy_engine.gathered_kv(name, (2, 6, 1, 3), x.dtype, x.device), expected)
    ahead = copy_engine.start_gather_kv(keys, [], name, 2)  # the keys first, then the values
    finish(copy_engine.start_gather_kv([], values, name, 2, keys_sent=ahead))
    assert torch.equal(copy_engine.gathered_kv(name, (2, 6, 1, 3), x.dtype, x.device), expected)

    mesh.close()
    assert registry == {}
    mesh.close()  # idempotent
    try:
        copy_engine.start(x, name)
    except RuntimeError as error:
        assert "no copy-engine transport" in str(error)
    else:
        raise AssertionError("an op ran on a closed mesh's group")
    assert build_mesh(ctx, ParallelPlan(ulysses=2)).copy_engine is None  # NCCL (gloo here): nothing to own

    # ParallelTransformer.restore() closes its mesh
    parallel = ParallelTransformer(torch.nn.Linear(1, 1), build_mesh(ctx, ParallelPlan(ulysses=2), "copy-engine"), [])
    assert copy_engine.transport_for(parallel.mesh.ulysses_group_name) is parallel.mesh.copy_engine
    parallel.restore()
    assert registry == {}
    parallel.restore()
    shutdown(ctx)


def test_the_mesh_registers_its_transport_and_close_unregisters_it() -> None:
    """On 2 gloo ranks: build_mesh registers the mesh's CopyEngineTransport under its groups' names,
    the CPU ops (gloo's collectives run at once) give the collectives' results through it, and
    close() (also through ParallelTransformer.restore()) unregisters it, once."""
    mp.spawn(_worker, args=(2, free_port()), nprocs=2, join=True)
