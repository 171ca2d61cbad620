"""The DiT of one rank: sequence sharding and context-parallel attention for diffusers transformers."""

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
