"""The Qwen-Image family's record: its checkpoints, their published architectures, and where its code is."""

from __future__ import annotations

from dataclasses import replace

from pipelines.family import Architecture, BenchShapes, ModelFamily, ModelSpec

# Qwen-Image: a double-stream DiT (text and image tokens in one attention, text first) with Qwen2.5-VL-7B's
# last hidden layer as its text, its own one-frame Wan-2.1-style VAE, classifier-free guidance as two calls
# (true_cfg_scale) with a negative prompt. The configs are Qwen/Qwen-Image's transformer/config.json (the
# class's defaults) and Qwen2.5-VL-7B-Instruct's; " " is the negative prompt Qwen-Image's examples use.
_QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)
_QWEN25_VL_7B = dict(  # Qwen-Image's text_encoder: Qwen2_5_VLForConditionalGeneration (text 7B, vision tower 0.7B)
    text_config=dict(model_type="qwen2_5_vl_text", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     max_position_embeddings=128000,
                     rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu",
                     rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
    tie_word_embeddings=False,
)
QWEN_IMAGE_ARCHITECTURE = Architecture(
    transformer=_QWEN_IMAGE_TRANSFORMER,
    vae_class="diffusers:AutoencoderKLQwenImage", vae={},  # its defaults are Qwen-Image's VAE (z 16, 8x)
    text_encoders={"text_encoder": ("transformers:Qwen2_5_VLForConditionalGeneration", _QWEN25_VL_7B)},
)

QWEN_IMAGE = ModelFamily(
    name="qwen-image",
    title="Qwen-Image",
    transformer="diffusers:QwenImageTransformer2DModel",
    pipeline="pipelines.qwen_image.pipeline:QwenImageImagePipeline",
    parallelize="engines.parallel.generic:parallelize_joint",  # text and image tokens split, joined text-first
    repeated_blocks=("transformer_blocks",),
    block_outputs=(("encoder_hidden_states", "hidden_states"),),
    limits="pipelines.qwen_image.limits:qwen_image_limits",
    guidance_batch=True,  # two calls of their own text lengths (no mask: no shared batch), on two rank groups
    guidance_calls=True,  # with --cfg-parallel (forward_guided)
    bench=BenchShapes(inputs="pipelines.qwen_image.inputs:qwen_image_inputs", sizes=("1328x1328",),
                      tiny_sizes=("64x64", "80x48"), diffusers_parallel=True,
                      tiny_config="pipelines.qwen_image.tiny:QWEN_IMAGE_TINY_TRANSFORMER",
                      tiny_checkpoint="pipelines.qwen_image.tiny:write_tiny_qwen_image"),
    models=(
        ModelSpec(name="qwen-image", family="qwen-image", media="image", checkpoint_class="QwenImagePipeline",
                  folder="Qwen-Image", source="Qwen/Qwen-Image", height=1328, width=1328, steps=50, guidance=4.0,
                  negative_prompt=" ", architecture=QWEN_IMAGE_ARCHITECTURE),
        # Qwen-Image-Edit: the same transformer (zero_cond_t off) and encoder (its vision tower now used), the
        # reference image as its input; the defaults are its model card's (50 steps, true_cfg_scale 4, " ").
        ModelSpec(name="qwen-image-edit", family="qwen-image", media="image", checkpoint_class="QwenImageEditPipeline",
                  folder="Qwen-Image-Edit", source="Qwen/Qwen-Image-Edit", height=1024, width=1024, steps=50,
                  guidance=4.0, negative_prompt=" ", architecture=QWEN_IMAGE_ARCHITECTURE),
        # Qwen-Image-Edit-2509 and -2511 (QwenImageEditPlusPipeline): the vision tower sees the reference at about
        # 384², the VAE at about 1024²; 2511's transformer gives the reference's tokens timestep 0 (zero_cond_t,
        # which tells the two folders apart); defaults as diffusers' examples run them (40 steps, true_cfg_scale 4)
        ModelSpec(name="qwen-image-edit-2509", family="qwen-image", media="image",
                  checkpoint_class="QwenImageEditPlusPipeline", folder="Qwen-Image-Edit-2509",
                  source="Qwen/Qwen-Image-Edit-2509", height=1024, width=1024, steps=40, guidance=4.0,
                  negative_prompt=" ", architecture=replace(QWEN_IMAGE_ARCHITECTURE, transformer={
                      **_QWEN_IMAGE_TRANSFORMER, "zero_cond_t": False})),
        ModelSpec(name="qwen-image-edit-2511", family="qwen-image", media="image",
                  checkpoint_class="QwenImageEditPlusPipeline", folder="Qwen-Image-Edit-2511",
                  source="Qwen/Qwen-Image-Edit-2511", height=1024, width=1024, steps=40, guidance=4.0,
                  negative_prompt=" ", architecture=replace(QWEN_IMAGE_ARCHITECTURE, transformer={
                      **_QWEN_IMAGE_TRANSFORMER, "zero_cond_t": True})),
    ),
)
