"""The model families this product runs (BUILT_IN; pipelines.family says what a record holds).

FLUX.1 and Cosmos-Predict2, whose embedded tiny models the training code builds, are recorded here; every other
family is one folder with its record (pipelines/<family>/record.py: Cosmos 3, FLUX.2, Wan 2.1 and 2.2, Qwen-Image,
FLUX.3). The architectures are the published diffusers configs: FLUX.1-dev's components, and the Cosmos-Predict2
Video2World transformers as written by diffusers' convert_cosmos_to_diffusers.py ("Cosmos-2.0-Diffusion-2B/14B-
Video2World") with their T5-11B encoder and Wan 2.1 VAE.
"""

from __future__ import annotations

from pipelines.cosmos3.record import COSMOS3
from pipelines.family import Architecture, BenchShapes, ModelFamily, ModelSpec
from pipelines.flux2.record import FLUX2
from pipelines.flux3.record import FLUX3
from pipelines.qwen_image.record import QWEN_IMAGE
from pipelines.wan.record import WAN, WAN22

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


BUILT_IN = (FLUX, COSMOS, COSMOS3, FLUX2, WAN, QWEN_IMAGE, FLUX3, WAN22)
