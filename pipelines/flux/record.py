"""The FLUX.1 family's record: its checkpoints (FLUX.1-dev's components, the embedded tiny-flux), and where its code
is."""

from __future__ import annotations

from pipelines.family import Architecture, BenchShapes, ModelFamily, ModelSpec

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
    pipeline="pipelines.flux.pipeline:FluxImagePipeline",
    parallelize="pipelines.flux.parallel:parallelize_flux",
    tensor_parallel="pipelines.flux.parallel:flux_weights",
    repeated_blocks=("transformer_blocks", "single_transformer_blocks"),
    block_outputs=(("encoder_hidden_states", "hidden_states"), ("encoder_hidden_states", "hidden_states")),
    limits="pipelines.flux.limits:flux_limits",
    guidance_batch=False,  # guidance-distilled: one branch
    bench=BenchShapes(inputs="pipelines.flux.inputs:flux_inputs", sizes=("1024x1024", "2048x2048"),
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
