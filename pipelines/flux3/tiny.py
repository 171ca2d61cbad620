"""Tiny random FLUX.3 checkpoints as diffusers' modular pipeline saves them (base and distilled), for tests and
the CPU benchmarks: its record's tiny_config and tiny_checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from diffusers import Flux3Transformer2DModel
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from pipelines.family import ModelSpec
from training.tiny_models import flux2_vae, qwen_chat_tokenizer, random_transformer

FLUX3_TINY_TRANSFORMER = dict(
    in_channels=16, cond_in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8,
    num_attention_heads=12, joint_attention_dim=64, timestep_channels=32, axes_dims_rope=(2, 2, 2, 2),
)
"""FLUX.3's transformer shrunk: 12 heads (split by 2, 3 and 4 ranks) of 8 dims (rotary axes t, h, w, l of 2 each),
two per-mode and two joint blocks; 16 input channels are the tiny VAE's 4-channel latent in 2x2 patches (the
reference image's too), 64 text channels are the 8 hidden layers FLUX.3 stacks of an 8-wide Qwen3-VL."""


FLUX3_TEXT_WIDTH = FLUX3_TINY_TRANSFORMER["joint_attention_dim"] // 8


def flux3_components(seed: int, distilled: bool = False) -> dict:
    """FLUX.3's component set, shrunk and random: a Qwen3-VL text encoder of 32 layers (FLUX.3 stacks hidden
    layers 4, 8, ..., 32) under qwen_chat_tokenizer, FLUX.2's VAE with batch-norm statistics, the transformer
    (FLUX3_TINY_TRANSFORMER; distilled: a flow map, which also embeds the timestep a step jumps to). The
    tokenizer stands for Qwen3-VL's processor, whose video processor needs torchvision: FLUX.3's text encoding
    uses only its tokenizer and chat template (pipelines.flux3.ChatTokenizer). No scheduler: FLUX.3's folders
    have none, diffusers' pipeline makes it from its own recipe."""
    tokenizer = qwen_chat_tokenizer()
    torch.manual_seed(seed)
    text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(vocab_size=64, hidden_size=FLUX3_TEXT_WIDTH, intermediate_size=2 * FLUX3_TEXT_WIDTH,
                         num_hidden_layers=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=FLUX3_TEXT_WIDTH,
                           num_position_embeddings=16, deepstack_visual_indexes=[]),
        tie_word_embeddings=True)).eval()
    vae = flux2_vae(FLUX3_TINY_TRANSFORMER["in_channels"] // 4, seed + 1)
    torch.manual_seed(seed + 2)
    transformer = random_transformer(Flux3Transformer2DModel(**FLUX3_TINY_TRANSFORMER, flow_map=distilled))
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "transformer": transformer}


def save_flux3(folder: Path, parts: dict) -> None:
    """Write flux3_components' parts as diffusers' modular pipeline saves a FLUX.3 folder (replacing `folder`):
    modular_model_index.json (Flux3ModularPipeline, or Flux3DistilledModularPipeline for a flow map) and one
    subfolder per loaded component; the scheduler, guider and image processor, which diffusers makes from
    its blocks' configs, are not written."""
    from diffusers import Flux3DistilledModularPipeline, Flux3ModularPipeline

    if folder.exists():
        shutil.rmtree(folder)
    distilled = parts["transformer"].config.flow_map
    pipe = (Flux3DistilledModularPipeline if distilled else Flux3ModularPipeline)()
    pipe.update_components(**parts)
    pipe.save_pretrained(str(folder), overwrite_modular_index=True)  # the index points at `folder`


def write_tiny_flux3(spec: ModelSpec, folder: Path) -> None:
    """A tiny random FLUX.3 checkpoint in `folder` (the FLUX.3 record's tiny_checkpoint): distilled for the
    distilled checkpoint class."""
    save_flux3(folder, flux3_components(seed=0, distilled=spec.checkpoint_class == "Flux3DistilledModularPipeline"))
