"""The FLUX.2 family, one folder (docs/models.md, "Adding a model").

- record.py: its ModelFamily record and checkpoints (dev, Klein, Klein base);
- pipeline.py: its pipeline, diffusers' Flux2Pipeline and Flux2KleinPipeline stages;
- parallel.py: its context-parallel adapter (the generic path) and tensor-parallel weight split;
- limits.py, inputs.py, tiny.py: what a request may ask, its transformer's inputs at one size, tiny checkpoints.
"""
