"""Tiny random Cosmos 3 checkpoints in diffusers' Cosmos3OmniPipeline folder format, for tests and the CPU
benchmarks: its record's tiny_config and tiny_checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer, UniPCMultistepScheduler

from pipelines.family import ModelSpec
from training.tiny_models import qwen_chat_tokenizer, random_transformer, save_pipeline

COSMOS3_TINY_TRANSFORMER = dict(
    hidden_size=32, head_dim=8, num_attention_heads=24, num_key_value_heads=2, intermediate_size=64,
    num_hidden_layers=2, vocab_size=64, latent_channel=4, latent_patch_size=2, patch_latent_dim=16,
    rope_axes_dim=(2, 1, 1), rope_theta=10000.0, unified_3d_mrope_temporal_modality_margin=100,
)
"""Cosmos 3's transformer shrunk: 24 query heads (split by 2, 3, 4 and 8 ranks) over 2 K/V heads, so
Ulysses degrees 3, 4 and 8 repeat K/V heads; mRoPE sections (2, 1, 1) fill head_dim / 2."""


def cosmos3_components(seed: int) -> dict:
    """Cosmos 3's component set, shrunk and random: the Qwen-style tokenizer (the transformer embeds the
    token ids itself), a Wan 2.2-style VAE (2x2 patchify, 8x convolutions: 16x space, 4x time), the packed
    two-stream transformer and UniPC with flow sigmas as the Nano checkpoint ships it."""
    z_dim = COSMOS3_TINY_TRANSFORMER["latent_channel"]
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True], in_channels=12, out_channels=12, patch_size=2, is_residual=True,
        scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
    ).eval()
    torch.manual_seed(seed + 1)
    transformer = random_transformer(Cosmos3OmniTransformer(**COSMOS3_TINY_TRANSFORMER))
    scheduler = UniPCMultistepScheduler(use_karras_sigmas=True, use_flow_sigmas=True,
                                        prediction_type="flow_prediction", sigma_max=200.0, sigma_min=0.147)
    return {"text_tokenizer": qwen_chat_tokenizer(), "vae": vae, "transformer": transformer, "scheduler": scheduler}


def save_cosmos3(folder: Path, parts: dict) -> None:
    """Write cosmos3_components' parts as a diffusers Cosmos3OmniPipeline folder (replacing `folder`)."""
    save_pipeline(folder, "Cosmos3OmniPipeline", parts)


def write_tiny_cosmos3(spec: ModelSpec, folder: Path) -> None:
    """A tiny random Cosmos 3 checkpoint in `folder` (the Cosmos 3 record's tiny_checkpoint; one for every
    checkpoint of the family)."""
    save_cosmos3(folder, cosmos3_components(seed=0))
