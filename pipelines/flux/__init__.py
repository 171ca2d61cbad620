"""The FLUX.1 family, one folder (docs/models.md, "Adding a model").

- record.py: its ModelFamily record and checkpoints (FLUX.1-dev, schnell, the embedded tiny-flux);
- pipeline.py: its pipeline, diffusers' FluxPipeline's stages;
- parallel.py: its context-parallel adapter (the generic path with its speed features) and tensor-parallel weight
  split, with attention.py (the attention processor, FLUX.2's double-stream blocks use it too) and blocks.py
  (single-stream blocks that overlap their MLP with the all-to-all);
- limits.py, inputs.py: what a request may ask, its transformer's inputs at one size.

The embedded tiny-flux's components are the training code's (training/tiny_models.py, training/flux.py).
"""
