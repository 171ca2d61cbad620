"""--fp8 with --tp (engines/levers/fp8.py, engines/parallel/tensor_parallel.py) on spawned gloo ranks against one FP8
process, for each family's tiny transformer (tests/test_engines_tensor_parallel.py's models, random weights).

Each rank splits a copy of the model as sharded loading does (its tp rank's shares), quantizes it with the run's
group, then parallelizes it. Its FP8 weights are then one process's, bit for bit: a column-parallel layer's rows
and scales, a row-parallel layer's columns and the scales of the whole rows (which a shard's own maxima would not
give). The outputs differ from one FP8 process by float32 summation order, as without FP8, and the few FP8
roundings that it flips; the control, shards quantized with their own maxima, is off by about FP8's whole error.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import join_ranks, spawn_ranks
from tests.test_engines_tensor_parallel import FAMILIES, model_calls, output, tiny_model

NOISE = 5e-4
"""Largest output difference (relative to the output's largest value) from one FP8 process: float32 summation
order, and the few FP8 roundings it flips. Measured (tp 2, and tp 2 x ulysses 2): 6.7e-5 at most (Cosmos; the
others below 1e-6). Weight scales from each shard's own maxima, the control: 0.004-0.09, about FP8's own error."""


def _model(family: str) -> torch.nn.Module:
    """tests/test_engines_tensor_parallel.py's tiny model; Cosmos 3's with 16-wide heads, so that a rank's K/V
    projection (one K/V head) still has rows enough for an FP8 GEMM (multiples of 16, engines.levers.fp8)."""
    from tests.helpers import randomize, tiny_cosmos3

    if family != "cosmos3":
        return tiny_model(family)
    torch.manual_seed(0)
    return randomize(tiny_cosmos3(head_dim=16, rope_axes_dim=(4, 2, 2)))


def _family(model: torch.nn.Module):
    from pipelines.family import load
    from pipelines.registry import FAMILIES as RECORDS

    return next(f for f in RECORDS.values() if isinstance(model, load(f.transformer)))


def _split_and_quantize(reference: torch.nn.Module, plan, rank: int, group) -> torch.nn.Module:
    """A copy of `reference` as the app makes it on this rank: loaded split (its tp share), then FP8."""
    from engines.levers.fp8 import quantize_fp8
    from engines.parallel.tensor_parallel import split_weights
    from pipelines.family import load

    family = _family(reference)
    model = copy.deepcopy(reference)
    split_weights(model, load(family.tensor_parallel)(model, plan.tp), tp=plan.tp, rank=rank % plan.tp)
    quantize_fp8(model, family.repeated_blocks, group=group)
    return model


def _same_fp8_bytes(model: torch.nn.Module, whole: torch.nn.Module, tp: int, tp_rank: int) -> tuple[int, list[str]]:
    """(FP8 layers compared, names whose FP8 data or scales are not one process's share of them): a column-parallel
    layer's rows (data and scale) are rows of one process's layer; a row-parallel layer has one process's scales
    and the rank's columns of each of its packed parts."""
    from engines.parallel.tensor_parallel import RowParallelLinear

    compared, different = 0, []
    for name, module in model.named_modules():
        mine = _fp8_bytes(module)
        if mine is None:
            continue
        reference = _fp8_bytes(whole.get_submodule(name))
        if reference is None:
            different.append(f"{name} (not FP8 in one process)")
            continue
        (data, scale), (my_data, my_scale) = reference, mine
        if isinstance(module, RowParallelLinear):
            parts = _row_parts(name, whole, tp)
            kept = torch.cat([data[:, start + tp_rank * (size // tp):start + (tp_rank + 1) * (size // tp)]
                              for start, size in parts], dim=1)
            ok = torch.equal(my_scale, scale) and kept.shape[1] == my_data.shape[1] and torch.equal(kept, my_data)
        else:
            rows = {tuple(r.tolist()): s.item() for r, s in zip(data, scale)}
            ok = all(rows.get(tuple(r.tolist())) == s.item() for r, s in zip(my_data, my_scale))
        compared += 1
        if not ok:
            different.append(name)
    return compared, different


def _fp8_bytes(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An FP8 layer's float8 weight as bytes [out, in] and its per-row scales [out, 1], in either of quantize_fp8's
    forms (an Fp8Linear or a row-parallel layer with a float8 weight; torchao's Float8Tensor); None if not FP8."""
    from engines.levers.fp8 import is_fp8

    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or not is_fp8(weight):
        return None
    if weight.dtype == torch.float8_e4m3fn:
        return weight.view(torch.uint8), layer.weight_scale
    return weight.qdata.view(torch.uint8), weight.scale


def _row_parts(name: str, whole: torch.nn.Module, tp: int) -> list[tuple[int, int]]:
    """(start, size) of the packed input parts of row-parallel layer `name` (one part for most)."""
    from pipelines.family import load

    split = load(_family(whole).tensor_parallel)(whole, tp).linears[name]
    sizes = split.parts(whole.get_submodule(name).weight.shape[1])
    return [(sum(sizes[:index]), size) for index, size in enumerate(sizes)]


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    join_ranks(rank, world_size, port)
    from engines.levers.fp8 import quantize_fp8
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.plan import ParallelPlan
    from tests.helpers import parallelize

    ctx = init_parallel("cpu")
    plan = ParallelPlan(tp=2) if world_size == 2 else ParallelPlan(ulysses=2, tp=2)
    alone = [torch.distributed.new_group([r]) for r in range(world_size)][ctx.rank]
    results = []
    for family in FAMILIES:
        reference = _model(family)
        calls = model_calls(family, reference)
        one_process = copy.deepcopy(reference)
        quantize_fp8(one_process, _family(reference).repeated_blocks)
        unfused = copy.deepcopy(reference)  # a split model's projections stay apart: the same rows and scales
        layers = quantize_fp8(unfused, _family(reference).repeated_blocks, fuse=False)
        with torch.no_grad():
            expected = [output(family, one_process, kwargs) for kwargs in calls]
            exact = [output(family, reference, kwargs) for kwargs in calls]
            model = _split_and_quantize(reference, plan, ctx.rank, ctx.group)
            compared, different = _same_fp8_bytes(model, unfused, plan.tp, ctx.rank % plan.tp)
            got = [output(family, parallelize(model, ctx, plan), kwargs) for kwargs in calls]
            # the control: weight scales from each shard's own maxima (a group of this rank alone)
            shard_scaled = _split_and_quantize(reference, plan, ctx.rank, alone)
            shard_got = [output(family, parallelize(shard_scaled, ctx, plan), kwargs) for kwargs in calls]
        scale = max(e.abs().max().item() for e in expected)
        results.append(dict(
            family=family, plan=plan.label, layers=layers, compared=compared, different=different,
            err=max((g - e).abs().max().item() for g, e in zip(got, expected)) / scale,
            shard_err=max((g - e).abs().max().item() for g, e in zip(shard_got, expected)) / scale,
            fp8_err=max((x - e).abs().max().item() for x, e in zip(exact, expected)) / scale))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


@pytest.mark.parametrize("world_size", [2, 4], ids=["tp2", "tp2xulysses2"])
def test_fp8_with_tp_equals_one_fp8_process(world_size: int, tmp_path: Path) -> None:
    spawn_ranks(_worker, world_size, str(tmp_path))
    for rank in range(world_size):
        for r in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            case = f"{r['family']} {r['plan']} on rank {rank}"
            print(f"{case}: {r['compared']} of {r['layers']} FP8 layers compared; off one FP8 process by "
                  f"{r['err']:.2g}, with the shards' own weight scales by {r['shard_err']:.2g} (FP8 itself is off "
                  f"float32 by {r['fp8_err']:.2g})")
            assert r["layers"] > 0 and r["compared"] == r["layers"], case
            assert r["different"] == [], f"{case}: FP8 weights that are not one process's: {r['different']}"
            assert r["err"] <= NOISE, f"{case}: off one FP8 process by {r['err']:.3g}"
            assert r["shard_err"] > NOISE, f"{case}: the control (the shards' own scales) is within the bound"


def test_a_split_model_is_quantized_with_its_group_only() -> None:
    """Without the group a row-parallel shard could only take its own maxima: refused, not approximated."""
    from engines.levers.fp8 import quantize_fp8
    from engines.parallel.tensor_parallel import split_weights
    from pipelines.flux.parallel import flux_weights

    model = tiny_model("flux")
    split_weights(model, flux_weights(model, 2), tp=2, rank=0)
    with pytest.raises(ValueError, match="needs its process group"):
        quantize_fp8(model, ("transformer_blocks", "single_transformer_blocks"))
