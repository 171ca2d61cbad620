"""ParallelPlan, ShardLayout and single-process behaviour of the parallel layer (no ranks spawned)."""

from __future__ import annotations

import pytest
import torch

from engines.parallel.distributed import ParallelContext
from engines.parallel.plan import ParallelPlan
from engines.parallel.sharding import ShardLayout
from pipelines.cosmos.torchvision_shim import install as install_torchvision_shim
from pipelines.cosmos.torchvision_shim import resize_padding_mask
from tests.helpers import COSMOS_TINY, flux_inputs, parallelize, randomize, tiny_flux


@pytest.mark.parametrize(
    ("world_size", "heads", "strategy", "cfg", "expected"),
    [
        (8, 24, "ulysses", 1, ParallelPlan(ulysses=8)),  # FLUX: 24 / 8 = 3 heads per rank
        (2, 24, "ulysses", 1, ParallelPlan(ulysses=2)),
        (3, 16, "ulysses", 1, ParallelPlan(strategy="ring", ring=3)),  # Cosmos-2B: 3 divides nothing
        (6, 16, "ulysses", 1, ParallelPlan(strategy="ulysses-ring", ulysses=2, ring=3)),
        (8, 40, "ulysses", 1, ParallelPlan(ulysses=8)),  # Cosmos-14B
        (6, 40, "ulysses", 1, ParallelPlan(strategy="ulysses-ring", ulysses=2, ring=3)),
        (4, 16, "ulysses", 2, ParallelPlan(ulysses=2, cfg=2)),
        (2, 16, "ulysses", 2, ParallelPlan(cfg=2)),
        (4, 24, "ring", 1, ParallelPlan(strategy="ring", ring=4)),
        (4, 24, "allgather", 2, ParallelPlan(strategy="allgather", ring=2, cfg=2)),
        (8, 24, "ulysses-ring", 1, ParallelPlan(ulysses=8)),  # hybrid not needed: plain ulysses
        (1, 24, "ulysses", 1, ParallelPlan()),
    ],
    ids=lambda value: value.label if isinstance(value, ParallelPlan) else None,
)
def test_auto(world_size: int, heads: int, strategy: str, cfg: int, expected: ParallelPlan) -> None:
    plan = ParallelPlan.auto(world_size, heads, strategy=strategy, cfg=cfg)
    assert plan == expected
    plan.check(world_size=world_size, num_heads=heads)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(strategy="tree"), "unknown strategy"),
        (dict(ulysses=0), "positive integer"),
        (dict(ulysses=2, ring=2), "uses no ring axis"),
        (dict(strategy="ring", ulysses=2, ring=2), "uses no ulysses axis"),
        (dict(strategy="ulysses-ring", ulysses=2), "needs ulysses >= 2 and ring >= 2"),
    ],
)
def test_invalid_plans(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelPlan(**kwargs)


def test_check_against_ranks_and_heads() -> None:
    with pytest.raises(ValueError, match="2 ranks, but 4 are running"):
        ParallelPlan(ulysses=2).check(world_size=4, num_heads=24)
    with pytest.raises(ValueError, match="does not divide the model's 16 attention heads"):
        ParallelPlan(ulysses=3).check(world_size=3, num_heads=16)
    with pytest.raises(ValueError, match="cfg degree 2 does not divide the 3 ranks"):
        ParallelPlan.auto(3, 24, cfg=2)


def test_shard_layout_runs() -> None:
    layout = ShardLayout(lengths=(5, 7), degree=3)  # chunks 2 and 3, local length 5
    assert layout.local_length == 5 and layout.padded
    assert [layout.valid(0, s) for s in range(3)] == [2, 2, 1]
    assert [layout.valid(1, s) for s in range(3)] == [3, 3, 1]
    assert layout.valid_runs([0, 1]) == ((0, 10),)
    assert layout.valid_runs([2]) == ((0, 1), (2, 1))
    assert layout.valid_runs([0, 1, 2]) == ((0, 11), (12, 1))
    assert ShardLayout(lengths=(2,), degree=3).valid_runs([2]) == ()
    assert not ShardLayout(lengths=(4, 8), degree=4).padded


def test_resize_padding_mask_is_nearest() -> None:
    mask = torch.arange(16.0).reshape(1, 1, 4, 4)
    assert torch.equal(resize_padding_mask(mask, (2, 2)), mask[..., ::2, ::2])
    assert resize_padding_mask(mask.bfloat16(), [8, 8]).dtype == torch.bfloat16


def test_single_process_wrapper_is_the_model() -> None:
    """World size 1: the wrapper runs the model unchanged (Cosmos' padding-mask resize without torchvision through
    its family's transformer_setup, as the app installs it)."""
    from diffusers import CosmosTransformer3DModel

    from pipelines.cosmos.inputs import cosmos_inputs
    from pipelines.transformer_inputs import Shape

    ctx = ParallelContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), group=None,
                          control_group=None)
    torch.manual_seed(0)
    model = randomize(tiny_flux())
    kwargs = flux_inputs((5, 3), 5)
    with torch.no_grad():
        assert torch.equal(parallelize(model, ctx)(**kwargs)[0], model(**kwargs)[0])
    install_torchvision_shim()
    model = randomize(CosmosTransformer3DModel(**COSMOS_TINY))
    kwargs, _ = cosmos_inputs(COSMOS_TINY, Shape(frames=9, height=32, width=48, text_tokens=5), batch=2,
                              device=ctx.device, dtype=torch.float32)
    with torch.no_grad():
        out = parallelize(model, ctx)(**kwargs)[0]
    assert out.shape == kwargs["hidden_states"].shape and torch.isfinite(out).all()


def test_plan_is_checked_before_the_adapter_runs() -> None:
    from engines.parallel.parallelize import parallelize_transformer

    ctx = ParallelContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), group=None,
                          control_group=None)
    called = []
    with pytest.raises(ValueError, match="but 1 are running"):
        parallelize_transformer(tiny_flux(), ctx, ParallelPlan(ulysses=2), lambda model, mesh: called.append(mesh))
    assert not called


def test_plan_names_its_kv_exchange() -> None:
    assert ParallelPlan(strategy="ring", ring=2).label == "ring-2"
    assert ParallelPlan(strategy="allgather", ring=2).label == "allgather-2"
    assert ParallelPlan(strategy="ulysses-ring", ulysses=2, ring=2, cfg=2).label == "cfg-2xulysses-2xring-2"
    assert ParallelPlan().label == "1"
    assert ParallelPlan(strategy="allgather", ring=2).describe("copy-engine") == "allgather-2, all-to-all copy-engine"
    assert ParallelPlan(cfg=2).describe("copy-engine") == "cfg-2"  # nothing for a transport to carry
    assert ParallelPlan(strategy="ring", ring=2).kv_exchange == "ring"
    assert ParallelPlan(strategy="allgather", ring=2).kv_exchange == "allgather"


def test_shard_tokens_pads_and_batch_checks() -> None:
    from engines.parallel.mesh import ParallelMesh
    from engines.parallel.sharding import check_batch, shard_tokens, split_batch

    layout = ShardLayout(lengths=(5,), degree=3)
    x = torch.arange(5.0).reshape(1, 5, 1)
    shards = [shard_tokens(x, layout, segment=0, shard=s, dim=1).flatten().tolist() for s in range(3)]
    assert shards == [[0.0, 1.0], [2.0, 3.0], [4.0, 0.0]]
    with pytest.raises(ValueError, match="expected 5 tokens along dim 1"):
        shard_tokens(torch.zeros(1, 4, 1), layout, segment=0, shard=0, dim=1)

    mesh = ParallelMesh(plan=ParallelPlan(cfg=2), device_mesh=None, ulysses_group=None, ring_group=None,
                        cfg_group=None, ulysses_rank=0, ring_rank=0, cfg_rank=1)
    with pytest.raises(ValueError, match="cfg degree 2 needs a batch divisible by 2"):
        check_batch(3, mesh)
    assert split_batch(torch.arange(4.0), mesh, batch=4).tolist() == [2.0, 3.0]
    assert split_batch(torch.ones(1, 3), mesh, batch=4).shape == (1, 3)  # batch-1 tensors broadcast
    with pytest.raises(ValueError, match="leading batch dimension of 4"):
        split_batch(torch.ones(3), mesh, batch=4)


def test_tensor_parallel_degree_in_the_plan() -> None:
    plan = ParallelPlan(ulysses=2, tp=2, cfg=2)
    assert plan.world_size == 8 and plan.seq_degree == 2 and plan.label == "cfg-2xulysses-2xtp-2"
    with pytest.raises(ValueError, match="tp degree must be a positive integer"):
        ParallelPlan(tp=0)
    with pytest.raises(ValueError, match="tp degree 4 does not divide the model's 6 attention heads"):
        ParallelPlan(tp=4).check(world_size=4, num_heads=6)
    with pytest.raises(ValueError, match="heads must divide by tp x ulysses"):
        ParallelPlan(ulysses=4, tp=2).check(world_size=8, num_heads=12)
    assert ParallelPlan.auto(8, 24, tp=2) == ParallelPlan(ulysses=4, tp=2)
    assert ParallelPlan.auto(8, 6, tp=2) == ParallelPlan(strategy="ring", ring=4, tp=2)  # 3 heads per tp rank
    assert ParallelPlan.auto(8, 24, tp=2, cfg=2) == ParallelPlan(ulysses=2, cfg=2, tp=2)
    with pytest.raises(ValueError, match="tp degree 3 does not divide the 8 ranks"):
        ParallelPlan.auto(8, 24, tp=3)
