"""The FLUX.3 family's record: its checkpoints, their published architectures, and where its code is."""

from __future__ import annotations

from pipelines.family import Architecture, BenchShapes, ModelFamily, ModelSpec

# FLUX.3: text, image and reference-image tokens each pass per-mode blocks (attending within their own stream),
# then joint blocks over [text, image, reference]; per-token modulation; Qwen3-VL's hidden layers 4, 8, ..., 32
# stacked as its text (8 x 2560 = joint_attention_dim 20480: Qwen3-VL-4B's width); the FLUX.2 VAE. The base
# model uses classifier-free guidance as two calls (guider scale 3.5, 50 steps); the distilled one is a flow
# map (16 steps, no guidance). diffusers 0.42 names the checkpoints (single-file loading's default paths) but
# ships no config of them: the transformer below is Flux3Transformer2DModel's defaults (its docstring's numbers),
# the text encoder Qwen3-VL-4B-Instruct's config as published (transformers' Qwen3VLConfig keys), the defaults
# (size, steps, guidance) those of diffusers' FLUX.3 blocks.
_FLUX3_TRANSFORMER = dict(
    in_channels=128, cond_in_channels=128, num_layers=5, num_single_layers=28, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=20480, timestep_channels=256, mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32), rope_theta=10000,
)


_QWEN3_VL_4B = dict(
    text_config=dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                     rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=5000000.0,
                                                             mrope_section=[24, 20, 20], mrope_interleaved=True)),
    vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       deepstack_visual_indexes=[5, 11, 17]),
    tie_word_embeddings=True,
)


def _flux3(flow_map: bool) -> Architecture:
    # AutoencoderKLFlux2's defaults are FLUX.2's VAE, which FLUX.3 uses (32 latent channels, 8x).
    return Architecture(transformer={**_FLUX3_TRANSFORMER, "flow_map": flow_map},
                        vae_class="diffusers:AutoencoderKLFlux2",
                        vae={}, text_encoders={"text_encoder": ("transformers:Qwen3VLForConditionalGeneration",
                                                                _QWEN3_VL_4B)})


_FLUX3 = dict(family="flux3", media="image", height=1024, width=1024, max_sequence_length=512)


FLUX3 = ModelFamily(
    name="flux3",
    title="FLUX.3",
    transformer="diffusers:Flux3Transformer2DModel",
    pipeline="pipelines.flux3.pipeline:Flux3ImagePipeline",
    parallelize="pipelines.flux3.parallel:parallelize_flux3",
    tensor_parallel="engines.parallel.generic:generic_weights",  # the SwiGLU feed-forward stays whole
    # The step cache loops over the joint blocks only: the per-mode blocks run text first, then image, then the
    # reference, and a cache over them would measure the text's change; the joint blocks' first one takes the image
    # (and reference) tokens as hidden_states. The per-mode blocks compile and go FP8 one block at a time all the same.
    repeated_blocks=("single_transformer_blocks",),
    other_blocks=("txt_mode_blocks", "mode_blocks.image", "mode_blocks.image_cond"),
    block_outputs=(("encoder_hidden_states", "hidden_states"),),
    limits="pipelines.flux3.limits:flux3_limits",
    guidance_batch=False,  # the distilled model: no guidance; the base model says otherwise (its ModelSpec)
    guidance_calls=True,  # two calls of their own text lengths (FLUX.3 attends to its padding: no shared batch)
    bench=BenchShapes(inputs="pipelines.flux3.inputs:flux3_inputs", sizes=("1024x1024", "2048x2048"),
                      tiny_sizes=("64x64", "80x48"), tiny_config="pipelines.flux3.tiny:FLUX3_TINY_TRANSFORMER",
                      tiny_checkpoint="pipelines.flux3.tiny:write_tiny_flux3"),
    models=(
        ModelSpec(name="flux3-klein-base", checkpoint_class="Flux3ModularPipeline", folder="flux-3-image-klein-base",
                  source="black-forest-labs/flux-3-image-klein-base", steps=50, guidance=3.5, guidance_batch=True,
                  architecture=_flux3(flow_map=False), **_FLUX3),  # its two guidance calls on two rank groups
        ModelSpec(name="flux3-klein", checkpoint_class="Flux3DistilledModularPipeline", folder="flux-3-image-klein",
                  source="black-forest-labs/flux-3-image-klein", steps=16, guidance=1.0,
                  architecture=_flux3(flow_map=True), **_FLUX3),
    ),
)
