"""Cosmos 3's transformer called at one size (its record's BenchShapes.inputs; pipelines.transformer_inputs says
what a builder takes and returns)."""

from __future__ import annotations

from typing import Any

import torch

from pipelines.transformer_inputs import VAE_TIME, Shape


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
