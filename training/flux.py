"""Training tiny-flux: its AutoencoderKL, then its FluxTransformer2DModel by rectified flow, as FLUX is trained.

The transformer learns what pipelines/flux/pipeline.py's loop asks of it: packed latents
x_s = (1 - s) x0 + s noise, the timestep s in [0, 1] (the loop passes scheduler timesteps / 1000),
and the velocity noise - x0, which FlowMatchEulerDiscreteScheduler integrates. Training s is drawn
logit-normal and moved by the same resolution-dependent shift (mu) the loop applies to its sigmas.
The T5 encoder trains with the transformer: FLUX gives text tokens no positions (txt_ids are zero),
so which colour belongs to the shape and which to the background must come from T5's context
mixing, which a random T5 does only faintly. CLIP stays frozen: its pooled vector is a global
caption code for the modulation, which a random CLIP already provides.

Guidance distillation (optional, `distill_share` > 0), as FLUX.1-dev is guidance-distilled: the
first phase also learns the empty prompt (`prompt_dropout`); a frozen copy of the result is then
the teacher, and the transformer learns to output, for a guidance value g fed to its guidance
embedding, what classifier-free guidance of the teacher gives: v_uncond + g (v_cond - v_uncond).
So one transformer call per step buys what CFG buys with two.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift

from training import shapes
from training.autoencoder import latent_statistics, reconstruction_loss
from training.loop import POOL_SHARE, LatentPool, PhaseResult, TokenCache, frozen, frozen_on, run_phase


@dataclass(kw_only=True, slots=True)
class FluxSettings:
    """Batch sizes, resolutions and learning rates of the two tiny-flux phases."""

    sizes: tuple[int, ...] = (256, 128)
    """Square training resolutions, used in turn; the first is the registry's default size."""
    vae_batch: int = 32
    dit_batch: int = 128
    vae_lr: float = 5e-4
    dit_lr: float = 5e-4
    max_sequence_length: int = 64
    """T5 tokens, as tiny-flux's registry spec encodes prompts."""
    pool_batches: int = 256
    """Batches per training size encoded once into the transformer phases' latent pool (training.loop.LatentPool)."""
    guidance_range: tuple[float, float] = (1.0, 5.0)
    """Guidance values drawn in training (the registry's default, 3.5, lies inside)."""
    prompt_dropout: float = 0.0
    """Share of captions replaced by the empty prompt (the unconditional branch distillation needs)."""
    distill_share: float = 0.0
    """Share of the transformer's budget spent on guidance distillation (0: the guidance input is
    trained with random values and learns to ignore them)."""


def train_flux(parts: dict, *, device: torch.device, generator: torch.Generator, settings: FluxSettings,
               vae_seconds: float, dit_seconds: float, vae_steps: int | None = None,
               dit_steps: int | None = None) -> list[PhaseResult]:
    """Fit parts['vae'], set its latent shift and scale, then train parts['transformer'] and T5, in place."""
    frozen_on(parts, device)
    vae = parts["vae"]
    results = []
    if vae_seconds > 0:  # else (a run that starts from trained weights) the VAE and its normalisation stay
        results.append(_train_vae(vae, device, generator, settings, vae_seconds, vae_steps))
        frozen(vae)
        scenes = shapes.image_scenes(64, generator)
        with torch.no_grad():
            images = shapes.render(scenes, settings.sizes[0], settings.sizes[0], device)[:, :, 0]
            latents = vae.encode(images).latent_dist.mode()
        mean, std = latent_statistics(latents, per_channel=False)
        vae.register_to_config(shift_factor=round(float(mean), 4), scaling_factor=round(float(1 / std), 4))
    print(f"[flux-vae] latent shift {vae.config.shift_factor} scale {vae.config.scaling_factor}", flush=True)
    pools, pool_seconds = _latent_pools(vae, device, generator, settings, dit_steps, POOL_SHARE * dit_seconds)
    dit_seconds = max(dit_seconds - pool_seconds, 0.0)
    share = settings.distill_share
    results.append(_train_transformer(parts, pools, device, generator, settings, dit_seconds * (1 - share), dit_steps))
    if share > 0:
        results.append(_distill_guidance(parts, pools, device, generator, settings, dit_seconds * share, dit_steps))
    return results


def _latent_pools(vae, device, generator, settings, max_steps, max_seconds) -> tuple[dict[int, LatentPool], float]:
    """Per training size, a pool of scenes with their packed, normalised latents."""
    batches = settings.pool_batches if max_steps is None else min(settings.pool_batches, max_steps)

    def encoder(size: int):
        def make() -> tuple[list[str], torch.Tensor]:
            scenes = shapes.image_scenes(settings.dit_batch, generator)
            latents = vae.encode(shapes.render(scenes, size, size, device)[:, :, 0]).latent_dist.mode()
            x0 = (latents.float() - vae.config.shift_factor) * vae.config.scaling_factor
            batch, channels, height, width = x0.shape
            return scenes.captions, FluxPipeline._pack_latents(x0, batch, channels, height, width)
        return make

    pools = {size: LatentPool(encoder(size), batches, max_seconds / len(settings.sizes)) for size in settings.sizes}
    seconds = sum(pool.seconds for pool in pools.values())
    print(f"[flux-dit] latent pools: {', '.join(f'{len(p)} scenes at {s}px' for s, p in pools.items())} "
          f"in {seconds:.0f}s", flush=True)
    return pools, seconds


def _train_vae(vae, device, generator, settings, seconds, max_steps) -> PhaseResult:
    vae.requires_grad_(True)
    counter = iter(range(1 << 62))

    def step() -> torch.Tensor:
        size = settings.sizes[next(counter) % len(settings.sizes)]
        x = shapes.render(shapes.image_scenes(settings.vae_batch, generator), size, size, device)[:, :, 0]
        return reconstruction_loss(vae, x)

    return run_phase("flux-vae", step, [vae], seconds=seconds, max_steps=max_steps, lr=settings.vae_lr,
                     batch=settings.vae_batch, ema_decay=0.999)


class PromptEncoder:
    """(T5 token embeddings, CLIP pooled embedding) as FluxImagePipeline.encode computes them.

    The frozen CLIP's pooled vector is cached per caption; T5 (trained) runs on every batch.
    """

    def __init__(self, parts: dict, device: torch.device, max_length: int) -> None:
        self.parts, self.device = parts, device
        self.clip_tokens = TokenCache(parts["tokenizer"], parts["tokenizer"].model_max_length)
        self.t5_tokens = TokenCache(parts["tokenizer_2"], max_length)
        self.pooled: dict[str, torch.Tensor] = {}

    def __call__(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        missing = list(dict.fromkeys(c for c in captions if c not in self.pooled))
        if missing:
            clip_ids, _ = self.clip_tokens(missing, self.device)
            with torch.no_grad():
                pooled = self.parts["text_encoder"](clip_ids, output_hidden_states=False).pooler_output.float()
            self.pooled.update(zip(missing, pooled))
        t5_ids, _ = self.t5_tokens(captions, self.device)
        text = self.parts["text_encoder_2"](t5_ids, output_hidden_states=False)[0]
        return text, torch.stack([self.pooled[c] for c in captions])


def _train_transformer(parts, pools, device, generator, settings, seconds, max_steps) -> PhaseResult:
    transformer, t5 = parts["transformer"], parts["text_encoder_2"]
    transformer.requires_grad_(True)
    t5.requires_grad_(True)
    config = parts["scheduler"].config
    counter = iter(range(1 << 62))
    encode_prompts = PromptEncoder(parts, device, settings.max_sequence_length)

    def step() -> torch.Tensor:
        size = settings.sizes[next(counter) % len(settings.sizes)]
        batch = settings.dit_batch
        captions, x0, image_ids, noise, sigma, noisy, guidance = _noisy_batch(pools[size], device, generator,
                                                                              settings, config)
        captions = [c if keep else "" for c, keep in
                    zip(captions, (torch.rand(batch, generator=generator) >= settings.prompt_dropout).tolist())]
        text, pooled = encode_prompts(captions)
        velocity = transformer(
            hidden_states=noisy, timestep=sigma, guidance=guidance, pooled_projections=pooled,
            encoder_hidden_states=text, txt_ids=torch.zeros(text.shape[1], 3, device=device),
            img_ids=image_ids, return_dict=False,
        )[0]
        return (velocity.float() - (noise - x0)).square().mean()

    return run_phase("flux-dit", step, [transformer, t5], seconds=seconds, max_steps=max_steps, lr=settings.dit_lr,
                     batch=settings.dit_batch, ema_decay=0.999)


def _noisy_batch(pool: LatentPool, device, generator, settings, config):
    """A batch from the pool: captions, packed latents x0, image ids, noise, times s, x_s and guidance values."""
    captions, x0 = pool.sample(settings.dit_batch, generator)
    return (captions, x0, *_noised(x0, device, generator, settings, config))


def _noised(x0: torch.Tensor, device, generator, settings, config):
    """Packed latents x0 [B, L, C] -> image ids, noise, times s, x_s and guidance values."""
    batch = x0.shape[0]
    side = math.isqrt(x0.shape[1])  # square training sizes: side x side packed tokens
    image_ids = FluxPipeline._prepare_latent_image_ids(batch, side, side, device, x0.dtype)
    noise = torch.randn(x0.shape, generator=generator).to(device)
    sigma = _flux_sigmas(batch, x0.shape[1], config, generator).to(device)
    noisy = (1 - sigma.view(-1, 1, 1)) * x0 + sigma.view(-1, 1, 1) * noise
    low, high = settings.guidance_range
    guidance = (low + (high - low) * torch.rand(batch, generator=generator)).to(device)
    return image_ids, noise, sigma, noisy, guidance


def _distill_guidance(parts, pools, device, generator, settings, seconds, max_steps) -> PhaseResult:
    """Teach the guidance input what classifier-free guidance of a frozen copy (the teacher) does."""
    transformer = parts["transformer"]
    teacher = frozen(copy.deepcopy(transformer))
    frozen(parts["text_encoder_2"])  # the teacher's text encoder: both read the same embeddings
    transformer.requires_grad_(True)
    config = parts["scheduler"].config
    counter = iter(range(1 << 62))
    encode_prompts = PromptEncoder(parts, device, settings.max_sequence_length)
    with torch.no_grad():
        empty_text, empty_pooled = encode_prompts([""])  # the unconditional branch: T5 is frozen here

    def step() -> torch.Tensor:
        size = settings.sizes[next(counter) % len(settings.sizes)]
        captions, _, image_ids, _, sigma, noisy, guidance = _noisy_batch(pools[size], device, generator,
                                                                         settings, config)
        batch = noisy.shape[0]
        with torch.no_grad():
            text, pooled = encode_prompts(captions)
            inputs = dict(timestep=sigma.repeat(2), guidance=guidance.repeat(2), img_ids=image_ids,
                          txt_ids=torch.zeros(text.shape[1], 3, device=device), return_dict=False)
            both = teacher(hidden_states=noisy.repeat(2, 1, 1),
                           encoder_hidden_states=torch.cat([text, empty_text.expand(batch, -1, -1)]),
                           pooled_projections=torch.cat([pooled, empty_pooled.expand(batch, -1)]),
                           **inputs)[0].float()
            conditional, unconditional = both.chunk(2)
            target = unconditional + guidance.view(-1, 1, 1) * (conditional - unconditional)
        velocity = transformer(
            hidden_states=noisy, timestep=sigma, guidance=guidance, pooled_projections=pooled,
            encoder_hidden_states=text, txt_ids=torch.zeros(text.shape[1], 3, device=device),
            img_ids=image_ids, return_dict=False,
        )[0]
        return (velocity.float() - target).square().mean()

    return run_phase("flux-distill", step, [transformer], seconds=seconds, max_steps=max_steps,
                     lr=settings.dit_lr * 0.5, batch=settings.dit_batch, ema_decay=0.999)


def _flux_sigmas(batch: int, image_seq_len: int, config, generator: torch.Generator) -> torch.Tensor:
    """Logit-normal times (a fifth uniform, so both ends are seen), shifted as the pipeline shifts its sigmas."""
    u = torch.sigmoid(torch.randn(batch, generator=generator))
    uniform = torch.rand(batch, generator=generator)
    u = torch.where(torch.rand(batch, generator=generator) < 0.2, uniform, u).clamp(1e-4, 1.0)
    mu = calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                         config.get("base_shift", 0.5), config.get("max_shift", 1.15))
    return math.exp(mu) / (math.exp(mu) + (1 / u - 1))
