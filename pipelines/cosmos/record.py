"""The Cosmos-Predict2 family's record: its checkpoints (the Video2World transformers as written by diffusers'
convert_cosmos_to_diffusers.py, "Cosmos-2.0-Diffusion-2B/14B-Video2World", with their T5-11B encoder and Wan 2.1 VAE;
the embedded tiny-cosmos), and where its code is."""

from __future__ import annotations

from pipelines.family import Architecture, BenchShapes, ModelFamily, ModelSpec

T5_11B = dict(  # text_encoder of Cosmos-Predict2 (google-t5/t5-11b's encoder, 4.8B): d_model 1024 = text_embed_dim
    vocab_size=32128, d_model=1024, d_kv=128, d_ff=65536, num_layers=24, num_heads=128,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="relu",
    layer_norm_epsilon=1e-6, dropout_rate=0.0, is_encoder_decoder=False, use_cache=False,
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
    pipeline="pipelines.cosmos.pipeline:CosmosPipeline",
    parallelize="pipelines.cosmos.parallel:parallelize_cosmos",
    tensor_parallel="pipelines.cosmos.parallel:cosmos_weights",
    repeated_blocks=("transformer_blocks",),
    block_outputs=(("hidden_states",),),
    limits="pipelines.cosmos.limits:cosmos_limits",
    guidance_batch=True,
    transformer_setup="pipelines.cosmos.torchvision_shim:install",  # its forward calls torchvision's resize
    bench=BenchShapes(inputs="pipelines.cosmos.inputs:cosmos_inputs", sizes=("93x704x1280",),
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
