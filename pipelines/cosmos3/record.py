"""The Cosmos 3 family's record: its checkpoints (Nano and Super, video and image), their published
architectures, and where its code is."""

from __future__ import annotations

from pipelines.family import Architecture, BenchShapes, ModelFamily, ModelSpec
from pipelines.wan.record import WAN22_VAE

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


def _cosmos3(**transformer: object) -> Architecture:
    return Architecture(transformer={**_COSMOS3_NANO, **transformer}, vae_class="diffusers:AutoencoderKLWan",
                        vae=WAN22_VAE, text_encoders={})


_COSMOS3 = dict(family="cosmos3", checkpoint_class="Cosmos3OmniPipeline", height=720, width=1280, steps=35,
                guidance=6.0, fps=24, max_sequence_length=1024)


COSMOS3 = ModelFamily(
    name="cosmos3",
    title="Cosmos 3",
    transformer="diffusers:Cosmos3OmniTransformer",
    pipeline="pipelines.cosmos3.pipeline:Cosmos3Pipeline",
    parallelize="pipelines.cosmos3.parallel:parallelize_cosmos3",
    tensor_parallel="pipelines.cosmos3.parallel:cosmos3_weights",
    repeated_blocks=("layers",),
    block_outputs=(("und_seq", "gen_seq"),),
    cache_stream="gen_seq",
    limits="pipelines.cosmos3.limits:cosmos3_limits",
    guidance_batch=True,  # two guidance calls, on two rank groups with --cfg-parallel (forward_guided)
    adapter_at_one_rank=True,
    bench=BenchShapes(inputs="pipelines.cosmos3.inputs:cosmos3_inputs", sizes=("189x720x1280",),
                      tiny_sizes=("9x64x96",), video=True,
                      tiny_config="pipelines.cosmos3.tiny:COSMOS3_TINY_TRANSFORMER",
                      tiny_checkpoint="pipelines.cosmos3.tiny:write_tiny_cosmos3"),
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
