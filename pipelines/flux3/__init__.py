"""The FLUX.3 family, one folder (docs/models.md, "Adding a model").

- record.py: its ModelFamily record and checkpoints (base and distilled Klein);
- pipeline.py: its pipeline, diffusers' FLUX.3 modular blocks' stages;
- parallel.py: its context-parallel plan on the generic path (per-mode blocks, then joint blocks);
- limits.py, inputs.py, tiny.py: what a request may ask, its transformer's inputs at one size, tiny checkpoints.
"""
