"""FLUX.3 (diffusers' Flux3Transformer2DModel) on the generic context-parallel path (engines/parallel/generic.py).

diffusers 0.42 gives FLUX.3 no context-parallel plan, so this is ours. Every per-token input is split on
entry (the image tokens, the text tokens, the reference image's tokens, and their position ids); the
model's body then works on its shards as it is: each token's modulation, rotary table and embedding are its
own, and the joint blocks concatenate the three local shards exactly as the padded layout of three segments
concatenates them (engines.parallel.sharding.ShardLayout). What differs per block is what its attention attends: a
per-mode block one stream (text, image or reference image), a joint block all of them, text first. The image
tokens are gathered after the output projection.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from engines.parallel.generic import generic_adapter

_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3)
_IDS = ContextParallelInput(split_dim=0, expected_dims=2)

FLUX3_PLAN = {
    "": {"hidden_states": _TOKENS, "encoder_hidden_states": _TOKENS, "image_cond_hidden_states": _TOKENS,
         "img_ids": _IDS, "txt_ids": _IDS, "image_cond_ids": _IDS},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}

FLUX3_SEGMENTS = {
    "txt_mode_blocks": ("encoder_hidden_states",),
    "mode_blocks.image": ("hidden_states",),
    "mode_blocks.image_cond": ("image_cond_hidden_states",),
    "single_transformer_blocks": ("encoder_hidden_states", "hidden_states", "image_cond_hidden_states"),
}

parallelize_flux3 = generic_adapter(plan=FLUX3_PLAN, segments=FLUX3_SEGMENTS,
                                    shared=("img_ids", "txt_ids", "image_cond_ids"))
"""FLUX.3's parallelize function (pipelines.family.ModelFamily.parallelize)."""
