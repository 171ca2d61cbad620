"""The Cosmos 3 family, one folder (docs/models.md, "Adding a model").

- record.py: its ModelFamily record and checkpoints (Nano and Super, video and image);
- pipeline.py: its pipeline, diffusers' Cosmos3OmniPipeline stages;
- parallel.py: its context-parallel adapter and tensor-parallel weight split (the text and vision streams);
- limits.py, inputs.py, tiny.py: what a request may ask, its transformer's inputs at one size, tiny checkpoints.
"""
