"""The DiT of one rank: sequence sharding, context-parallel attention and tensor-parallel weights for
diffusers transformers.

Map: options.py (every option's name and default; torch-free), distributed.py (process groups:
init_parallel, ParallelContext), plan.py (ParallelPlan: the degrees and the K/V exchange), mesh.py
(one group per axis), sharding.py (ShardLayout: who holds which tokens; entry and exit moves),
collectives.py (functional collectives), copy_engine.py (the exchanges on copy engines,
--all-to-all copy-engine), attention.py (where attention gets split: split_attention picks Ulysses,
Ring, AllGather or hybrid once per mesh, and every family's attention calls it), tensor_parallel.py
(where weights get split: --tp) + sharded_loading.py (each rank reads its share from safetensors),
flux.py + flux_attention.py + flux_blocks.py + flux_modulation.py,
cosmos.py, cosmos3.py, flux2.py (one adapter per model family, with its tensor-parallel split),
parallelize.py (the entry point), compile.py + cache.py (engines and their on-disk cache; compile_teardown.py:
what compiling leaves in a process, dropped as it ends).

    ctx = init_parallel()                                   # under torchrun, or a single process
    plan = ParallelPlan.auto(ctx.world_size, heads)
    transformer = parallelize_transformer(pipe.transformer, ctx, plan, parallelize_flux)
    out = transformer(**same_kwargs_as_diffusers)[0]        # full output on every rank

The package itself imports nothing, so that engines.options stays torch-free.
"""
