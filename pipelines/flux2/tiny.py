"""Tiny random FLUX.2 checkpoints in diffusers' Flux2KleinPipeline and Flux2Pipeline folder formats, for tests
and the CPU benchmarks: its record's tiny_config and tiny_checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pipelines.family import ModelSpec
from training.tiny_models import CAPTION_WORDS, flux2_vae, qwen_chat_tokenizer, random_transformer, save_pipeline

FLUX2_TINY_TRANSFORMER = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=6,
    joint_attention_dim=48, timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=True,
)
"""FLUX.2's transformer shrunk: 6 heads (split by 2 and 3 ranks), two double- and two single-stream blocks,
4-axis rotary ids; 16 input channels are a 4-channel VAE latent in 2x2 patches, 48 text channels are three
hidden layers of a 16-wide text encoder stacked, as FLUX.2's pipelines stack them."""


FLUX2_TEXT_WIDTH = FLUX2_TINY_TRANSFORMER["joint_attention_dim"] // 3


def mistral_chat_tokenizer() -> PreTrainedTokenizerFast:
    """FLUX.2-dev's tokenizer shrunk: a word-level tokenizer with Mistral's special tokens and a chat template
    for Flux2Pipeline's system + user messages (text parts); ids below 64. The checkpoint's is a
    PixtralProcessor, whose chat template tokenizes text-only messages the same way; transformers'
    PixtralProcessor needs torchvision, which the CPU test machine cannot have beside torch."""
    special = ["<pad>", "<s>", "</s>", "<unk>", "[IMG]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"]
    words = special + [w for w in dict.fromkeys(CAPTION_WORDS) if w not in special]
    vocab = {word: i for i, word in enumerate(words[:64])}
    model = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    model.add_special_tokens(special)
    template = ("<s>{% for message in messages %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
                "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ part['text'] }}[/SYSTEM_PROMPT]"
                "{% else %}[INST]{{ part['text'] }}[/INST]{% endif %}{% endif %}{% endfor %}{% endfor %}")
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", chat_template=template)


def flux2_components(seed: int, variant: str = "klein") -> dict:
    """FLUX.2's component set, shrunk and random: FLUX.2's VAE (8x, its latents' batch-norm statistics), the
    transformer (FLUX2_TINY_TRANSFORMER; without guidance embedding for Klein) and as text encoder Qwen3
    with Qwen's chat tokenizer ("klein": Flux2KleinPipeline) or Mistral 3 with mistral_chat_tokenizer
    ("dev": Flux2Pipeline). The encoders have as many layers as the pipelines read hidden states from
    (27 and 30)."""
    if variant not in ("klein", "dev"):
        raise ValueError(f"variant must be 'klein' or 'dev', got {variant!r}")
    width = FLUX2_TEXT_WIDTH
    torch.manual_seed(seed)
    if variant == "klein":
        tokenizer = qwen_chat_tokenizer()
        text_encoder = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=64, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=27, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, tie_word_embeddings=True)).eval()
    else:
        tokenizer = mistral_chat_tokenizer()
        text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=dict(model_type="mistral", vocab_size=64, hidden_size=width, intermediate_size=2 * width,
                             num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             max_position_embeddings=1024),
            vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, image_size=64, patch_size=16),
            image_token_index=4, spatial_merge_size=2, multimodal_projector_bias=False)).eval()
    vae = flux2_vae(FLUX2_TINY_TRANSFORMER["in_channels"] // 4, seed + 1)
    torch.manual_seed(seed + 2)
    transformer = random_transformer(
        Flux2Transformer2DModel(**{**FLUX2_TINY_TRANSFORMER, "guidance_embeds": variant == "dev"}))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096, shift=3.0)
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "transformer": transformer,
            "scheduler": scheduler}


def save_flux2(folder: Path, parts: dict) -> None:
    """Write flux2_components' parts as a diffusers Flux2KleinPipeline or Flux2Pipeline folder (replacing `folder`)."""
    if isinstance(parts["text_encoder"], Qwen3ForCausalLM):
        # a base (not step-distilled) checkpoint: Flux2KleinPipeline applies classifier-free guidance
        save_pipeline(folder, "Flux2KleinPipeline", parts, is_distilled=False)
    else:
        save_pipeline(folder, "Flux2Pipeline", parts)


def write_tiny_flux2(spec: ModelSpec, folder: Path) -> None:
    """A tiny random checkpoint of `spec`'s pipeline class in `folder` (the FLUX.2 record's tiny_checkpoint):
    Flux2Pipeline's with dev's Mistral encoder, else Flux2KleinPipeline's with Qwen3."""
    variant = "dev" if spec.checkpoint_class == "Flux2Pipeline" else "klein"
    save_flux2(folder, flux2_components(seed=0, variant=variant))
