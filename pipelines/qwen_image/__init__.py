"""The Qwen-Image family, one folder: what adding a family is (docs/models.md, "Adding a model").

- record.py: its ModelFamily record and checkpoints (pipelines.families lists it; the registry registers it);
- pipeline.py: its pipeline, diffusers' QwenImagePipeline and editing pipelines' stages;
- limits.py: what a request may ask of it (sizes, the reference image an editing checkpoint requires);
- inputs.py: its transformer's keyword arguments at one size (the benchmarks, the work estimate);
- tiny.py: tiny random checkpoints of each of its pipeline classes (tests, CPU benchmarks).

Its parallel plan and weight split are the generic path's (engines.parallel.generic), as the record names them.
"""
