"""A family's transformer called at one size: its keyword arguments, random values of the right shapes.

Each family's record names its builder (BenchShapes.inputs). The work estimate (pipelines.work) counts
a request's FLOPs on meta tensors built by it; the benchmarks time real calls built by it. A builder
takes the transformer's config (a dict), a Shape, and batch / device / dtype, and returns the keyword
arguments and the number of image or video tokens the call attends over. A new family may keep its
builder in its own module: the record names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

VAE_TIME, VAE_SPACE = 4, 8  # latent = ((frames - 1) / 4 + 1, height / 8, width / 8)


@dataclass(kw_only=True, frozen=True)
class Shape:
    """One input size: an image (frames=1) or a video, in pixels."""

    height: int
    width: int
    frames: int = 1
    text_tokens: int = 512
    reference: tuple[int, int] | None = None
    """A reference image's height and width in pixels, whose tokens follow the image's (Qwen-Image-Edit), or None;
    the builders of families without one leave it out."""

    @property
    def label(self) -> str:
        """Human-readable size."""
        return f"{self.height}x{self.width}" if self.frames == 1 else f"{self.frames}x{self.height}x{self.width}"


def flux_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
                dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """FluxTransformer2DModel keyword arguments for a packed latent of `shape` (2x2 latent patches)."""
    rows, cols = shape.height // (VAE_SPACE * 2), shape.width // (VAE_SPACE * 2)
    g = torch.Generator().manual_seed(0)
    img_ids = torch.zeros(rows, cols, 3)
    img_ids[..., 1] = torch.arange(rows)[:, None]
    img_ids[..., 2] = torch.arange(cols)[None, :]
    inputs = dict(
        hidden_states=torch.randn(batch, rows * cols, config["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(batch, shape.text_tokens, config["joint_attention_dim"], generator=g),
        pooled_projections=torch.randn(batch, config["pooled_projection_dim"], generator=g),
        timestep=torch.full((batch,), 0.5),
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(shape.text_tokens, 3),
        guidance=torch.full((batch,), 3.5) if config.get("guidance_embeds") else None,
    )
    out = {k: v.to(device, dtype if k not in ("img_ids", "txt_ids") else v.dtype) if v is not None else None
           for k, v in inputs.items()}
    return {**out, "joint_attention_kwargs": None, "return_dict": False}, rows * cols


def flux2_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """Flux2Transformer2DModel keyword arguments for a packed latent of `shape` (2x2 latent patches), with
    FLUX.2's 4-axis ids as its pipelines make them: image (0, row, column, 0), text (0, 0, 0, position)."""
    rows, cols = shape.height // (VAE_SPACE * 2), shape.width // (VAE_SPACE * 2)
    g = torch.Generator().manual_seed(0)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(rows), torch.arange(cols), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(shape.text_tokens))
    inputs = dict(
        hidden_states=torch.randn(batch, rows * cols, config.get("in_channels", 128), generator=g),
        encoder_hidden_states=torch.randn(batch, shape.text_tokens, config["joint_attention_dim"], generator=g),
        timestep=torch.full((batch,), 0.5),
        guidance=torch.full((batch,), 4.0) if config.get("guidance_embeds", True) else None,
    )
    out = {k: v.to(device, dtype) if v is not None else None for k, v in inputs.items()}
    return {**out, "img_ids": img_ids.to(device), "txt_ids": txt_ids.to(device), "joint_attention_kwargs": None,
            "return_dict": False}, rows * cols


def cosmos_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
                  dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """CosmosTransformer3DModel (Video2World) keyword arguments for a video of `shape`."""
    frames = (shape.frames - 1) // VAE_TIME + 1
    height, width = shape.height // VAE_SPACE, shape.width // VAE_SPACE
    g = torch.Generator().manual_seed(0)
    latent = (batch, config["out_channels"], frames, height, width)
    inputs: dict[str, Any] = dict(
        hidden_states=torch.randn(*latent, generator=g),
        timestep=torch.rand(batch, 1, frames, 1, 1, generator=g),
        encoder_hidden_states=torch.randn(batch, shape.text_tokens, config["text_embed_dim"], generator=g),
        padding_mask=torch.zeros(1, 1, shape.height, shape.width),
    )
    if config["in_channels"] == config["out_channels"] + 1:
        inputs["condition_mask"] = torch.zeros(batch, 1, frames, height, width)
    inputs = {k: v.to(device, dtype) for k, v in inputs.items()}
    p_t, p_h, p_w = config["patch_size"]
    tokens = (frames // p_t) * (height // p_h) * (width // p_w)
    return {**inputs, "fps": 16, "return_dict": False}, tokens


def cosmos3_call(config: Any, ids: list[int], latents: torch.Tensor, *, image_condition: bool = False,
                 timestep: float = 500.0, fps: float = 24.0) -> dict[str, Any]:
    """Cosmos3OmniTransformer keyword arguments of one call (one sequence: the model takes no batch),
    packed by Cosmos3OmniPipeline's own helpers: prompt token `ids`, then `latents` [1, C, T, h, w] in
    2x2 patches; with image_condition the first latent frame is given (image-to-video). `config` is
    the transformer's config (attributes)."""
    from types import SimpleNamespace

    from diffusers import Cosmos3OmniPipeline

    packer = SimpleNamespace(transformer=SimpleNamespace(config=config), vae_scale_factor_temporal=VAE_TIME)
    text = Cosmos3OmniPipeline._prepare_text_segment(packer, ids, "cpu")
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        packer, latents, has_image_condition=image_condition, mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=fps, curr=text["und_len"], device="cpu")
    return dict(
        input_ids=text["input_ids"], text_indexes=text["text_indexes"],
        position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
        und_len=text["und_len"], sequence_length=text["und_len"] + vision["num_vision_tokens"],
        vision_tokens=[latents], vision_token_shapes=vision["vision_token_shapes"],
        vision_sequence_indexes=vision["vision_sequence_indexes"],
        vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
        vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), timestep),
        vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"],
    )


def cosmos3_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
                   dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """Cosmos3OmniTransformer keyword arguments of one guidance call (`batch` is not used: the model
    takes one sequence) for a text-to-video request of `shape`: shape.text_tokens prompt tokens, then
    the Wan 2.2 VAE's latent (16x space, 4x time)."""
    import inspect
    from types import SimpleNamespace

    from diffusers import Cosmos3OmniTransformer

    defaults = {name: p.default for name, p in inspect.signature(Cosmos3OmniTransformer.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    full = SimpleNamespace(**{**defaults, **config})
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(full.vocab_size, (shape.text_tokens,), generator=g).tolist()
    latent = torch.randn(1, full.latent_channel, (shape.frames - 1) // VAE_TIME + 1, shape.height // 16,
                         shape.width // 16, generator=g)
    inputs = cosmos3_call(full, ids, latent)
    moved = {key: ([v.to(device, dtype) for v in value] if key == "vision_tokens" else
                   [v.to(device) for v in value] if key == "vision_noisy_frame_indexes" else
                   value.to(device, torch.float32 if value.is_floating_point() else value.dtype)
                   if isinstance(value, torch.Tensor) else value) for key, value in inputs.items()}
    return {**moved, "return_dict": False}, len(inputs["vision_sequence_indexes"])


def wan_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
               dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """WanTransformer3DModel (Wan 2.1) keyword arguments for a video of `shape`: the Wan 2.1 VAE's latent (8x
    space, 4x time; an image-to-video config's in_channels add the image's), shape.text_tokens text embeddings,
    one timestep per batch row; an image-to-video config (image_dim) also gets CLIP ViT-H/14's 257 image tokens."""
    return _wan_call(config, shape, batch=batch, device=device, dtype=dtype, space=VAE_SPACE, per_token=False)


def wan22_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """WanTransformer3DModel (Wan 2.2 TI2V) keyword arguments for a video of `shape`: the Wan 2.2 VAE's latent (16x
    space, 4x time), shape.text_tokens text embeddings, a timestep per token ([batch, tokens]: expand_timesteps)."""
    return _wan_call(config, shape, batch=batch, device=device, dtype=dtype, space=2 * VAE_SPACE, per_token=True)


WAN_IMAGE_TOKENS = 257
"""CLIP ViT-H/14's hidden states of one 224 px image: a class token and 16 x 16 patches."""


def _wan_call(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device, dtype: torch.dtype,
              space: int, per_token: bool) -> tuple[dict[str, Any], int]:
    frames = (shape.frames - 1) // VAE_TIME + 1
    height, width = shape.height // space, shape.width // space
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), frames, height, width, generator=g),
        encoder_hidden_states=torch.randn(batch, shape.text_tokens, config.get("text_dim", 4096), generator=g),
    )
    if config.get("image_dim") is not None:
        inputs["encoder_hidden_states_image"] = torch.randn(batch, WAN_IMAGE_TOKENS, config["image_dim"], generator=g)
    inputs = {k: v.to(device, dtype) for k, v in inputs.items()}
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    tokens = (frames // p_t) * (height // p_h) * (width // p_w)
    timestep = torch.full((batch, tokens) if per_token else (batch,), 500.0, device=device)
    return {**inputs, "timestep": timestep, "return_dict": False}, tokens


