"""Peer gating and bookkeeping (benchmarks/peers.py) on CPU, without the peers' packages."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch._inductor.config as inductor_config
from diffusers import FluxTransformer2DModel

from benchmarks.inputs import BenchModel, build_random
from benchmarks.peers import PEERS, compiler_settings_restored, shared_copy, unavailable_reason
from engines.parallel.distributed import ParallelContext
from pipelines.registry import get_family
from tests.helpers import COSMOS_TINY, FLUX_TINY

FLUX = BenchModel(name="flux-tiny", family=get_family("flux"), config=FLUX_TINY)
COSMOS = BenchModel(name="cosmos-tiny", family=get_family("cosmos"), config=COSMOS_TINY)

CPU_ALONE = ParallelContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), group=None,
                            control_group=None)


def test_unavailable_reasons_on_one_cpu_rank() -> None:
    spec = FLUX
    for peer in PEERS.values():
        reason = unavailable_reason(peer, CPU_ALONE, spec)
        if importlib.util.find_spec(peer.package) is None:
            assert reason == f"{peer.title} is not installed (no module {peer.package!r})"
        else:  # installed here: xDiT still needs CUDA, cache-dit still needs 2 ranks
            assert reason is not None and ("CUDA" in reason or "2 or more ranks" in reason)
        assert "not measured on Cosmos-style models" in unavailable_reason(peer, CPU_ALONE, COSMOS)


def test_shared_copy_shares_the_weights_and_computes_the_same() -> None:
    spec = FLUX
    model = build_random(spec, device=torch.device("cpu"), dtype=torch.float32)
    copy = shared_copy(FluxTransformer2DModel, spec, model)
    assert copy is not model
    for (name, a), (_, b) in zip(model.named_parameters(), copy.named_parameters()):
        assert a.data_ptr() == b.data_ptr(), name
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, 3, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(3, 3), guidance=torch.tensor([3.5]),
                  return_dict=False)
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], copy(**inputs)[0])


def settings() -> tuple:
    overlap = inductor_config.reorder_for_compute_comm_overlap
    passes = list(inductor_config.reorder_for_compute_comm_overlap_passes)
    return overlap, passes, inductor_config.coordinate_descent_tuning, torch.get_float32_matmul_precision()


def test_compiler_settings_are_restored_even_after_an_error() -> None:
    before = settings()
    with pytest.raises(RuntimeError), compiler_settings_restored():
        inductor_config.reorder_for_compute_comm_overlap = not before[0]
        inductor_config.reorder_for_compute_comm_overlap_passes = ["sink_waits"]
        inductor_config.coordinate_descent_tuning = not before[2]
        torch.set_float32_matmul_precision("medium" if before[3] != "medium" else "high")
        raise RuntimeError("a peer failed while compiling")
    assert settings() == before
