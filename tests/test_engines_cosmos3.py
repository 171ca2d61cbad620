"""Context-parallel Cosmos 3 (pipelines/cosmos3/parallel.py) on spawned gloo ranks (CPU, float32) against one process.

The tiny config (pipelines.cosmos3.tiny.COSMOS3_TINY_TRANSFORMER) has 24 query heads over 2 K/V heads, so Ulysses over
3, 4 and 8 ranks runs with repeated K/V heads. Inputs are packed by diffusers' Cosmos3OmniPipeline
helpers: text-to-video, image-to-video (first latent frame clean) and text-to-image, with gen token
counts (after 2x2 patching of odd latent sizes) that the sequence degrees do not divide.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import cosmos3_inputs, join_ranks, randomize, spawn_ranks, tiny_cosmos3

TOLERANCE = 1e-5

# (text tokens, latent frames x height x width, image condition)
SHAPES = {"t2v": (7, (3, 3, 5), False), "i2v": (5, (2, 2, 6), True), "t2i": (6, (1, 4, 3), False)}


def plans(world_size: int) -> list:
    from engines.parallel.plan import ParallelPlan

    heads = 24
    out = [ParallelPlan.auto(world_size, heads, strategy=s) for s in ("ulysses", "ring", "allgather")]
    if world_size == 2:
        out.append(ParallelPlan(cfg=2))
    if world_size == 4:
        out += [
            ParallelPlan(strategy="ulysses-ring", ulysses=2, ring=2),
            ParallelPlan(strategy="ulysses", ulysses=2, cfg=2),
            ParallelPlan(strategy="ring", ring=2, cfg=2),
            ParallelPlan(strategy="allgather", ring=2, cfg=2),
        ]
    if world_size == 8:
        out = [ParallelPlan.auto(8, heads, strategy="ulysses"),
               ParallelPlan(strategy="ulysses-ring", ulysses=2, ring=2, cfg=2)]
    return out


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank: every plan of this world size, every input shape; errors to rank<i>.json."""
    join_ranks(rank, world_size, port)
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.parallelize import parallelize_transformer
    from pipelines.cosmos3.parallel import parallelize_cosmos3

    ctx = init_parallel("cpu")
    torch.manual_seed(0)
    models = {"qk-norm": randomize(tiny_cosmos3()),
              "und-k-norm-for-gen": randomize(tiny_cosmos3(qk_norm_for_text=False, use_und_k_norm_for_gen=True))}
    results = []
    for plan in plans(ctx.world_size):
        for name, model in models.items():
            if name != "qk-norm" and ctx.world_size != 2:
                continue
            for shape, (text, grid, image) in SHAPES.items():
                torch.manual_seed(1)
                cond = cosmos3_inputs(model, text, grid, image_condition=image)
                uncond = cosmos3_inputs(model, text - 2, grid, image_condition=image)  # guidance: other text
                with torch.no_grad():
                    expected = [model(**kwargs, return_dict=False)[0][0] for kwargs in (cond, uncond)]
                    parallel = parallelize_transformer(model, ctx, plan, parallelize_cosmos3)
                    if plan.cfg > 1:
                        got = [preds[0] for preds in parallel.forward_guided([cond, uncond])]
                    else:
                        got = [parallel(**kwargs, return_dict=False)[0][0] for kwargs in (cond, uncond)]
                    parallel.restore()
                results.append(dict(
                    model=name, plan=plan.label, shape=shape,
                    same_shape=all(g.shape == e.shape for g, e in zip(got, expected)),
                    err=max((g - e).abs().max().item() for g, e in zip(got, expected)),
                    scale=max(e.abs().max().item() for e in expected),
                ))
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_cosmos3_parallel_matches_single_process(world_size: int, tmp_path: Path) -> None:
    spawn_ranks(_worker, world_size, str(tmp_path))
    count = 0
    for rank in range(world_size):
        for r in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            case = f"{r['model']} {r['plan']} {r['shape']} on rank {rank}"
            assert r["same_shape"], case
            assert r["scale"] > 0.01, f"{case}: output too small to compare ({r['scale']:.3g})"
            assert r["err"] <= TOLERANCE, f"{case}: max error {r['err']:.3g}"
            count += 1
    assert count == world_size * len(plans(world_size)) * len(SHAPES) * (2 if world_size == 2 else 1)


def test_kv_repeat_gives_whole_kv_heads_per_rank() -> None:
    from engines.parallel.attention import kv_repeat

    assert [kv_repeat(8, u) for u in (1, 2, 4, 8)] == [1, 1, 1, 1]  # Nano: 8 K/V heads
    assert kv_repeat(8, 3) == 3 and kv_repeat(2, 8) == 4 and kv_repeat(2, 3) == 3
