"""The DiT of one rank: sequence sharding, context-parallel attention, tensor-parallel weights and the speed levers for
diffusers transformers, in three rooms:

- parallel/: distributed.py (process groups: init_parallel, ParallelContext), plan.py (ParallelPlan: the degrees and
  the K/V exchange), mesh.py (one group per axis), sharding.py (ShardLayout: who holds which tokens; entry and exit
  moves), collectives.py (functional collectives), copy_engine.py (the exchanges on copy engines, --all-to-all
  copy-engine), attention.py (where attention gets split: split_attention picks Ulysses, Ring, AllGather or hybrid
  once per mesh, and every family's attention calls it), tensor_parallel.py (where weights get split: --tp),
  generic.py (any transformer with a declared split plan), wrapper.py and parallelize.py (the entry point).
- levers/: compile.py + cache.py (engines and their on-disk cache; compile_teardown.py: what compiling leaves in a
  process, dropped as it ends), fp8.py + fp8_matmul.py (--fp8), quantized_attention.py +
  quantized_attention_triton.py (--attention-precision), step_cache.py (--cache).
- weights/: sharded_loading.py (each tp rank reads its share from safetensors), lora.py (--lora).

options.py (every option's name and default) and import_noise.py stay at the top: both are torch-free, for the
launcher. A family's own adapter lives in its folder (pipelines/<family>/parallel.py).

    ctx = init_parallel()                                   # under torchrun, or a single process
    plan = ParallelPlan.auto(ctx.world_size, heads)
    transformer = parallelize_transformer(pipe.transformer, ctx, plan, parallelize_flux)
    out = transformer(**same_kwargs_as_diffusers)[0]        # full output on every rank

The package itself imports nothing, so that engines.options stays torch-free.
"""
