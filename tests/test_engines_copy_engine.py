"""The copy-engine all-to-all transport (engines/copy_engine.py): what is refused, and where.

Its results through FLUX, eager and compiled on 2 gloo ranks, are checked beside NCCL's in
tests/test_engines_flux_overlap.py; GPU runs (against NCCL on 2 H200s, and speed) are in
docs/benchmarks.md.
"""

from __future__ import annotations

import pytest
import torch

from test_engines_parallel import tiny_flux


def test_unknown_transport_is_refused_before_any_collective() -> None:
    from engines import ParallelPlan, init_parallel, parallelize_transformer

    ctx = init_parallel("cpu")  # no torchrun here: one process, no process group at all
    with pytest.raises(ValueError, match="unknown all-to-all transport 'carrier-pigeon'.*copy-engine"):
        parallelize_transformer(tiny_flux(), ctx, ParallelPlan(), all_to_all="carrier-pigeon")


def test_copy_engine_needs_one_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.copy_engine import check_transport

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="one host"):
        check_transport("copy-engine", object(), torch.device("cuda", 0))
    check_transport("nccl", object(), torch.device("cuda", 0))
    check_transport("copy-engine", None, torch.device("cuda", 0))  # one process: nothing to move


def test_a_grown_buffer_stays_mapped_for_the_graphs_captured_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """When a bigger shape needs a bigger exchange buffer, the old one is released (every rank past
    its last use) but kept: a CUDA graph captured on it holds its addresses and the peers', and a
    server replays that graph when a request of the smaller shape comes back. Freeing it would leave
    that replay waiting on flags in freed memory. (The real buffers are symmetric memory, GPU only.)"""
    from engines import copy_engine

    class FakeExchange:
        def __init__(self, group_name: str, data_bytes: int, device: torch.device) -> None:
            self.data_bytes, self.released = data_bytes, False

        def release(self) -> None:
            self.released = True

    monkeypatch.setattr(copy_engine, "_Exchange", FakeExchange)
    monkeypatch.setattr(copy_engine, "_exchanges", {})
    monkeypatch.setattr(copy_engine, "_retired", [])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # no CUDA here
    cpu = torch.device("cpu")
    small = copy_engine._exchange("group", "gather", 100, cpu)
    assert copy_engine._exchange("group", "gather", 80, cpu) is small  # fits: no new buffer
    big = copy_engine._exchange("group", "gather", 200, cpu)
    assert big is not small and big.data_bytes == 200
    assert small.released and copy_engine._retired == [small]  # released, still referenced
    assert copy_engine._exchange("group", "gather", 100, cpu) is big  # smaller shapes use the big one
    assert copy_engine._exchange("group", "slots", 100, cpu) is not big  # one buffer per kind
