"""Whole pipelines at N=2 gloo ranks equal the one-process result (image within 1/255, video too).

Rank 0 encodes and decodes, every rank denoises through the context-parallel transformer: the data
flow of the app, written out plainly here so the test depends on pipelines/ and engines/ only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from pipelines.factory import load_pipeline
from pipelines.registry import resolve_model
from pipelines.requests import make_request, read_limits
from tests.helpers import join_ranks, parallelize, spawn_ranks

CASES = {
    # name: (model, request fields, plan arguments)
    "flux-ulysses": ("tiny-flux", dict(prompt="a red circle", seed=11, steps=3, height=80, width=112),
                     dict(strategy="ulysses")),
    "flux-ring": ("tiny-flux", dict(prompt="a red circle", seed=11, steps=3, height=80, width=112),
                  dict(strategy="ring")),
    "flux-allgather": ("tiny-flux", dict(prompt="a red circle", seed=11, steps=3, height=80, width=112),
                       dict(strategy="allgather")),
    "cosmos-ulysses": ("tiny-cosmos", dict(prompt="a square moving up", seed=5, steps=3, frames=9, height=48,
                                           width=80), dict(strategy="ulysses")),
    "cosmos-cfg": ("tiny-cosmos", dict(prompt="a square moving up", seed=5, steps=3, frames=9, height=48,
                                       width=80), dict(strategy="ulysses", cfg=2)),
}


def request_for(model: str, fields: dict):
    spec, folder = resolve_model(model, None)
    return spec, folder, make_request(spec, read_limits(spec, folder), **fields)


def generate_one_process(model: str, fields: dict) -> np.ndarray:
    spec, folder, request = request_for(model, fields)
    return np.asarray(load_pipeline(spec, folder).generate(request))


def _rank(rank: int, world_size: int, port: int, case: str, out: str) -> None:
    join_ranks(rank, world_size, port)
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.plan import ParallelPlan

    model, fields, plan_args = CASES[case]
    ctx = init_parallel("cpu")
    spec, folder, request = request_for(model, fields)
    pipeline = load_pipeline(spec, folder, with_encoders=ctx.is_main)
    heads = pipeline.transformer_config.num_attention_heads
    plan = ParallelPlan.auto(world_size, heads, **plan_args)
    pipeline.use_transformer(parallelize(pipeline.transformer, ctx, plan))

    encoded = [pipeline.encode(request) if ctx.is_main else None]
    dist.broadcast_object_list(encoded, src=0, group=ctx.control_group)
    latents = pipeline.denoise(request, encoded[0])
    if ctx.is_main:
        np.save(out, np.asarray(pipeline.decode(request, latents)))
    shutdown(ctx)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_process(case: str, tmp_path: Path) -> None:
    out = tmp_path / "parallel.npy"
    spawn_ranks(_rank, 2, case, str(out))
    model, fields, _ = CASES[case]
    parallel = np.load(out).astype(np.int16)
    single = generate_one_process(model, fields).astype(np.int16)
    assert parallel.shape == single.shape
    assert np.abs(parallel - single).max() <= 1, f"max pixel difference {np.abs(parallel - single).max()}"
