"""The GPU benchmark harness, apart from the product (random weights of the real architectures; no download).

- step.py: one transformer forward, 1 GPU against every plan on N ranks, diffusers-native Ulysses and
  peers (`torchrun -m benchmarks.step`, or `ulysses-studio bench`).
- generation.py: whole generations through our pipelines and lockstep service, stage by stage
  (`torchrun -m benchmarks.generation`, or `ulysses-studio bench --end-to-end`).
- peers.py: xDiT and cache-dit on the same FLUX weights, set up and compiled as their runners do.
- inputs.py: sizes and random weights of a registered architecture (call arguments: the builder its family's
  record names, pipelines.transformer_inputs).
- cli.py: `python -m benchmarks`, also run by `ulysses-studio bench` (torchrun around step or generation, and a
  PNG chart). The app never imports this package (tests/test_structure.py).
- tiny_speed.py: seconds of one generation by an embedded tiny model on this machine's CPU, stage by stage
  (`python -m benchmarks.tiny_speed`).
- trace_overlap.py: compute against NCCL time, and kernel time by kind, in a profile that step wrote.
- scaling_sweep.sh: every model, plan and GPU count in one command.
- multi_gpu.sh: the 2-GPU figures, regressions, app check, new models, tensor parallelism and FP8, in four
  commands of under 10 minutes (PART=1 to 4), and the scaling sweep on 4 or 8 GPUs in one (GPUS=4
  PART=sweep); TINY=1 on CPU.
- checks/: the acceptance checks that need GPUs (each file says how to run it): acceptance.py (the app's
  own commands on GPUs, each checked for its output, its exit and what it leaves), copy_engine_vs_nccl.py (copy-engine
  exchanges equal NCCL's, and their timing), engine_cache_diff.py (what differs between two engine caches).
"""
