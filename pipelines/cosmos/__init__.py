"""The Cosmos-Predict2 family, one folder (docs/models.md, "Adding a model").

- record.py: its ModelFamily record and checkpoints (2B and 14B Video2World, the embedded tiny-cosmos);
- pipeline.py: its pipeline, diffusers' Cosmos2VideoToWorldPipeline's stages;
- parallel.py: its context-parallel adapter (the generic path by its own plan) and tensor-parallel weight split;
- torchvision_shim.py: the torchvision resize its transformer's forward calls, where torchvision is not installed;
- limits.py, inputs.py: what a request may ask, its transformer's inputs at one size.

The embedded tiny-cosmos's components are the training code's (training/tiny_models.py, training/cosmos.py).
"""
