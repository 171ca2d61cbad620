"""Entry point: apply a ParallelPlan to a diffusers transformer (torchtitan's "parallelize" style).

Which adapter a transformer takes is its model family's choice (pipelines.families: each family's
record names its parallelize function); engines/ knows no families.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from engines.options import DEFAULT_TRANSPORT
from engines.parallel.distributed import ParallelContext
from engines.parallel.mesh import ParallelMesh, build_mesh
from engines.parallel.plan import ParallelPlan
from engines.parallel.wrapper import ParallelTransformer

Adapter = Callable[[nn.Module, ParallelMesh], ParallelTransformer]
"""A model's parallelize function, e.g. pipelines.flux.parallel.parallelize_flux."""


def parallelize_transformer(
    transformer: nn.Module,
    ctx: ParallelContext,
    plan: ParallelPlan | None,
    adapter: Adapter,
    *,
    all_to_all: str = DEFAULT_TRANSPORT,
) -> ParallelTransformer:
    """Wrap `transformer` with `adapter` so that it runs across all ranks of `ctx` according to `plan`.

    Collective: every rank calls it with the same model architecture and plan. The result is
    called with exactly the diffusers model's keyword arguments and returns the full output on
    every rank. `plan=None` means ParallelPlan.auto(ctx.world_size, heads) (Ulysses, no CFG split).
    `all_to_all`: how the exchanges travel, "nccl" or "copy-engine" (engines/parallel/copy_engine.py).
    """
    num_heads = transformer.config.num_attention_heads
    plan = plan or ParallelPlan.auto(ctx.world_size, num_heads)
    # Validate before build_mesh: a bad plan must fail on every rank before any collective.
    plan.check(world_size=ctx.world_size, num_heads=num_heads)
    return adapter(transformer, build_mesh(ctx, plan, all_to_all))


def shared_weights_copy(module: nn.Module) -> nn.Module:
    """A second module tree like `module` whose parameters and buffers are `module`'s own tensors: no weight is
    copied. One rank can then hold the same transformer under several plans (an adapter changes the tree it is
    given: processors, blocks, modulation), e.g. as one group of every rank and as smaller groups side by side.
    Made before either tree is parallelized or compiled; what each plan adds (engines, CUDA graphs) is its own."""
    memo: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for tensor in (*sub._parameters.values(), *sub._buffers.values(), *vars(sub).values()):
            if isinstance(tensor, torch.Tensor):
                memo[id(tensor)] = tensor
    return copy.deepcopy(module, memo)
