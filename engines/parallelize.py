"""Entry point: apply a ParallelPlan to a diffusers transformer (torchtitan's "parallelize" style)."""

from __future__ import annotations

from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from torch import nn

from engines.cosmos import parallelize_cosmos
from engines.distributed import ParallelContext
from engines.flux import parallelize_flux
from engines.mesh import build_mesh
from engines.plan import ParallelPlan
from engines.wrapper import ParallelTransformer


def parallelize_transformer(
    transformer: nn.Module, ctx: ParallelContext, plan: ParallelPlan | None = None, *, all_to_all: str = "nccl"
) -> ParallelTransformer:
    """Wrap `transformer` so that it runs across all ranks of `ctx` according to `plan`.

    Collective: every rank calls it with the same model architecture and plan. The result is
    called with exactly the diffusers model's keyword arguments and returns the full output on
    every rank. `plan=None` means ParallelPlan.auto(ctx.world_size, heads) (Ulysses, no CFG split).
    `all_to_all`: how the Ulysses all-to-alls and ring K/V exchanges travel, "nccl" or "copy-engine"
    (engines/copy_engine.py).
    """
    num_heads = transformer.config.num_attention_heads
    plan = plan or ParallelPlan.auto(ctx.world_size, num_heads)
    # Validate before build_mesh: a bad plan must fail on every rank before any collective.
    plan.check(world_size=ctx.world_size, num_heads=num_heads)
    if isinstance(transformer, FluxTransformer2DModel):
        return parallelize_flux(transformer, build_mesh(ctx, plan, all_to_all))
    if isinstance(transformer, CosmosTransformer3DModel):
        return parallelize_cosmos(transformer, build_mesh(ctx, plan, all_to_all))
    raise TypeError(
        f"no parallel plan for {type(transformer).__name__}; supported: FluxTransformer2DModel, "
        "CosmosTransformer3DModel"
    )
