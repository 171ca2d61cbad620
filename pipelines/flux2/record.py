"""The FLUX.2 family's record: its checkpoints (dev, Klein and Klein base), their published architectures, and
where its code is."""

from __future__ import annotations

from pipelines.family import Architecture, BenchShapes, ModelFamily, ModelSpec

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
    pipeline="pipelines.flux2.pipeline:Flux2ImagePipeline",
    parallelize="pipelines.flux2.parallel:parallelize_flux2",
    tensor_parallel="pipelines.flux2.parallel:flux2_weights",
    repeated_blocks=("transformer_blocks", "single_transformer_blocks"),
    # the single-stream blocks take [text, image] concatenated (engines.levers.step_cache: why that is fine)
    block_outputs=(("encoder_hidden_states", "hidden_states"), ("hidden_states",)),
    limits="pipelines.flux2.limits:flux2_limits",
    guidance_batch=False,  # dev and distilled Klein: one branch; Klein base models say otherwise (ModelSpec)
    bench=BenchShapes(inputs="pipelines.flux2.inputs:flux2_inputs", sizes=("1024x1024", "2048x2048"),
                      tiny_sizes=("64x64", "80x48"), tiny_config="pipelines.flux2.tiny:FLUX2_TINY_TRANSFORMER",
                      tiny_checkpoint="pipelines.flux2.tiny:write_tiny_flux2"),
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
