"""Build the embedded tiny models in assets/ (diffusers folder format) from fixed seeds, untrained.

    python -m training.tiny_models                # writes assets/tiny-flux and assets/tiny-cosmos
    python -m training.tiny_models --out /tmp/x   # writes /tmp/x/tiny-flux and /tmp/x/tiny-cosmos

The folders have exactly the layout of real checkpoints (model_index.json, one subfolder per component,
safetensors weights, offline tokenizers), so they load through the same code path as FLUX.1-dev or
Cosmos-Predict2. The weights here are random; the architectures are the real diffusers classes, shrunk.
Trained weights for the same architectures come from `python -m training`, which builds its starting
point with flux_components / cosmos_components and saves with save_flux / save_cosmos.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLWan,
    Cosmos3OmniTransformer,
    CosmosTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
    Flux2Transformer2DModel,
    FluxTransformer2DModel,
    UniPCMultistepScheduler,
    WanTransformer3DModel,
)
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
    UMT5Config,
    UMT5EncoderModel,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pipelines.family import ModelSpec

REPO = Path(__file__).resolve().parent.parent
"""The repository root; its assets/ folder is the default output."""

# Whole-word pieces for the T5 tokenizer: the vocabulary of the captions the tiny models are meant for
# (shapes, colours, sizes, positions, motions). Anything else falls back to single characters.
CAPTION_WORDS = """
a an the of on in at to and with is are one two three small big large tiny huge medium
red green blue yellow orange purple pink white black gray grey brown cyan magenta
circle square triangle rectangle star ring cross diamond ellipse dot shape shapes
left right up down top bottom center centre middle corner upper lower side
moving moves move sliding slides growing grows shrinking shrinks rotating spinning bouncing
background picture image photo video scene of over under near far bright dark light
blurry static still
""".split()


def clip_tokenizer() -> CLIPTokenizer:
    """Byte-level CLIP tokenizer with no merges: every character is a token."""
    alphabet = sorted(set(bytes_to_unicode().values()))
    vocab: dict[str, int] = {}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    for ch in alphabet:
        vocab[ch + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer(max_length: int) -> T5TokenizerFast:
    """Unigram T5 tokenizer: caption words as whole pieces, characters as fallback."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    seen = {p for p, _ in pieces}
    for word in dict.fromkeys(CAPTION_WORDS):
        piece = "\u2581" + word
        if piece not in seen:
            pieces.append((piece, -1.0))
            seen.add(piece)
    for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()/&%+=":
        if ch not in seen:
            pieces.append((ch, -8.0))
            seen.add(ch)
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)


TEXT_WIDTH = 64
"""Width of the tiny T5 encoders (d_model), which is also the transformers' text input width."""


def t5_encoder(vocab_size: int, seed: int, width: int = TEXT_WIDTH) -> T5EncoderModel:
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=vocab_size, d_model=width, d_kv=width // 4, d_ff=2 * width, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    return T5EncoderModel(config).eval()


def flow_scheduler(**overrides) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(**overrides)


def write_model_index(folder: Path, class_name: str, components: dict[str, tuple[str | None, str | None]]) -> None:
    import diffusers

    index = {"_class_name": class_name, "_diffusers_version": diffusers.__version__}
    index.update({name: list(lib_cls) for name, lib_cls in components.items()})
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def flux_components(seed: int, text_width: int = TEXT_WIDTH) -> dict:
    """FLUX.1-dev's component set, shrunk: CLIP + T5 text encoders, 8x VAE, guidance-distilled DiT (random weights)."""
    clip_tok = clip_tokenizer()
    t5_tok = t5_tokenizer(max_length=512)

    torch.manual_seed(seed)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
            bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id,
        )
    ).eval()
    t5 = t5_encoder(len(t5_tok), seed + 1, text_width)

    torch.manual_seed(seed + 2)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[16, 32, 64, 64], layers_per_block=1, latent_channels=4, norm_num_groups=8,
        sample_size=256, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    ).eval()

    # Head dim 32 gives the rotary embedding six frequencies per image axis (16 gave three, too coarse
    # to place a shape); 4 heads keep Ulysses degrees 2 and 4 possible.
    torch.manual_seed(seed + 3)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=text_width, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=[8, 12, 12],
    ).eval()

    scheduler = flow_scheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return {
        "tokenizer": clip_tok, "tokenizer_2": t5_tok, "text_encoder": clip, "text_encoder_2": t5,
        "vae": vae, "transformer": transformer, "scheduler": scheduler,
    }


def save_flux(folder: Path, parts: dict) -> None:
    """Write flux_components' parts as a diffusers FluxPipeline folder (replacing `folder`)."""
    save_parts(folder, parts)
    write_model_index(
        folder,
        "FluxPipeline",
        {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": ("transformers", "CLIPTextModel"),
            "text_encoder_2": ("transformers", "T5EncoderModel"),
            "tokenizer": ("transformers", "CLIPTokenizer"),
            "tokenizer_2": ("transformers", "T5TokenizerFast"),
            "transformer": ("diffusers", "FluxTransformer2DModel"),
            "vae": ("diffusers", "AutoencoderKL"),
            "image_encoder": (None, None),
            "feature_extractor": (None, None),
        },
    )


def cosmos_components(seed: int, text_width: int = TEXT_WIDTH, layers: int = 4, mlp_ratio: float = 2.0) -> dict:
    """Cosmos-Predict2's component set, shrunk: T5 encoder, Wan 3D VAE (2x time, 8x space), Cosmos DiT of
    `layers` blocks with feed-forwards `mlp_ratio` x its width (random)."""
    t5_tok = t5_tokenizer(max_length=512)
    t5 = t5_encoder(len(t5_tok), seed, text_width)

    # 16 latent channels per 8x8 pixels and 2 frames: a linear code (PCA) of that size keeps the shape
    # of 90% of held-out clips, one of Wan's 4x-time size (8 channels per 4 frames) 48%. The decoder
    # stays 8 wide at full resolution, where its 3D convolutions dominate CPU time (a 17-frame 128x128
    # clip decodes in about 1.3 s on 2 cores); the encoder, used once per clip, is 16 wide.
    z_dim = 16
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(
        base_dim=16, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, False, True], latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
    ).eval()

    torch.manual_seed(seed + 2)
    transformer = CosmosTransformer3DModel(
        in_channels=z_dim + 1, out_channels=z_dim, num_attention_heads=4, attention_head_dim=32, num_layers=layers,
        mlp_ratio=mlp_ratio, text_embed_dim=text_width, adaln_lora_dim=32, max_size=(32, 64, 64), patch_size=(1, 2, 2),
        rope_scale=(1.0, 1.0, 1.0), concat_padding_mask=True, extra_pos_embed_type=None,
    ).eval()

    # Cosmos-Predict2's scheduler: Karras sigmas in the EDM parameterisation, as its checkpoints ship.
    scheduler = flow_scheduler(use_karras_sigmas=True, shift=1.0, use_dynamic_shifting=False)
    return {"tokenizer": t5_tok, "text_encoder": t5, "vae": vae, "transformer": transformer, "scheduler": scheduler}


def save_cosmos(folder: Path, parts: dict) -> None:
    """Write cosmos_components' parts as a diffusers Cosmos2VideoToWorldPipeline folder (replacing `folder`)."""
    save_parts(folder, parts)
    write_model_index(
        folder,
        "Cosmos2VideoToWorldPipeline",
        {
            "safety_checker": ("cosmos_guardrail", "CosmosSafetyChecker"),
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": ("transformers", "T5EncoderModel"),
            "tokenizer": ("transformers", "T5TokenizerFast"),
            "transformer": ("diffusers", "CosmosTransformer3DModel"),
            "vae": ("diffusers", "AutoencoderKLWan"),
        },
    )


def qwen_chat_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with Qwen's chat template and special tokens (<|im_start|>, <|im_end|> as
    end of sequence, <|vision_start|>, which Cosmos3OmniPipeline asks for): caption words are whole
    tokens, anything else is one unknown token; ids stay below 64."""
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<unk>"]
    words = special + ["\n", "system", "user", "assistant", ".", "video", "image", "is", "of", "resolution",
                       "seconds", "long", "and", "FPS", "not"]
    words += [w for w in dict.fromkeys(CAPTION_WORDS) if w not in words]
    vocab = {word: i for i, word in enumerate(words[:64])}
    model = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    model.add_special_tokens(special)
    template = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", chat_template=template)


COSMOS3_TINY_TRANSFORMER = dict(
    hidden_size=32, head_dim=8, num_attention_heads=24, num_key_value_heads=2, intermediate_size=64,
    num_hidden_layers=2, vocab_size=64, latent_channel=4, latent_patch_size=2, patch_latent_dim=16,
    rope_axes_dim=(2, 1, 1), rope_theta=10000.0, unified_3d_mrope_temporal_modality_margin=100,
)
"""Cosmos 3's transformer shrunk: 24 query heads (split by 2, 3, 4 and 8 ranks) over 2 K/V heads, so
Ulysses degrees 3, 4 and 8 repeat K/V heads; mRoPE sections (2, 1, 1) fill head_dim / 2."""


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
    latent_channels = FLUX2_TINY_TRANSFORMER["in_channels"] // 4
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=latent_channels,
                             norm_num_groups=4).eval()
    with torch.no_grad():  # statistics as a trained VAE has them, so that decode's de-normalisation is exercised
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    torch.manual_seed(seed + 2)
    transformer = Flux2Transformer2DModel(**{**FLUX2_TINY_TRANSFORMER, "guidance_embeds": variant == "dev"}).eval()
    with torch.no_grad():  # diffusers zero-initialises some projections: random values exercise every path
        for parameter in transformer.parameters():
            parameter.normal_(0.0, 0.1)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096, shift=3.0)
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "transformer": transformer,
            "scheduler": scheduler}


def save_flux2(folder: Path, parts: dict) -> None:
    """Write flux2_components' parts as a diffusers Flux2KleinPipeline or Flux2Pipeline folder (replacing `folder`)."""
    save_parts(folder, parts)
    klein = isinstance(parts["text_encoder"], Qwen3ForCausalLM)
    write_model_index(
        folder,
        "Flux2KleinPipeline" if klein else "Flux2Pipeline",
        {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": ("transformers", type(parts["text_encoder"]).__name__),
            "tokenizer": ("transformers", type(parts["tokenizer"]).__name__),
            "transformer": ("diffusers", "Flux2Transformer2DModel"),
            "vae": ("diffusers", "AutoencoderKLFlux2"),
        },
    )
    if klein:  # a base (not step-distilled) checkpoint: Flux2KleinPipeline applies classifier-free guidance
        index_path = folder / "model_index.json"
        index = {**json.loads(index_path.read_text()), "is_distilled": False}
        index_path.write_text(json.dumps(index, indent=2) + "\n")


def write_tiny_flux2(spec: ModelSpec, folder: Path) -> None:
    """A tiny random checkpoint of `spec`'s pipeline class in `folder` (the FLUX.2 record's tiny_checkpoint):
    Flux2Pipeline's with dev's Mistral encoder, else Flux2KleinPipeline's with Qwen3."""
    variant = "dev" if spec.checkpoint_class == "Flux2Pipeline" else "klein"
    save_flux2(folder, flux2_components(seed=0, variant=variant))


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
    transformer = Cosmos3OmniTransformer(**COSMOS3_TINY_TRANSFORMER).eval()
    with torch.no_grad():  # diffusers zero-initialises some projections: random values exercise every path
        for parameter in transformer.parameters():
            parameter.normal_(0.0, 0.1)
    scheduler = UniPCMultistepScheduler(use_karras_sigmas=True, use_flow_sigmas=True,
                                        prediction_type="flow_prediction", sigma_max=200.0, sigma_min=0.147)
    return {"text_tokenizer": qwen_chat_tokenizer(), "vae": vae, "transformer": transformer, "scheduler": scheduler}


def save_cosmos3(folder: Path, parts: dict) -> None:
    """Write cosmos3_components' parts as a diffusers Cosmos3OmniPipeline folder (replacing `folder`)."""
    save_parts(folder, parts)
    write_model_index(
        folder,
        "Cosmos3OmniPipeline",
        {
            "scheduler": ("diffusers", "UniPCMultistepScheduler"),
            "text_tokenizer": ("transformers", "PreTrainedTokenizerFast"),
            "transformer": ("diffusers", "Cosmos3OmniTransformer"),
            "vae": ("diffusers", "AutoencoderKLWan"),
        },
    )


def write_tiny_cosmos3(spec: ModelSpec, folder: Path) -> None:
    """A tiny random Cosmos 3 checkpoint in `folder` (the Cosmos 3 record's tiny_checkpoint; one for every
    checkpoint of the family)."""
    save_cosmos3(folder, cosmos3_components(seed=0))


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
        transformers[name] = WanTransformer3DModel(**config).eval()
        with torch.no_grad():  # diffusers zero-initialises some projections: random values exercise every path
            for parameter in transformers[name].parameters():
                parameter.normal_(0.0, 0.1)
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
    save_parts(folder, parts)
    components = {
        "scheduler": ("diffusers", "UniPCMultistepScheduler"),
        "text_encoder": ("transformers", "UMT5EncoderModel"),
        "tokenizer": ("transformers", "T5TokenizerFast"),
        "transformer": ("diffusers", "WanTransformer3DModel"),
        "vae": ("diffusers", "AutoencoderKLWan"),
    }
    if "image_encoder" in parts:
        components.update(image_encoder=("transformers", "CLIPVisionModel"),
                          image_processor=("transformers", "CLIPImageProcessor"))
    if "transformer_2" in parts:
        components.update(transformer_2=("diffusers", "WanTransformer3DModel"))
    image = "image_encoder" in parts if image_to_video is None else image_to_video
    write_model_index(folder, "WanImageToVideoPipeline" if image else "WanPipeline", components)
    index = json.loads((folder / "model_index.json").read_text())
    # as the published folders write them (a missing component as [null, null])
    index.update(boundary_ratio=boundary_ratio, expand_timesteps=expand_timesteps)
    for name in ("transformer_2", "image_encoder", "image_processor"):
        index.setdefault(name, [None, None])
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


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


def save_parts(folder: Path, parts: dict) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for name, part in parts.items():
        if isinstance(part, torch.nn.Module):
            part.save_pretrained(folder / name, safe_serialization=True)
        else:
            part.save_pretrained(folder / name)
    # Parts loaded from a folder (training --init) remember where they came from; that is not the model.
    for config in folder.rglob("*config.json"):
        data = json.loads(config.read_text())
        if any(key in data for key in LOAD_TIME_KEYS):
            config.write_text(json.dumps({k: v for k, v in data.items() if k not in LOAD_TIME_KEYS}, indent=2) + "\n")


LOAD_TIME_KEYS = ("_name_or_path", "is_local", "local_files_only")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m training.tiny_models", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "assets",
                        help="folder that receives tiny-flux/ and tiny-cosmos/")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    save_flux(args.out / "tiny-flux", flux_components(args.seed))
    save_cosmos(args.out / "tiny-cosmos", cosmos_components(args.seed + 100))
    for name in ("tiny-flux", "tiny-cosmos"):
        size = sum(p.stat().st_size for p in (args.out / name).rglob("*") if p.is_file())
        print(f"{name}: {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
