"""Tiny random Qwen-Image checkpoints in diffusers' folder formats (QwenImagePipeline, QwenImageEditPipeline,
QwenImageEditPlusPipeline), for tests and the CPU benchmarks: its record's tiny_config and tiny_checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
from transformers import AddedToken, PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from pipelines.family import ModelSpec
from pipelines.qwen_image.limits import QWEN_EDIT_CHECKPOINT, QWEN_EDIT_PLUS_CHECKPOINT
from training.tiny_models import qwen_chat_tokenizer, random_transformer, save_pipeline

QWEN_IMAGE_TINY_TRANSFORMER = dict(
    patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=12,
    joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
)
"""Qwen-Image's transformer shrunk: 12 heads (split by 2, 3 and 4 ranks) of 8 dims (rotary sections 2, 2, 4),
two blocks; 16 input channels are the tiny VAE's 4-channel latent in 2x2 patches, 16 text channels the tiny
Qwen2.5-VL encoder's width."""


def qwen_image_tokenizer() -> PreTrainedTokenizerFast:
    """qwen_chat_tokenizer with its newline a token: QwenImagePipeline drops the first 34 tokens of its prompt
    template (the system message and the user turn's start, as Qwen's tokenizer splits them, newlines
    included), and with newlines as tokens this tokenizer splits that prefix into 34 too."""
    tokenizer = qwen_chat_tokenizer()
    tokenizer.add_tokens([AddedToken("\n", normalized=False)])
    return tokenizer


def tiny_qwen25_vl(width: int, *, vocab_size: int, max_positions: int,
                   **token_ids: int) -> Qwen2_5_VLForConditionalGeneration:
    """A random Qwen2.5-VL of two `width`-wide text layers (multimodal rotary sections 2, 1, 1) and a one-layer vision
    tower, in eval mode, from the caller's seed; `token_ids`: its vision tokens' ids (image_token_id, ...) where a
    tokenizer adds them (Qwen-Image-Edit's), else the config's defaults."""
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
                         bos_token_id=0, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=width,
                           fullatt_block_indexes=[0]),
        **token_ids, bos_token_id=0, eos_token_id=2, pad_token_id=0)).eval()


def qwen_image_components(seed: int, *, zero_cond_t: bool = False) -> dict:
    """Qwen-Image's component set, shrunk and random: a Qwen2.5-VL text encoder (a one-layer vision tower it
    never uses for text) under qwen_image_tokenizer, Qwen-Image's VAE (8x, one frame) with per-channel
    latent statistics, the transformer (QWEN_IMAGE_TINY_TRANSFORMER) and the scheduler as Qwen/Qwen-Image
    ships it (dynamic exponential shift, terminal shift 0.02); `zero_cond_t`: the transformer's (Qwen-Image-Edit-2511:
    a reference's tokens at timestep 0)."""
    width = QWEN_IMAGE_TINY_TRANSFORMER["joint_attention_dim"]
    tokenizer = qwen_image_tokenizer()
    torch.manual_seed(seed)
    text_encoder = tiny_qwen25_vl(width, vocab_size=64, max_positions=1024)
    z_dim = QWEN_IMAGE_TINY_TRANSFORMER["out_channels"]
    torch.manual_seed(seed + 1)
    # as a trained VAE has them: decode's de-normalisation is exercised
    statistics = torch.Generator().manual_seed(seed)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=(torch.randn(z_dim, generator=statistics) * 0.5).tolist(),
        latents_std=(torch.rand(z_dim, generator=statistics) + 0.5).tolist(),
    ).eval()
    torch.manual_seed(seed + 2)
    transformer = random_transformer(
        QwenImageTransformer2DModel(**QWEN_IMAGE_TINY_TRANSFORMER, zero_cond_t=zero_cond_t))
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0, shift_terminal=0.02,
        time_shift_type="exponential", use_dynamic_shifting=True)
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "transformer": transformer,
            "scheduler": scheduler}


def save_qwen_image(folder: Path, parts: dict) -> None:
    """Write qwen_image_components' parts as a diffusers QwenImagePipeline folder (replacing `folder`)."""
    save_pipeline(folder, "QwenImagePipeline", parts)


def write_tiny_qwen_image(spec: ModelSpec, folder: Path) -> None:
    """A tiny random Qwen-Image checkpoint in `folder` (the Qwen-Image record's tiny_checkpoint): Qwen-Image-Edit's
    for an editing spec (QwenImageEditPipeline, or QwenImageEditPlusPipeline with the transformer's zero_cond_t as
    the spec's architecture says: on for 2511), else QwenImagePipeline's."""
    if spec.checkpoint_class in (QWEN_EDIT_CHECKPOINT, QWEN_EDIT_PLUS_CHECKPOINT):
        zero_cond_t = bool(spec.architecture and spec.architecture.transformer.get("zero_cond_t"))
        save_qwen_image_edit(folder, qwen_image_edit_components(seed=0, zero_cond_t=zero_cond_t),
                             checkpoint=spec.checkpoint_class)
    else:
        save_qwen_image(folder, qwen_image_components(seed=0))


QWEN_VL_IMAGE_TOKENS = ("<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
"""The vision tokens Qwen2VLProcessor and Qwen2.5-VL's rotary index read (after <|vision_start|>)."""

QWEN_VL_PREPROCESSOR = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16384, patch_size=14, temporal_patch_size=2,
                            merge_size=2)
"""Qwen2.5-VL's published image preprocessing bounds and patches (preprocessor_config.json's keys)."""


def qwen_image_edit_components(seed: int, *, zero_cond_t: bool = False) -> dict:
    """Qwen-Image-Edit's component set, shrunk and random: qwen_image_components' VAE, transformer and scheduler
    (zero_cond_t off, as Qwen/Qwen-Image-Edit and -2509; on, as -2511), its tokenizer with Qwen-VL's vision tokens, a
    Qwen2.5-VL whose one-layer vision tower now sees the reference (its config's vision token ids the tokenizer's), and
    the processor's image preprocessing (transformers' PIL Qwen2-VL image processor with Qwen2.5-VL's bounds)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    parts = qwen_image_components(seed, zero_cond_t=zero_cond_t)
    tokenizer = parts["tokenizer"]
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VL_IMAGE_TOKENS)})
    width = QWEN_IMAGE_TINY_TRANSFORMER["joint_attention_dim"]
    image_id, video_id = (tokenizer.convert_tokens_to_ids(token) for token in ("<|image_pad|>", "<|video_pad|>"))
    torch.manual_seed(seed + 3)
    parts["text_encoder"] = tiny_qwen25_vl(width, vocab_size=72, max_positions=4096, image_token_id=image_id,
                                           video_token_id=video_id,
                                           vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"))
    parts["image_processor"] = Qwen2VLImageProcessorPil(
        size={"shortest_edge": QWEN_VL_PREPROCESSOR["min_pixels"], "longest_edge": QWEN_VL_PREPROCESSOR["max_pixels"]},
        **{k: v for k, v in QWEN_VL_PREPROCESSOR.items() if not k.endswith("_pixels")})
    return parts


def save_qwen_image_edit(folder: Path, parts: dict, *, checkpoint: str = QWEN_EDIT_CHECKPOINT) -> None:
    """Write qwen_image_edit_components' parts as a diffusers `checkpoint` folder (QwenImageEditPipeline, or
    QwenImageEditPlusPipeline: the same parts), replacing `folder`: processor/ holds the image preprocessing and
    the tokenizer's files, as the published folders' do."""
    save_pipeline(folder, checkpoint, {name: part for name, part in parts.items() if name != "image_processor"},
                  processor=["transformers", "Qwen2VLProcessor"])
    parts["image_processor"].save_pretrained(folder / "processor")
    parts["tokenizer"].save_pretrained(folder / "processor")
