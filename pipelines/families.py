"""The model families this product runs, one record each (pipelines.family says what a record holds).

The architectures are the published diffusers configs: FLUX.1-dev's components, the
Cosmos-Predict2 Video2World transformers as written by diffusers' convert_cosmos_to_diffusers.py
("Cosmos-2.0-Diffusion-2B/14B-Video2World") with their T5-11B encoder and Wan 2.1 VAE, and Cosmos 3
Nano and Super with the Wan 2.2 VAE, and FLUX.2 dev and Klein, Wan 2.1 text- and image-to-video (its CLIP
ViT-H/14 image encoder as the I2V folder's image_encoder config has it), Wan 2.2 TI2V-5B and A14B (each expert the
Wan 2.1 14B's architecture) and Qwen-Image (with
Qwen2.5-VL-7B's config) as their transformer/config.json files have them. A Cosmos 3 checkpoint makes videos and images:
its video name serves videos (5 frames and more) and its "-image" name, the same folder, one-frame images.
"""

from __future__ import annotations

from pipelines.family import Architecture, BenchShapes, ModelFamily, ModelSpec
from pipelines.flux3.record import FLUX3
from pipelines.qwen_image.record import QWEN_IMAGE

CLIP_L = dict(  # text_encoder of FLUX.1-dev: CLIP ViT-L/14's text tower
    vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
    num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
    bos_token_id=0, eos_token_id=2, pad_token_id=1,
)
T5_V1_1_XXL = dict(  # text_encoder_2 of FLUX.1-dev (4.8B as an encoder)
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6, dropout_rate=0.0, tie_word_embeddings=False, is_encoder_decoder=False,
    use_cache=False,
)
T5_11B = dict(  # text_encoder of Cosmos-Predict2 (google-t5/t5-11b's encoder, 4.8B): d_model 1024 = text_embed_dim
    vocab_size=32128, d_model=1024, d_kv=128, d_ff=65536, num_layers=24, num_heads=128,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="relu",
    layer_norm_epsilon=1e-6, dropout_rate=0.0, is_encoder_decoder=False, use_cache=False,
)

FLUX_DEV = Architecture(
    transformer=dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ),
    vae_class="diffusers:AutoencoderKL",
    vae=dict(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
        act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611,
        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
        force_upcast=True,
    ),
    text_encoders={"text_encoder": ("transformers:CLIPTextModel", CLIP_L),
                   "text_encoder_2": ("transformers:T5EncoderModel", T5_V1_1_XXL)},
)

FLUX = ModelFamily(
    name="flux",
    title="FLUX-style",
    transformer="diffusers:FluxTransformer2DModel",
    pipeline="pipelines.flux:FluxImagePipeline",
    parallelize="engines.flux:parallelize_flux",
    generic_parallelize="engines.flux:parallelize_flux_generic",
    tensor_parallel="engines.flux:flux_weights",
    repeated_blocks=("transformer_blocks", "single_transformer_blocks"),
    block_outputs=(("encoder_hidden_states", "hidden_states"), ("encoder_hidden_states", "hidden_states")),
    cache_stream="hidden_states",
    limits="pipelines.requests:flux_limits",
    guidance_batch=False,  # guidance-distilled: one branch
    bench=BenchShapes(inputs="pipelines.transformer_inputs:flux_inputs", sizes=("1024x1024", "2048x2048"),
                      tiny_sizes=("64x64", "80x48"), peers=("xdit", "cache-dit"), diffusers_parallel=True),
    models=(
        ModelSpec(name="flux-dev", family="flux", media="image", checkpoint_class="FluxPipeline",
                  folder="FLUX.1-dev", source="black-forest-labs/FLUX.1-dev", height=1024, width=1024, steps=28,
                  guidance=3.5, architecture=FLUX_DEV),
        ModelSpec(name="flux-schnell", family="flux", media="image", checkpoint_class="FluxPipeline",
                  folder="FLUX.1-schnell", source="black-forest-labs/FLUX.1-schnell", height=1024, width=1024,
                  steps=4, guidance=0.0, max_sequence_length=256),
        ModelSpec(name="tiny-flux", family="flux", media="image", checkpoint_class="FluxPipeline",
                  folder="tiny-flux", source="embedded", height=256, width=256, steps=8, guidance=3.5,
                  max_sequence_length=64, embedded=True,
                  examples=("a big red circle in the center on a white background",
                            "a small blue star at the top left on a yellow background",
                            "a green triangle at the bottom right on a black background",
                            "a big purple diamond on a gray background")),
    ),
)

COSMOS_NEGATIVE_PROMPT = (
    "The video captures a series of frames showing ugly scenes, static with no motion, motion blur, "
    "over-saturation, shaky footage, low resolution, grainy texture, pixelated images, poorly lit areas, "
    "underexposed and overexposed scenes, poor color balance, washed out colors, choppy sequences, "
    "jerky movements, low frame rate, artifacting, color banding, unnatural transitions, outdated special effects, "
    "fake elements, unconvincing visuals, poorly edited content, jump cuts, visual noise, and flickering. "
    "Overall, the video is of poor quality."
)

_COSMOS_PREDICT2_TRANSFORMER = dict(
    in_channels=16 + 1,  # latent channels + the Video2World condition-mask channel
    out_channels=16,
    attention_head_dim=128,
    mlp_ratio=4.0,
    text_embed_dim=1024,
    adaln_lora_dim=256,
    max_size=(128, 240, 240),
    patch_size=(1, 2, 2),
    concat_padding_mask=True,
    extra_pos_embed_type=None,
)


def _cosmos_predict2(**transformer: object) -> Architecture:
    # AutoencoderKLWan's defaults are the Wan 2.1 VAE (base_dim 96, z_dim 16) that Cosmos-Predict2 uses.
    return Architecture(transformer={**_COSMOS_PREDICT2_TRANSFORMER, **transformer},
                        vae_class="diffusers:AutoencoderKLWan", vae={},
                        text_encoders={"text_encoder": ("transformers:T5EncoderModel", T5_11B)})


_COSMOS_VIDEO = dict(family="cosmos", media="video", checkpoint_class="Cosmos2VideoToWorldPipeline", height=704,
                     width=1280, steps=35, guidance=7.0, frames=93, fps=16, negative_prompt=COSMOS_NEGATIVE_PROMPT)

COSMOS = ModelFamily(
    name="cosmos",
    title="Cosmos-style",
    transformer="diffusers:CosmosTransformer3DModel",
    pipeline="pipelines.cosmos:CosmosPipeline",
    parallelize="engines.cosmos:parallelize_cosmos",
    tensor_parallel="engines.cosmos:cosmos_weights",
    repeated_blocks=("transformer_blocks",),
    block_outputs=(("hidden_states",),),
    cache_stream="hidden_states",
    limits="pipelines.requests:cosmos_limits",
    guidance_batch=True,
    transformer_setup="pipelines.torchvision_shim:install",  # its forward calls torchvision's resize
    bench=BenchShapes(inputs="pipelines.transformer_inputs:cosmos_inputs", sizes=("93x704x1280",),
                      tiny_sizes=("9x32x48",), video=True, batch=2),
    models=(
        ModelSpec(name="cosmos-predict2-2b-text2image", family="cosmos", media="image",
                  checkpoint_class="Cosmos2TextToImagePipeline", folder="Cosmos-Predict2-2B-Text2Image",
                  source="nvidia/Cosmos-Predict2-2B-Text2Image", height=768, width=1360, steps=35, guidance=7.0,
                  negative_prompt=COSMOS_NEGATIVE_PROMPT),
        ModelSpec(name="cosmos-predict2-2b-video2world", folder="Cosmos-Predict2-2B-Video2World",
                  source="nvidia/Cosmos-Predict2-2B-Video2World",
                  architecture=_cosmos_predict2(num_attention_heads=16, num_layers=28, rope_scale=(1.0, 3.0, 3.0)),
                  **_COSMOS_VIDEO),
        ModelSpec(name="cosmos-predict2-14b-video2world", folder="Cosmos-Predict2-14B-Video2World",
                  source="nvidia/Cosmos-Predict2-14B-Video2World",
                  architecture=_cosmos_predict2(num_attention_heads=40, num_layers=36,
                                                rope_scale=(20 / 24, 2.0, 2.0)),
                  **_COSMOS_VIDEO),
        ModelSpec(name="tiny-cosmos", family="cosmos", media="video", checkpoint_class="Cosmos2VideoToWorldPipeline",
                  folder="tiny-cosmos", source="embedded", height=128, width=128, steps=8, guidance=3.0, frames=17,
                  fps=8, max_sequence_length=64, negative_prompt="blurry, static", embedded=True,
                  examples=("a red circle moving right on a white background",
                            "a blue square moving down on a black background",
                            "a yellow star growing on a blue background",
                            "a green triangle moving left on a gray background")),
    ),
)

# Cosmos 3 (diffusers' Cosmos3OmniTransformer): a Qwen3-VL text backbone with a second copy of every
# layer for the vision tokens. Nano is Qwen3-VL-8B's text config as its transformer/config.json has
# it; Super is Qwen3-VL-32B's (NVIDIA's cosmos-framework model configs; diffusers' Cosmos 3 docs give
# its 64 query and 8 K/V heads). Sound and action heads are part of the checkpoints but not served.
_COSMOS3_NANO = dict(
    hidden_size=4096, head_dim=128, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=5000000.0, rope_axes_dim=(24, 20, 20), vocab_size=151936,
    latent_channel=48, latent_patch_size=2, patch_latent_dim=192, base_fps=24, enable_fps_modulation=True,
    timestep_scale=0.001, unified_3d_mrope_reset_spatial_ids=True, unified_3d_mrope_temporal_modality_margin=15000,
)
_WAN22_VAE = dict(  # Wan2.2-TI2V-5B's VAE: 2x2 patchify then 8x convolutions (16x space), 4x time, z 48
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
    temperal_downsample=[False, True, True], in_channels=12, out_channels=12, patch_size=2, is_residual=True,
    scale_factor_spatial=16, scale_factor_temporal=4,
    # The checkpoint's per-channel latent statistics (48 values each) are not recorded here; these
    # neutral ones give random-weight benchmarks the right shapes.
    latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
)


def _cosmos3(**transformer: object) -> Architecture:
    return Architecture(transformer={**_COSMOS3_NANO, **transformer}, vae_class="diffusers:AutoencoderKLWan",
                        vae=_WAN22_VAE, text_encoders={})


_COSMOS3 = dict(family="cosmos3", checkpoint_class="Cosmos3OmniPipeline", height=720, width=1280, steps=35,
                guidance=6.0, fps=24, max_sequence_length=1024)

COSMOS3 = ModelFamily(
    name="cosmos3",
    title="Cosmos 3",
    transformer="diffusers:Cosmos3OmniTransformer",
    pipeline="pipelines.cosmos3:Cosmos3Pipeline",
    parallelize="engines.cosmos3:parallelize_cosmos3",
    tensor_parallel="engines.cosmos3:cosmos3_weights",
    repeated_blocks=("layers",),
    block_outputs=(("und_seq", "gen_seq"),),
    cache_stream="gen_seq",
    limits="pipelines.requests:cosmos3_limits",
    guidance_batch=True,  # two guidance calls, on two rank groups with --cfg-parallel (forward_guided)
    adapter_at_one_rank=True,
    bench=BenchShapes(inputs="pipelines.transformer_inputs:cosmos3_inputs", sizes=("189x720x1280",),
                      tiny_sizes=("9x64x96",), video=True, tiny_config="training.tiny_models:COSMOS3_TINY_TRANSFORMER",
                      tiny_checkpoint="training.tiny_models:write_tiny_cosmos3"),
    models=(
        ModelSpec(name="cosmos3-nano", media="video", folder="Cosmos3-Nano", source="nvidia/Cosmos3-Nano", frames=189,
                  architecture=_cosmos3(), **_COSMOS3),
        ModelSpec(name="cosmos3-nano-image", media="image", folder="Cosmos3-Nano", source="nvidia/Cosmos3-Nano",
                  architecture=_cosmos3(), **_COSMOS3),
        ModelSpec(name="cosmos3-super", media="video", folder="Cosmos3-Super", source="nvidia/Cosmos3-Super",
                  frames=189, architecture=_cosmos3(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                                    num_attention_heads=64), **_COSMOS3),
        ModelSpec(name="cosmos3-super-image", media="image", folder="Cosmos3-Super", source="nvidia/Cosmos3-Super",
                  architecture=_cosmos3(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                        num_attention_heads=64), **_COSMOS3),
    ),
)

# FLUX.2: FLUX.1's [text, image] token layout with one shared modulation, fused single-stream
# projections and 4-axis rotary ids. dev is guidance-distilled (one call per step) with Mistral Small
# 3.1 (24B) as its text encoder; Klein 4B/9B use Qwen3 4B/8B, their distilled checkpoints run 4 steps
# without guidance, their base checkpoints 50 steps with classifier-free guidance (two branches).
_FLUX2_DEV = dict(num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360,
                  guidance_embeds=True)
_FLUX2_KLEIN_4B = dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                       guidance_embeds=False)
_FLUX2_KLEIN_9B = dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                       guidance_embeds=False)
_MISTRAL_SMALL_3_1 = dict(  # FLUX.2-dev's text_encoder: Mistral3ForConditionalGeneration, 24B
    text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                     num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=131072, rope_theta=1e9, rms_norm_eps=1e-5),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, image_size=1540, patch_size=14),
    spatial_merge_size=2, multimodal_projector_bias=False, projector_hidden_act="gelu",
)


def _qwen3(hidden: int, intermediate: int, tied: bool) -> dict[str, object]:  # Klein's text_encoder
    return dict(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tied)


def _flux2(transformer: dict[str, object], encoder: tuple[str, dict[str, object]]) -> Architecture:
    # AutoencoderKLFlux2's defaults are FLUX.2's VAE (32 latent channels, 8x).
    return Architecture(transformer=transformer, vae_class="diffusers:AutoencoderKLFlux2", vae={},
                        text_encoders={"text_encoder": encoder})


_KLEIN = dict(family="flux2", media="image", checkpoint_class="Flux2KleinPipeline", height=1024, width=1024)
_KLEIN_DISTILLED = dict(steps=4, guidance=1.0, **_KLEIN)
_KLEIN_BASE = dict(steps=50, guidance=4.0, guidance_batch=True, **_KLEIN)
_QWEN3_4B = ("transformers:Qwen3ForCausalLM", _qwen3(2560, 9728, tied=True))
_QWEN3_8B = ("transformers:Qwen3ForCausalLM", _qwen3(4096, 12288, tied=False))

FLUX2 = ModelFamily(
    name="flux2",
    title="FLUX.2",
    transformer="diffusers:Flux2Transformer2DModel",
    pipeline="pipelines.flux2:Flux2ImagePipeline",
    parallelize="engines.flux2:parallelize_flux2",
    generic_parallelize="engines.flux2:parallelize_flux2_generic",
    tensor_parallel="engines.flux2:flux2_weights",
    repeated_blocks=("transformer_blocks", "single_transformer_blocks"),
    # the single-stream blocks take [text, image] concatenated (engines.step_cache: why that is fine)
    block_outputs=(("encoder_hidden_states", "hidden_states"), ("hidden_states",)),
    cache_stream="hidden_states",
    limits="pipelines.requests:flux2_limits",
    guidance_batch=False,  # dev and distilled Klein: one branch; Klein base models say otherwise (ModelSpec)
    bench=BenchShapes(inputs="pipelines.transformer_inputs:flux2_inputs", sizes=("1024x1024", "2048x2048"),
                      tiny_sizes=("64x64", "80x48"), tiny_config="training.tiny_models:FLUX2_TINY_TRANSFORMER",
                      tiny_checkpoint="training.tiny_models:write_tiny_flux2"),
    models=(
        ModelSpec(name="flux2-dev", family="flux2", media="image", checkpoint_class="Flux2Pipeline",
                  folder="FLUX.2-dev", source="black-forest-labs/FLUX.2-dev", height=1024, width=1024, steps=50,
                  guidance=4.0, architecture=_flux2(_FLUX2_DEV, ("transformers:Mistral3ForConditionalGeneration",
                                                                 _MISTRAL_SMALL_3_1))),
        ModelSpec(name="flux2-klein-4b", folder="FLUX.2-klein-4B", source="black-forest-labs/FLUX.2-klein-4B",
                  architecture=_flux2(_FLUX2_KLEIN_4B, _QWEN3_4B), **_KLEIN_DISTILLED),
        ModelSpec(name="flux2-klein-9b", folder="FLUX.2-klein-9B", source="black-forest-labs/FLUX.2-klein-9B",
                  architecture=_flux2(_FLUX2_KLEIN_9B, _QWEN3_8B), **_KLEIN_DISTILLED),
        ModelSpec(name="flux2-klein-base-4b", folder="FLUX.2-klein-base-4B",
                  source="black-forest-labs/FLUX.2-klein-base-4B", architecture=_flux2(_FLUX2_KLEIN_4B, _QWEN3_4B),
                  **_KLEIN_BASE),
        ModelSpec(name="flux2-klein-base-9b", folder="FLUX.2-klein-base-9B",
                  source="black-forest-labs/FLUX.2-klein-base-9B", architecture=_flux2(_FLUX2_KLEIN_9B, _QWEN3_8B),
                  **_KLEIN_BASE),
    ),
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
    pipeline="pipelines.wan:WanVideoPipeline",
    parallelize="engines.generic:parallelize_generic",  # driven by the class's diffusers _cp_plan
    tensor_parallel="engines.generic:generic_weights",
    repeated_blocks=("blocks",),
    block_outputs=(("hidden_states",),),
    cache_stream="hidden_states",
    limits="pipelines.requests:wan_limits",
    guidance_batch=True,  # the two branches as one batch-2 call
    bench=BenchShapes(inputs="pipelines.transformer_inputs:wan_inputs", sizes=("81x720x1280",),
                      tiny_sizes=("9x48x64",), video=True, batch=2, diffusers_parallel=True,
                      tiny_config="training.tiny_models:WAN_TINY_TRANSFORMER",
                      tiny_checkpoint="training.tiny_models:write_tiny_wan"),
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
    pipeline="pipelines.wan:WanVideoPipeline",
    parallelize="engines.generic:parallelize_generic",  # the per-token timestep split with the tokens (_cp_plan)
    tensor_parallel="engines.generic:generic_weights",
    repeated_blocks=("blocks",),
    block_outputs=(("hidden_states",),),
    cache_stream="hidden_states",
    limits="pipelines.requests:wan_limits",
    guidance_batch=True,
    bench=BenchShapes(inputs="pipelines.transformer_inputs:wan22_inputs", sizes=("121x704x1280",),
                      tiny_sizes=("9x64x96",), video=True, batch=2,
                      tiny_config="training.tiny_models:WAN_TINY_TRANSFORMER",
                      tiny_checkpoint="training.tiny_models:write_tiny_wan22"),
    models=(
        ModelSpec(name="wan2.2-ti2v-5b", family="wan22", media="video", checkpoint_class="WanPipeline",
                  folder="Wan2.2-TI2V-5B-Diffusers", source="Wan-AI/Wan2.2-TI2V-5B-Diffusers", height=704,
                  width=1280, steps=50, guidance=5.0, frames=121, fps=24, negative_prompt=WAN_NEGATIVE_PROMPT,
                  architecture=Architecture(
                      transformer={**_WAN21_TRANSFORMER, "num_attention_heads": 24, "in_channels": 48,
                                   "out_channels": 48, "ffn_dim": 14336},
                      vae_class="diffusers:AutoencoderKLWan", vae=_WAN22_VAE,
                      text_encoders={"text_encoder": ("transformers:UMT5EncoderModel", UMT5_XXL)})),
    ),
)


BUILT_IN = (FLUX, COSMOS, COSMOS3, FLUX2, WAN, QWEN_IMAGE, FLUX3, WAN22)
