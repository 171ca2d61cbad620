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
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLWan,
    CosmosTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
)
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

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


def random_transformer(transformer: torch.nn.Module) -> torch.nn.Module:
    """`transformer` in eval mode with every parameter drawn from N(0, 0.1): diffusers zero-initialises some
    projections, and random values exercise every path."""
    with torch.no_grad():
        for parameter in transformer.parameters():
            parameter.normal_(0.0, 0.1)
    return transformer.eval()


def flux2_vae(latent_channels: int, seed: int) -> AutoencoderKLFlux2:
    """A tiny random FLUX.2 VAE (FLUX.2's and FLUX.3's), its batch-norm statistics as a trained VAE has them, so
    that decode's de-normalisation is exercised."""
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=latent_channels,
                             norm_num_groups=4).eval()
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def save_pipeline(folder: Path, class_name: str, parts: dict, **index: Any) -> None:
    """Write `parts` as a diffusers `class_name` folder, replacing `folder`: each part in its subfolder and
    model_index.json naming each part's library and class, as diffusers' save_pretrained writes them; `index`: the
    index's further entries (the pipeline's settings, a component the folder lacks as [None, None])."""
    import diffusers

    save_parts(folder, parts)
    entries = {name: [type(part).__module__.partition(".")[0], type(part).__name__] for name, part in parts.items()}
    model_index = {"_class_name": class_name, "_diffusers_version": diffusers.__version__, **entries, **index}
    (folder / "model_index.json").write_text(json.dumps(model_index, indent=2) + "\n")


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
    save_pipeline(folder, "FluxPipeline", parts, image_encoder=[None, None], feature_extractor=[None, None])


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
    save_pipeline(folder, "Cosmos2VideoToWorldPipeline", parts,
                  safety_checker=["cosmos_guardrail", "CosmosSafetyChecker"])


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
