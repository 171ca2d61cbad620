"""Tiny random Wan checkpoints in diffusers' WanPipeline folder format (text-to-video, image-to-video, Wan 2.2
A14B's two experts, TI2V), for tests and the CPU benchmarks: its records' tiny_config and tiny_checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from pipelines.family import ModelSpec
from training.tiny_models import TEXT_WIDTH, random_transformer, save_pipeline, t5_tokenizer

WAN_TINY_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=12, in_channels=8, out_channels=8,
    text_dim=TEXT_WIDTH, freq_dim=32, ffn_dim=192, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)
"""Wan 2.1's transformer shrunk: 12 heads (split by 2, 3 and 4 ranks) of 12 dims (rotary sections 4, 4, 4),
two blocks; 8 input channels are the tiny Wan VAE's latent, 64 text channels the tiny UMT5 encoder's width."""


WAN_I2V_TINY_TRANSFORMER = {**WAN_TINY_TRANSFORMER, "in_channels": 20, "image_dim": 32, "added_kv_proj_dim": 144}
"""Wan 2.1 image-to-video's transformer shrunk: WAN_TINY_TRANSFORMER's with 8 latent + 4 mask + 8 image-latent
input channels, and the tiny CLIP vision encoder's 32-wide image context (K/V projected to the 144-wide attention)."""


def wan_components(seed: int, kind: str = "t2v", experts: int = 1) -> dict:
    """A Wan component set, shrunk and random: a UMT5 encoder under the tiny T5 tokenizer, a VAE with per-channel
    latent statistics, the transformer and UniPC with flow sigmas as Wan2.1-T2V-1.3B-Diffusers ships it (flow_shift
    3). kind "t2v": Wan 2.1 text-to-video (a Wan 2.1-style VAE, 8x space, 4x time; WAN_TINY_TRANSFORMER); "i2v":
    Wan 2.1 image-to-video (that VAE, WAN_I2V_TINY_TRANSFORMER, a CLIP vision encoder and its image processor);
    "ti2v": Wan 2.2 TI2V (a Wan 2.2-style VAE, 2x2 patchify then 8x: 16x space; WAN_TINY_TRANSFORMER).
    experts=2: Wan 2.2 A14B's, a second random transformer of the same config as transformer_2; its image-to-video
    transformer has no CLIP image context (20 input channels) and no image encoder comes with it."""
    if kind not in ("t2v", "i2v", "ti2v"):
        raise ValueError(f"kind must be t2v, i2v or ti2v, got {kind!r}")
    tokenizer = t5_tokenizer(max_length=512)
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_WIDTH, d_kv=TEXT_WIDTH // 4, d_ff=2 * TEXT_WIDTH, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=False, use_cache=False)).eval()
    z_dim = WAN_TINY_TRANSFORMER["out_channels"]
    torch.manual_seed(seed + 1)
    statistics = torch.Generator().manual_seed(seed)  # as a trained VAE has them: decode's de-normalisation runs
    wan22 = dict(in_channels=12, out_channels=12, patch_size=2, is_residual=True, scale_factor_spatial=16,
                 scale_factor_temporal=4) if kind == "ti2v" else {}
    vae = AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=(torch.randn(z_dim, generator=statistics) * 0.5).tolist(),
        latents_std=(torch.rand(z_dim, generator=statistics) + 0.5).tolist(), **wan22,
    ).eval()
    config = WAN_TINY_TRANSFORMER
    if kind == "i2v":
        config = WAN_I2V_TINY_TRANSFORMER if experts == 1 else {**WAN_TINY_TRANSFORMER, "in_channels": 20}
    transformers = {}
    for index, name in enumerate(["transformer", "transformer_2"][:experts]):
        torch.manual_seed(seed + 2 + 2 * index)
        transformers[name] = random_transformer(WanTransformer3DModel(**config))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        solver_order=2, final_sigmas_type="zero")
    parts = {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, **transformers, "scheduler": scheduler}
    if kind == "i2v" and experts == 1:
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        torch.manual_seed(seed + 3)
        parts["image_encoder"] = CLIPVisionModel(CLIPVisionConfig(
            hidden_size=WAN_I2V_TINY_TRANSFORMER["image_dim"], intermediate_size=64, projection_dim=32,
            num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)).eval()
        parts["image_processor"] = CLIPImageProcessor(size={"shortest_edge": 32},
                                                      crop_size={"height": 32, "width": 32})
    return parts


def save_wan(folder: Path, parts: dict, *, expand_timesteps: bool = False, image_to_video: bool | None = None,
             boundary_ratio: float | None = None) -> None:
    """Write wan_components' parts as a diffusers WanPipeline folder, or a WanImageToVideoPipeline one
    (image_to_video; None: where they hold an image encoder), replacing `folder`; expand_timesteps: Wan 2.2
    TI2V's model_index.json setting; boundary_ratio: Wan 2.2 A14B's, where the parts hold a transformer_2."""
    image = "image_encoder" in parts if image_to_video is None else image_to_video
    # as the published folders write them (a missing component as [null, null])
    missing = {name: [None, None] for name in ("transformer_2", "image_encoder", "image_processor")
               if name not in parts}
    save_pipeline(folder, "WanImageToVideoPipeline" if image else "WanPipeline", parts, **missing,
                  boundary_ratio=boundary_ratio, expand_timesteps=expand_timesteps)


def write_tiny_wan(spec: ModelSpec, folder: Path) -> None:
    """A tiny random Wan 2.1 or Wan 2.2 A14B checkpoint of `spec`'s pipeline class and experts in `folder` (the Wan
    record's tiny_checkpoint): WanImageToVideoPipeline's, else WanPipeline's text-to-video."""
    kind = "i2v" if spec.checkpoint_class == "WanImageToVideoPipeline" else "t2v"
    boundary = (0.9 if kind == "i2v" else 0.875) if spec.experts > 1 else None  # Wan 2.2 A14B's published ratios
    save_wan(folder, wan_components(seed=0, kind=kind, experts=spec.experts), image_to_video=kind == "i2v",
             boundary_ratio=boundary)


def write_tiny_wan22(spec: ModelSpec, folder: Path) -> None:
    """A tiny random Wan 2.2 TI2V checkpoint in `folder` (the Wan 2.2 record's tiny_checkpoint)."""
    save_wan(folder, wan_components(seed=0, kind="ti2v"), expand_timesteps=True)
