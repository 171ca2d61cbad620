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
