"""Tensor parallelism (engines/parallel/tensor_parallel.py), alone and with Ulysses, ring or CFG, on spawned gloo ranks
(CPU, float32) against one process, for each family's tiny transformer.

The tiny configs have 8 query heads (FLUX.1, Cosmos, FLUX.2: split by tp 2 and 4, and by tp 2 x
ulysses 2) and Cosmos 3's 24 query heads over 2 K/V heads (tp 4 keeps each K/V head on two ranks).
Each plan splits a fresh copy of the reference model: split weights are not put back. At tp 2 FLUX's
blocks are also compiled (fullgraph, aot_eager): the row-parallel all-reduce traces into each block's graph.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    COSMOS_TINY,
    FLUX_TINY,
    cosmos3_inputs,
    cosmos_inputs,
    flux_inputs,
    join_ranks,
    parallelize,
    randomize,
    spawn_ranks,
    tiny_cosmos3,
)

TOLERANCE = 1e-5
FAMILIES = ("flux", "cosmos", "flux2", "cosmos3")


def plans(world_size: int) -> list:
    from engines.parallel.plan import ParallelPlan

    if world_size == 2:
        return [ParallelPlan(tp=2)]
    return [ParallelPlan(tp=4), ParallelPlan(ulysses=2, tp=2), ParallelPlan(strategy="ring", ring=2, tp=2),
            ParallelPlan(cfg=2, tp=2)]


def tiny_model(family: str) -> torch.nn.Module:
    """The family's tiny transformer with 8 query heads (Cosmos 3: its own 24 over 2 K/V heads), random weights."""
    from diffusers import CosmosTransformer3DModel, Flux2Transformer2DModel, FluxTransformer2DModel

    from pipelines.flux2.tiny import FLUX2_TINY_TRANSFORMER

    torch.manual_seed(0)
    if family == "flux":
        model = FluxTransformer2DModel(**{**FLUX_TINY, "num_attention_heads": 8})
    elif family == "cosmos":
        model = CosmosTransformer3DModel(**{**COSMOS_TINY, "num_attention_heads": 8, "concat_padding_mask": False,
                                            "extra_pos_embed_type": "learnable"})
    elif family == "flux2":
        model = Flux2Transformer2DModel(**{**FLUX2_TINY_TRANSFORMER, "num_attention_heads": 8,
                                           "joint_attention_dim": 32})
    else:
        model = tiny_cosmos3()
    return randomize(model)


def model_calls(family: str, model: torch.nn.Module) -> list[dict]:
    """Keyword arguments of the reference calls; token counts that the sequence degrees do not divide."""
    from tests.test_engines_parallel import flux2_inputs

    torch.manual_seed(1)
    if family == "flux":
        return [flux_inputs((3, 4), 5)]
    if family == "cosmos":
        return [cosmos_inputs((3, 3, 5))]
    if family == "flux2":
        return [flux2_inputs(7, (5, 3), None, batch=2)]
    return [cosmos3_inputs(model, 7, (3, 3, 5)), cosmos3_inputs(model, 5, (3, 3, 5))]  # guidance: two texts


def output(family: str, module: torch.nn.Module, kwargs: dict) -> torch.Tensor:
    """The prediction of one call (Cosmos 3 returns one per modality: its vision one)."""
    if family == "cosmos3":
        return module(**kwargs, return_dict=False)[0][0]
    return module(**kwargs)[0]


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    join_ranks(rank, world_size, port)
    from engines.parallel.distributed import init_parallel, shutdown

    ctx = init_parallel("cpu")
    results = []
    for family in FAMILIES:
        reference = tiny_model(family)
        calls = model_calls(family, reference)
        with torch.no_grad():
            expected = [output(family, reference, kwargs) for kwargs in calls]
            for plan in plans(world_size):
                model = copy.deepcopy(reference)
                whole = sum(p.numel() for p in model.parameters())
                parallel = parallelize(model, ctx, plan)
                kept = sum(p.numel() for p in model.parameters())
                if family == "cosmos3" and plan.cfg > 1:  # its two guidance calls on two rank groups
                    got = [preds[0] for preds in parallel.forward_guided(calls)]
                else:
                    got = [output(family, parallel, kwargs) for kwargs in calls]
                if family == "flux" and world_size == 2:  # the row-parallel all-reduce traces into per-block graphs
                    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
                        block.compile(backend="aot_eager", fullgraph=True)
                    compiled = [output(family, parallel, kwargs) for kwargs in calls]
                    got = [torch.stack((g, c)) for g, c in zip(got, compiled)]
                    expected_here = [torch.stack((e, e)) for e in expected]
                else:
                    expected_here = expected
                results.append(dict(
                    family=family, plan=plan.label, kept=kept / whole,
                    same_shape=all(g.shape == e.shape for g, e in zip(got, expected_here)),
                    err=max((g - e).abs().max().item() for g, e in zip(got, expected_here)),
                    scale=max(e.abs().max().item() for e in expected)))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_single_process(world_size: int, tmp_path: Path) -> None:
    spawn_ranks(_worker, world_size, str(tmp_path))
    count = 0
    for rank in range(world_size):
        for r in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            case = f"{r['family']} {r['plan']} on rank {rank}"
            assert r["same_shape"], case
            assert r["scale"] > 0.01, f"{case}: output too small to compare ({r['scale']:.3g})"
            assert r["err"] <= TOLERANCE, f"{case}: max error {r['err']:.3g}"
            assert r["kept"] < 0.9, f"{case}: the rank kept {r['kept']:.0%} of the parameters"
            count += 1
    assert count == world_size * len(plans(world_size)) * len(FAMILIES)


def test_packed_and_replicated_splits_keep_whole_parts() -> None:
    from engines.parallel.tensor_parallel import LinearSplit

    # FLUX.2's fused single-stream projection: [q, k, v, gate, up], each part split on its own
    packed = LinearSplit(style="column", blocks=(4, 4, 4, 8, 8))
    assert packed.ranges(28, 2, 1) == [(2, 2), (6, 2), (10, 2), (16, 4), (24, 4)]
    # 2 K/V heads of width 8 over 4 ranks: ranks 0-1 keep head 0, ranks 2-3 head 1
    key_value = LinearSplit(style="column", replicas=2)
    assert [key_value.ranges(16, 4, rank) for rank in range(4)] == [[(0, 8)], [(0, 8)], [(8, 8)], [(8, 8)]]
    with pytest.raises(ValueError, match="tp degree 3 does not divide a split layer's part of 4"):
        packed.ranges(28, 3, 0)
    with pytest.raises(ValueError, match="do not add up"):
        packed.ranges(30, 2, 0)


def test_a_split_that_does_not_divide_is_refused_before_any_change() -> None:
    from pipelines.cosmos3.parallel import cosmos3_weights

    model = tiny_cosmos3()  # 24 query heads, 2 K/V heads
    with pytest.raises(ValueError, match="tp degree 3 neither divides nor is a multiple of the model's 2 K/V heads"):
        cosmos3_weights(model, 3)


def test_splitting_frees_each_whole_weight_as_its_share_replaces_it(monkeypatch) -> None:
    """In place on a GPU the whole model and its shares never live side by side: a 60 GiB model split for tp 2
    needs 60 GiB plus one layer's share, not 90 GiB."""
    import gc
    import weakref

    from engines.parallel import tensor_parallel
    from pipelines.flux.parallel import flux_weights

    model = tiny_model("flux")
    split = flux_weights(model, 2)
    whole = {name: weakref.ref(model.get_submodule(name).weight) for name in split.linears}
    done: list[str] = []
    still_alive: list[str] = []
    split_linear = tensor_parallel._split_linear

    def watched(linear, *args, **kwargs):
        # when a layer is split, every layer split before it must have let its whole weight go
        still_alive.extend(name for name in done if whole[name]() is not None)
        done.append(next(name for name, ref in whole.items() if ref() is linear.weight))
        return split_linear(linear, *args, **kwargs)

    monkeypatch.setattr(tensor_parallel, "_split_linear", watched)
    gc.disable()  # freed by reference counting alone, as CUDA memory is, not by a later collection
    try:
        tensor_parallel.split_weights(model, split, tp=2, rank=0)
    finally:
        gc.enable()
    assert len(done) == len(whole) > 10 and still_alive == []


def test_a_model_split_for_one_degree_is_refused_for_another() -> None:
    from engines.parallel.tensor_parallel import RowParallelLinear, split_weights
    from pipelines.flux.parallel import flux_weights

    model = tiny_model("flux")
    whole = sum(p.numel() for p in model.parameters())
    split_weights(model, flux_weights(model, 2), tp=2, rank=1)
    assert isinstance(model.single_transformer_blocks[0].proj_out, RowParallelLinear)
    assert model.transformer_blocks[0].attn.heads == 4 and sum(p.numel() for p in model.parameters()) < whole
    with pytest.raises(ValueError, match="this model was split for tp 2, not 4"):
        split_weights(model, flux_weights(model, 4), tp=4, rank=1)
    with pytest.raises(RuntimeError, match="no tp group"):  # split for loading, not parallelized yet
        proj_out = model.single_transformer_blocks[0].proj_out
        proj_out(torch.zeros(1, 2, proj_out.in_features))
