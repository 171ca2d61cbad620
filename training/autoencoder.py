"""Fitting the small VAEs: reconstruction with extra weight on the shape, plus a small KL term, optionally from
blurred latents."""

from __future__ import annotations

import torch
import torch.distributed as dist

KL_WEIGHT = 1e-4
"""Per-element KL weight: enough to keep the latent space smooth for the DiT, small next to reconstruction."""
OBJECT_WEIGHT = 4.0
"""Extra weight of pixels that differ from the background: shapes are a small part of each image."""


def reconstruction_loss(vae: torch.nn.Module, x: torch.Tensor, background: torch.Tensor | None = None,
                        latent_blur: float = 0.0, latent_noise: float = 0.0) -> torch.Tensor:
    """L1 + MSE reconstruction of x ([B, 3, H, W] or [B, 3, T, H, W] in [-1, 1]) plus KL to N(0, 1).

    `background` ([B, 3] in [-1, 1]) marks which pixels are object; by default the top-left pixel's colour,
    which is background in every whole generated scene (shapes keep a margin from the edges).
    `latent_blur` > 0 decodes each sample's latents blurred (blur_latents) with a standard deviation drawn
    uniformly from [0, latent_blur] latent pixels: what survives a blur is all the decoder can rely on, so the
    encoder has to carry the shape in codes that spread over the object, which a transformer draws as easily
    as a colour, rather than only in the sharpness of the object's edges, which it draws as a blob.
    `latent_noise` > 0 adds Gaussian noise to each sample's latents, of a standard deviation drawn uniformly from
    [0, latent_noise] times the batch's per-channel latent spread: a transformer's latents are off by about 0.3 of
    it, where the encoder's own noise is 0.02-0.06, and a decoder that never saw such errors turns them into
    off-colour smears, most of all in a video's first latent frame, which it decodes on its own."""
    posterior = vae.encode(x).latent_dist
    latents = posterior.sample()
    if latent_blur > 0:
        latents = blur_latents(latents, latent_blur * torch.rand(len(x), device=x.device))
    if latent_noise > 0:
        spread = latents.detach().transpose(0, 1).reshape(latents.shape[1], -1).std(dim=1)
        sigma = latent_noise * torch.rand(len(x), device=x.device).view(len(x), *[1] * (latents.dim() - 1))
        latents = latents + sigma * spread.view(1, -1, *[1] * (latents.dim() - 2)) * torch.randn_like(latents)
    reconstruction = vae.decode(latents).sample.float()
    if background is None:
        background = x[..., :1, :1]
    else:
        background = background.view(*background.shape, *[1] * (x.dim() - 2))
    weight = 1.0 + OBJECT_WEIGHT * ((x - background).abs().sum(1, keepdim=True) > 0.02).float()
    error = reconstruction - x
    pixel = (weight * (error.abs() + error.square())).mean()
    kl = 0.5 * (posterior.mean.float().square() + posterior.var.float() - 1.0 - posterior.logvar.float()).mean()
    return pixel + KL_WEIGHT * kl


BLUR_RADIUS = 3
"""Taps on each side of blur_latents' kernel: enough for a standard deviation up to about 1.5 latent pixels."""


def blur_latents(latents: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
    """Gaussian blur of latents [B, C, (T,) H, W] over their last two (spatial) axes, edges replicated, with
    standard deviation `sigma` in latent pixels (a float, or one per sample [B]; 0 leaves a sample as it is)."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(len(latents))
    offsets = range(-BLUR_RADIUS, BLUR_RADIUS + 1)
    distance = torch.tensor(offsets, dtype=torch.float32, device=latents.device)
    weights = torch.exp(-0.5 * (distance / sigma.clamp(min=1e-3).view(-1, 1)).square())
    weights = (weights / weights.sum(1, keepdim=True)).to(latents.dtype)  # [B, taps]
    per_sample = (len(latents),) + (1,) * (latents.dim() - 1)
    for axis in (latents.dim() - 2, latents.dim() - 1):
        positions = torch.arange(latents.shape[axis], device=latents.device)
        blurred = torch.zeros_like(latents)
        for tap, offset in enumerate(offsets):
            shifted = latents.index_select(axis, (positions + offset).clamp(0, len(positions) - 1))
            blurred += weights[:, tap].view(per_sample) * shifted
        latents = blurred
    return latents


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
