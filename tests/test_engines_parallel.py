"""Context-parallel FLUX and Cosmos on spawned gloo ranks (CPU, float32) against one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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

TOLERANCE = 1e-5


# (model, plan kwargs, input kwargs) per world size; token counts deliberately include ones
# that the sequence degree does not divide, and a shard made only of padding.
FLUX_SHAPES = [((3, 4), 5), ((2, 5), 3), ((1, 2), 2)]
COSMOS_SHAPES = [(3, 3, 5), (2, 2, 5), (1, 2, 2)]


def cases(world_size: int) -> list[tuple[str, dict, tuple]]:
    from engines.parallel.plan import ParallelPlan

    plans = [ParallelPlan.auto(world_size, 6, strategy=s) for s in ("ulysses", "ring", "allgather")]
    if world_size == 2:
        plans.append(ParallelPlan(cfg=2))
    if world_size == 4:
        plans = [
            ParallelPlan(strategy="ulysses-ring", ulysses=2, ring=2),
            ParallelPlan(strategy="ulysses", ulysses=2, cfg=2),
            ParallelPlan(strategy="ring", ring=2, cfg=2),
            ParallelPlan(strategy="allgather", ring=2, cfg=2),
        ]
    if world_size == 8:
        # The scaling sweep's layouts: the hybrid auto picks for 6 heads (ulysses 2 x ring 4),
        # pure ring and allgather, and cfg 2 x (ulysses 2 x ring 2).
        plans = [
            ParallelPlan.auto(8, 6, strategy="ulysses"),
            ParallelPlan.auto(8, 6, strategy="ring"),
            ParallelPlan.auto(8, 6, strategy="allgather"),
            ParallelPlan.auto(8, 6, strategy="ulysses", cfg=2),
        ]
    out = []
    for plan in plans:
        out += [("flux", plan, shape) for shape in FLUX_SHAPES]
        out += [("cosmos", plan, shape) for shape in COSMOS_SHAPES]
        if world_size == 2:  # FLUX with diffusers' fused q/k/v projections (fuse_qkv_projections)
            out.append(("flux-fused", plan, FLUX_SHAPES[0]))
    return out


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    join_ranks(rank, world_size, port)
    from engines.parallel.distributed import init_parallel, shutdown

    ctx = init_parallel("cpu")
    results = []
    models = {}
    for name, plan, shape in cases(world_size):
        if name not in models:
            torch.manual_seed(0)
            models[name] = randomize(tiny_cosmos() if name == "cosmos" else tiny_flux())
            if name == "flux-fused":
                models[name].fuse_qkv_projections()
        model = models[name]
        torch.manual_seed(1)
        kwargs = cosmos_inputs(shape) if name == "cosmos" else flux_inputs(*shape)
        with torch.no_grad():
            expected = model(**kwargs)[0]
            parallel = parallelize(model, ctx, plan)
            got = parallel(**kwargs)[0]
            parallel.restore()
        results.append(dict(model=name, plan=plan.label, shape=repr(shape), same_shape=got.shape == expected.shape,
                            err=(got - expected).abs().max().item(), scale=expected.abs().max().item()))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_parallel_matches_single_process(world_size: int, tmp_path: Path) -> None:
    spawn_ranks(_worker, world_size, str(tmp_path))
    for rank in range(world_size):
        for r in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            case = f"{r['model']} {r['plan']} shape {r['shape']} on rank {rank}"
            assert r["same_shape"], case
            assert r["err"] <= TOLERANCE, f"{case}: max error {r['err']:.3g}"
