"""Context-parallel FLUX.1, FLUX.2 and Cosmos-Predict2 on spawned gloo ranks (CPU, float32) against one process, each
by its record's adapter; restore() leaves the model as it was.

FLUX.2's inputs are laid out as Flux2Pipeline lays them out: the latent's tokens with ids (0, row, column, 0), text
ids (0, 0, 0, position), and for image editing a reference image's tokens appended to the latent's with their own
time coordinate.
"""

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
# (text tokens, latent rows x columns, reference rows x columns or None)
FLUX2_SHAPES = [(7, (5, 3), None), (5, (3, 5), (3, 3))]
FLUX2_TINY = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=6,
    joint_attention_dim=32, timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4),
)


def _ids(rows: int, cols: int, t: int) -> torch.Tensor:
    ids = torch.zeros(rows, cols, 4)
    ids[..., 0] = t
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(-1, 4)


def flux2_inputs(text: int, latent: tuple[int, int], reference: tuple[int, int] | None, batch: int = 2) -> dict:
    """Flux2Transformer2DModel keyword arguments; with a reference, its tokens follow the latent's (t = 10)."""
    img_ids = _ids(*latent, 0)
    if reference is not None:
        img_ids = torch.cat([img_ids, _ids(*reference, 10)])
    txt_ids = torch.zeros(text, 4)
    txt_ids[:, 3] = torch.arange(text)
    return dict(hidden_states=torch.randn(batch, img_ids.shape[0], 16),
                encoder_hidden_states=torch.randn(batch, text, 32), timestep=torch.rand(batch), img_ids=img_ids,
                txt_ids=txt_ids, guidance=torch.full((batch,), 4.0), return_dict=False)


def _model(name: str) -> torch.nn.Module:
    if name == "cosmos":
        return tiny_cosmos()
    if name == "flux2":
        from diffusers import Flux2Transformer2DModel

        return Flux2Transformer2DModel(**FLUX2_TINY)
    model = tiny_flux()
    if name == "flux-fused":  # diffusers' fused q/k/v projections (fuse_qkv_projections)
        model.fuse_qkv_projections()
    return model


def _inputs(name: str, shape: tuple) -> dict:
    return {"cosmos": cosmos_inputs, "flux2": flux2_inputs}.get(name, flux_inputs)(*shape)


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
        out += [("cosmos", plan, (shape,)) for shape in COSMOS_SHAPES]
        out += [("flux2", plan, shape) for shape in FLUX2_SHAPES]
        if world_size == 2:
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
            models[name] = randomize(_model(name))
        model = models[name]
        torch.manual_seed(1)
        kwargs = _inputs(name, shape)
        with torch.no_grad():
            expected = model(**kwargs)[0]
            parallel = parallelize(model, ctx, plan)
            got = parallel(**kwargs)[0]
            parallel.restore()
            again = model(**kwargs)[0]
        results.append(dict(model=name, plan=plan.label, shape=repr(shape), same_shape=got.shape == expected.shape,
                            err=(got - expected).abs().max().item(), scale=expected.abs().max().item(),
                            restored=(again - expected).abs().max().item()))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_parallel_matches_single_process(world_size: int, tmp_path: Path) -> None:
    spawn_ranks(_worker, world_size, str(tmp_path))
    for rank in range(world_size):
        ran = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(ran) == len(cases(world_size))
        for r in ran:
            case = f"{r['model']} {r['plan']} shape {r['shape']} on rank {rank}"
            assert r["same_shape"], case
            assert r["scale"] > 0.01, f"{case}: output too small to compare ({r['scale']:.3g})"
            assert r["err"] <= TOLERANCE, f"{case}: max error {r['err']:.3g}"
            assert r["restored"] == 0.0, f"{case}: restore() left the model changed"
