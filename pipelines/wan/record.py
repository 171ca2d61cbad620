"""The Wan families' records (Wan 2.1 with Wan 2.2 A14B's two experts; Wan 2.2 TI2V): their checkpoints, their
published architectures, and where their code is."""

from __future__ import annotations

from pipelines.family import Architecture, BenchShapes, ModelFamily, ModelSpec

WAN22_VAE = dict(  # Wan2.2-TI2V-5B's VAE: 2x2 patchify then 8x convolutions (16x space), 4x time, z 48
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
    temperal_downsample=[False, True, True], in_channels=12, out_channels=12, patch_size=2, is_residual=True,
    scale_factor_spatial=16, scale_factor_temporal=4,
    # The checkpoint's per-channel latent statistics (48 values each) are not recorded here; these
    # neutral ones give random-weight benchmarks the right shapes.
    latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
)


# Wan 2.1 text-to-video: the Wan 2.1 VAE (8x space, 4x time), a UMT5-XXL text encoder, a DiT whose
# blocks cross-attend to the text; classifier-free guidance with two branches. The transformer configs
# are Wan-AI/Wan2.1-T2V-1.3B-Diffusers' and -14B-Diffusers' transformer/config.json; the negative prompt is
# the one diffusers' WanPipeline documentation uses (Wan's own, translated).
UMT5_XXL = dict(  # text_encoder of Wan 2.1: google/umt5-xxl's encoder (5.7B)
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6, dropout_rate=0.0, is_encoder_decoder=False, use_cache=False,
)


_WAN21_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)


WAN_NEGATIVE_PROMPT = (
    "Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, static, "
    "overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra fingers, poorly "
    "drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers, still picture, messy "
    "background, three legs, many people in the background, walking backwards"
)


def _wan21(**transformer: object) -> Architecture:
    # AutoencoderKLWan's defaults are the Wan 2.1 VAE (base_dim 96, z_dim 16).
    return Architecture(transformer={**_WAN21_TRANSFORMER, **transformer}, vae_class="diffusers:AutoencoderKLWan",
                        vae={}, text_encoders={"text_encoder": ("transformers:UMT5EncoderModel", UMT5_XXL)})


_WAN21 = dict(family="wan", media="video", checkpoint_class="WanPipeline", steps=50, guidance=5.0, frames=81, fps=16,
              negative_prompt=WAN_NEGATIVE_PROMPT)


CLIP_VIT_H = dict(  # image_encoder of Wan 2.1 image-to-video: open-clip ViT-H/14's vision tower
    hidden_size=1280, intermediate_size=5120, projection_dim=1024, num_hidden_layers=32, num_attention_heads=16,
    image_size=224, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-5,
)


_WAN21_I2V = Architecture(  # 16 latent + 4 mask + 16 image-latent input channels, CLIP image context
    transformer={**_WAN21_TRANSFORMER, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120,
                 "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
    vae_class="diffusers:AutoencoderKLWan", vae={},
    text_encoders={"text_encoder": ("transformers:UMT5EncoderModel", UMT5_XXL),
                   "image_encoder": ("transformers:CLIPVisionModel", CLIP_VIT_H)},
)


WAN = ModelFamily(
    name="wan",
    title="Wan 2.1, Wan 2.2 A14B",
    transformer="diffusers:WanTransformer3DModel",
    pipeline="pipelines.wan.pipeline:WanVideoPipeline",
    parallelize="engines.parallel.generic:parallelize_generic",  # driven by the class's diffusers _cp_plan
    repeated_blocks=("blocks",),
    block_outputs=(("hidden_states",),),
    limits="pipelines.wan.limits:wan_limits",
    guidance_batch=True,  # the two branches as one batch-2 call
    bench=BenchShapes(inputs="pipelines.wan.inputs:wan_inputs", sizes=("81x720x1280",),
                      tiny_sizes=("9x48x64",), video=True, batch=2, diffusers_parallel=True,
                      tiny_config="pipelines.wan.tiny:WAN_TINY_TRANSFORMER",
                      tiny_checkpoint="pipelines.wan.tiny:write_tiny_wan"),
    models=(
        ModelSpec(name="wan2.1-t2v-1.3b", folder="Wan2.1-T2V-1.3B-Diffusers", source="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                  height=480, width=832, architecture=_wan21(), **_WAN21),
        ModelSpec(name="wan2.1-t2v-14b", folder="Wan2.1-T2V-14B-Diffusers", source="Wan-AI/Wan2.1-T2V-14B-Diffusers",
                  height=720, width=1280, architecture=_wan21(num_attention_heads=40, ffn_dim=13824, num_layers=40),
                  **_WAN21),
        ModelSpec(name="wan2.1-i2v-14b", folder="Wan2.1-I2V-14B-720P-Diffusers",
                  source="Wan-AI/Wan2.1-I2V-14B-720P-Diffusers", height=720, width=1280, architecture=_WAN21_I2V,
                  **{**_WAN21, "checkpoint_class": "WanImageToVideoPipeline"}),
        # Wan 2.2 A14B: two experts of the 14B's architecture over the Wan 2.1 VAE (high noise, then low noise);
        # defaults as Wan-AI's model cards and diffusers' examples run them (40 steps; guidance 4.0 on the high-noise
        # expert and 3.0 on the low-noise one for text-to-video, 3.5 on both for image-to-video)
        ModelSpec(name="wan2.2-t2v-a14b", folder="Wan2.2-T2V-A14B-Diffusers", source="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                  height=720, width=1280, experts=2, guidance_2=3.0,
                  architecture=_wan21(num_attention_heads=40, ffn_dim=13824, num_layers=40),
                  **{**_WAN21, "steps": 40, "guidance": 4.0}),
        ModelSpec(name="wan2.2-i2v-a14b", folder="Wan2.2-I2V-A14B-Diffusers", source="Wan-AI/Wan2.2-I2V-A14B-Diffusers",
                  height=720, width=1280, experts=2, guidance_2=3.5,
                  architecture=_wan21(in_channels=36, num_attention_heads=40, ffn_dim=13824, num_layers=40),
                  **{**_WAN21, "checkpoint_class": "WanImageToVideoPipeline", "steps": 40, "guidance": 3.5}),
    ),
)


# Wan 2.2 TI2V-5B: the Wan 2.1 transformer class at 24 heads over the Wan 2.2 VAE's 48-channel latent (16x
# space), a timestep per token (expand_timesteps); its own family because its latent, and so a request's token
# count (the work estimate, the benchmarks), differs from Wan 2.1's. Its transformer config as
# Wan-AI/Wan2.2-TI2V-5B-Diffusers publishes it.
WAN22 = ModelFamily(
    name="wan22",
    title="Wan 2.2 TI2V",
    transformer="diffusers:WanTransformer3DModel",
    pipeline="pipelines.wan.pipeline:WanVideoPipeline",
    # the per-token timestep split with the tokens (_cp_plan)
    parallelize="engines.parallel.generic:parallelize_generic",
    repeated_blocks=("blocks",),
    block_outputs=(("hidden_states",),),
    limits="pipelines.wan.limits:wan_limits",
    guidance_batch=True,
    bench=BenchShapes(inputs="pipelines.wan.inputs:wan22_inputs", sizes=("121x704x1280",),
                      tiny_sizes=("9x64x96",), video=True, batch=2,
                      tiny_config="pipelines.wan.tiny:WAN_TINY_TRANSFORMER",
                      tiny_checkpoint="pipelines.wan.tiny:write_tiny_wan22"),
    models=(
        ModelSpec(name="wan2.2-ti2v-5b", family="wan22", media="video", checkpoint_class="WanPipeline",
                  folder="Wan2.2-TI2V-5B-Diffusers", source="Wan-AI/Wan2.2-TI2V-5B-Diffusers", height=704,
                  width=1280, steps=50, guidance=5.0, frames=121, fps=24, negative_prompt=WAN_NEGATIVE_PROMPT,
                  architecture=Architecture(
                      transformer={**_WAN21_TRANSFORMER, "num_attention_heads": 24, "in_channels": 48,
                                   "out_channels": 48, "ffn_dim": 14336},
                      vae_class="diffusers:AutoencoderKLWan", vae=WAN22_VAE,
                      text_encoders={"text_encoder": ("transformers:UMT5EncoderModel", UMT5_XXL)})),
    ),
)
