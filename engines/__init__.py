"""The DiT of one rank: sequence sharding and context-parallel attention for diffusers transformers.

Map: distributed.py (process groups: init_parallel, ParallelContext), plan.py (ParallelPlan: the
degrees), mesh.py (one group per axis), sharding.py (ShardLayout: who holds which tokens; entry
and exit moves), collectives.py (functional collectives), copy_engine.py (the exchanges on copy
engines, --all-to-all copy-engine), attention.py (where attention gets
split: Ulysses, Ring, AllGather-KV, hybrid), flux.py / cosmos.py (one adapter per model),
parallelize.py (the entry point), specs.py + benchmark.py (named architectures, GPU benchmark).

    ctx = init_parallel()                                   # under torchrun, or a single process
    transformer = parallelize_transformer(pipe.transformer, ctx, ParallelPlan.auto(ctx.world_size, heads))
    out = transformer(**same_kwargs_as_diffusers)[0]        # full output on every rank
"""

from engines.attention import context_parallel_attention
from engines.cosmos import ParallelCosmos, parallelize_cosmos, resize_padding_mask
from engines.distributed import ParallelContext, init_parallel, shutdown
from engines.flux import ParallelFlux, parallelize_flux
from engines.mesh import ParallelMesh, build_mesh
from engines.parallelize import parallelize_transformer
from engines.plan import ParallelPlan
from engines.sharding import ShardLayout
from engines.wrapper import ParallelTransformer

__all__ = [
    "ParallelContext",
    "ParallelCosmos",
    "ParallelFlux",
    "ParallelMesh",
    "ParallelPlan",
    "ParallelTransformer",
    "ShardLayout",
    "build_mesh",
    "context_parallel_attention",
    "init_parallel",
    "parallelize_cosmos",
    "parallelize_flux",
    "parallelize_transformer",
    "resize_padding_mask",
    "shutdown",
]
