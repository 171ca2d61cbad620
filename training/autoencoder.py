"""Fitting the small VAEs: reconstruction with extra weight on the shape, plus a small KL term."""

from __future__ import annotations

import torch
import torch.distributed as dist

KL_WEIGHT = 1e-4
"""Per-element KL weight: enough to keep the latent space smooth for the DiT, small next to reconstruction."""
OBJECT_WEIGHT = 4.0
"""Extra weight of pixels that differ from the background: shapes are a small part of each image."""


def reconstruction_loss(vae: torch.nn.Module, x: torch.Tensor, background: torch.Tensor | None = None) -> torch.Tensor:
    """L1 + MSE reconstruction of x ([B, 3, H, W] or [B, 3, T, H, W] in [-1, 1]) plus KL to N(0, 1).

    `background` ([B, 3] in [-1, 1]) marks which pixels are object; by default the top-left pixel's colour,
    which is background in every whole generated scene (shapes keep a margin from the edges)."""
    posterior = vae.encode(x).latent_dist
    reconstruction = vae.decode(posterior.sample()).sample.float()
    if background is None:
        background = x[..., :1, :1]
    else:
        background = background.view(*background.shape, *[1] * (x.dim() - 2))
    weight = 1.0 + OBJECT_WEIGHT * ((x - background).abs().sum(1, keepdim=True) > 0.02).float()
    error = reconstruction - x
    pixel = (weight * (error.abs() + error.square())).mean()
    kl = 0.5 * (posterior.mean.float().square() + posterior.var.float() - 1.0 - posterior.logvar.float()).mean()
    return pixel + KL_WEIGHT * kl


@torch.no_grad()
def latent_statistics(latents: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of VAE latents [B, C, ...], per channel or over everything; under torchrun,
    of every rank's latents together, so that every rank normalises its latents alike."""
    latents = latents.double()  # sums of squares of ~10^5 values: float32 would lose digits
    flat = latents.transpose(0, 1).reshape(latents.shape[1], -1) if per_channel else latents.reshape(1, -1)
    moments = torch.stack([flat.sum(1), flat.square().sum(1), torch.full_like(flat[:, 0], flat.shape[1])])
    if dist.is_initialized():
        dist.all_reduce(moments)
    total, squares, count = moments
    mean = total / count
    std = ((squares - count * mean.square()) / (count - 1)).clamp(min=0).sqrt()
    mean, std = mean.float(), std.float()
    return (mean, std) if per_channel else (mean[0], std[0])
