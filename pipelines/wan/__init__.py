"""The Wan families, one folder (docs/models.md, "Adding a model"): Wan 2.1 (with Wan 2.2 A14B's two experts) and
Wan 2.2 TI2V share diffusers' WanTransformer3DModel and this pipeline.

- record.py: their ModelFamily records and checkpoints;
- pipeline.py: their pipeline, diffusers' WanPipeline and WanImageToVideoPipeline stages;
- limits.py, inputs.py, tiny.py: what a request may ask, the transformer's inputs at one size, tiny checkpoints.

Their parallel plan and weight split are the generic path's (engines.parallel.generic), as the records name them.
"""
