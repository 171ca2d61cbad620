"""Context-parallel FLUX.2 (pipelines/flux2/parallel.py) on spawned gloo ranks (CPU, float32) against one process.

The tiny config has 6 heads (split by 2 and 3 ranks), two double- and two single-stream blocks, and
FLUX.2's four rotary axes. Inputs are laid out as Flux2Pipeline lays them out: the latent's tokens
with ids (0, row, column, 0), text ids (0, 0, 0, position), and for image editing a reference
image's tokens appended to the latent's with their own time coordinate. Token counts are chosen so
that the sequence degrees do not divide them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import join_ranks, randomize, spawn_ranks

TOLERANCE = 1e-5
FLUX2_TINY = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=6,
    joint_attention_dim=32, timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4),
)

# (text tokens, latent rows x columns, reference rows x columns or None)
SHAPES = {"text-only": (7, (5, 3), None), "reference-image": (5, (3, 5), (3, 3))}


def _ids(rows: int, cols: int, t: int) -> torch.Tensor:
    ids = torch.zeros(rows, cols, 4)
    ids[..., 0] = t
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(-1, 4)


def flux2_inputs(text: int, latent: tuple[int, int], reference: tuple[int, int] | None, batch: int) -> dict:
    """Flux2Transformer2DModel keyword arguments; with a reference, its tokens follow the latent's (t = 10)."""
    img_ids = _ids(*latent, 0)
    if reference is not None:
        img_ids = torch.cat([img_ids, _ids(*reference, 10)])
    txt_ids = torch.zeros(text, 4)
    txt_ids[:, 3] = torch.arange(text)
    return dict(
        hidden_states=torch.randn(batch, img_ids.shape[0], 16), encoder_hidden_states=torch.randn(batch, text, 32),
        timestep=torch.rand(batch), img_ids=img_ids, txt_ids=txt_ids, guidance=torch.full((batch,), 4.0),
        return_dict=False,
    )


def plans(world_size: int) -> list:
    from engines.parallel.plan import ParallelPlan

    out = [ParallelPlan.auto(world_size, 6, strategy=s) for s in ("ulysses", "ring", "allgather")]
    if world_size == 2:
        out.append(ParallelPlan(cfg=2))
    if world_size == 4:
        out += [ParallelPlan(strategy="ulysses-ring", ulysses=2, ring=2),
                ParallelPlan(strategy="ulysses", ulysses=2, cfg=2), ParallelPlan(strategy="allgather", ring=2, cfg=2)]
    return out


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank: every plan of this world size, every input shape; results to rank<i>.json."""
    join_ranks(rank, world_size, port)
    from diffusers import Flux2Transformer2DModel

    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.parallelize import parallelize_transformer
    from pipelines.flux2.parallel import parallelize_flux2

    ctx = init_parallel("cpu")
    torch.manual_seed(0)
    model = randomize(Flux2Transformer2DModel(**FLUX2_TINY))
    results = []
    for plan in plans(ctx.world_size):
        for shape, (text, latent, reference) in SHAPES.items():
            torch.manual_seed(1)
            kwargs = flux2_inputs(text, latent, reference, batch=2)
            with torch.no_grad():
                expected = model(**kwargs)[0]
                parallel = parallelize_transformer(model, ctx, plan, parallelize_flux2)
                got = parallel(**kwargs)[0]
                parallel.restore()
            results.append(dict(plan=plan.label, shape=shape, same_shape=got.shape == expected.shape,
                                err=(got - expected).abs().max().item(), scale=expected.abs().max().item()))
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_flux2_parallel_matches_single_process(world_size: int, tmp_path: Path) -> None:
    spawn_ranks(_worker, world_size, str(tmp_path))
    count = 0
    for rank in range(world_size):
        for r in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            case = f"{r['plan']} {r['shape']} on rank {rank}"
            assert r["same_shape"], case
            assert r["scale"] > 0.01, f"{case}: output too small to compare ({r['scale']:.3g})"
            assert r["err"] <= TOLERANCE, f"{case}: max error {r['err']:.3g}"
            count += 1
    assert count == world_size * len(plans(world_size)) * len(SHAPES)


def test_restore_gives_back_diffusers_processors() -> None:
    from diffusers import Flux2Transformer2DModel

    from engines.parallel.distributed import ParallelContext
    from engines.parallel.mesh import build_mesh
    from engines.parallel.plan import ParallelPlan
    from pipelines.flux2.parallel import parallelize_flux2

    model = Flux2Transformer2DModel(**FLUX2_TINY)
    before = [type(p).__name__ for p in model.attn_processors.values()]
    ctx = ParallelContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), group=None,
                          control_group=None)
    parallelize_flux2(model, build_mesh(ctx, ParallelPlan(), "nccl")).restore()
    assert [type(p).__name__ for p in model.attn_processors.values()] == before
