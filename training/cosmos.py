"""Training tiny-cosmos: its AutoencoderKLWan, then its CosmosTransformer3DModel as pipelines/cosmos/pipeline.py runs
it.

pipelines/cosmos/pipeline.py's loop holds x = x0 + sigma * noise (EDM form, sigma up to 80), feeds the
transformer c_in * x = (1 - t) x0 + t noise with t = sigma / (sigma + 1) as the timestep, and reads
x0 = c_skip * x + c_out * out with c_skip = 1 - t, c_out = -t. So the output that gives the true
x0 is out = noise - x0: rectified-flow velocity on the same interpolation. That is what is trained,
with sigma drawn half log-uniform over [sigma_min, sigma_max] (every step of the Karras schedule is
seen) and half log-normal around 1. Video-to-world: the first 0, 1 or 2 latent frames are given
clean, with indicator 1 in the condition-mask channel, timestep t(sigma_conditioning), and no loss.
The T5 encoder trains with the transformer (prompts in 15% of samples are replaced by the empty
prompt or the registry's negative prompt, so classifier-free guidance has an unconditional branch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipelines.cosmos import torchvision_shim
from pipelines.cosmos.pipeline import SIGMA_CONDITIONING, SIGMA_DATA, SIGMA_MAX, SIGMA_MIN
from training import shapes
from training.autoencoder import latent_statistics, reconstruction_loss
from training.loop import POOL_SHARE, LatentPool, PhaseResult, TokenCache, frozen, frozen_on, run_phase


@dataclass(kw_only=True, slots=True)
class CosmosSettings:
    """Batch sizes, clip shape and learning rates of the two tiny-cosmos phases."""

    size: int = 128
    """Square frame size (tiny-cosmos' registry default)."""
    frames: int = 17
    """Frames per clip (tiny-cosmos' registry default: 5 latent frames)."""
    fps: int = 8
    vae_size: int = 64
    vae_frames: int = 17
    """The VAE is fitted on vae_size x vae_size crops of full-size clips, placed around the object: four
    times the clips per second of whole frames, with shapes at the scale they have at the registry's
    size (its convolutions do not care about the frame size, but do about the shapes' scale). Not on
    fewer frames: fitted on 9-frame clips (2026-11-22), it decoded the first 9 frames of a 17-frame clip
    and garbage after them (its causal caches carry state from chunk to chunk, and chunks it never saw
    drifted)."""
    vae_batch: int = 32
    dit_batch: int = 64
    pool_batches: int = 96
    """Batches encoded once into the transformer phase's latent pool (training.loop.LatentPool)."""
    vae_lr: float = 5e-4
    dit_lr: float = 5e-4
    max_sequence_length: int = 64
    prompt_dropout: float = 0.15
    word_dropout: float = 0.0
    """Probability that a transformer-phase caption leaves out its colour, shape or motion, each on its own
    (shapes.video_scenes): each word has to carry its meaning alone, for combinations never seen whole."""
    moving_half: tuple[float, float] = shapes.MOVING_HALF
    growth: tuple[tuple[float, float], tuple[float, float]] = shapes.GROWTH
    """Object sizes of the training clips (shapes.video_scenes); runs before these were recorded trained on
    moving half-sizes 0.10-0.16 and growth 0.07-0.10 to 0.22-0.27."""
    condition_frames: tuple[float, float, float] = (0.5, 0.35, 0.15)
    """Probabilities of giving 0, 1 or 2 clean latent frames (text2world, image2world, video2world)."""
    latent_blur: float = 0.0
    """Standard deviation, in latent pixels, of the strongest blur of the latents the VAE learns to decode
    (training.autoencoder.reconstruction_loss); 0: none. Its latents before this setting kept the shape of 97% of
    held-out clips, but of 41% once blurred by a 1-2-1 kernel: the shape lived only in the sharpness of the object's
    edges, 1 latent pixel (8 px) wide, and after 40,000 steps the transformer still drew every shape as a blob
    (held-out shape 29%). Refitted with 0.6, the VAE keeps 96% (56% blurred) and 12,500 transformer steps on its
    latents reached 83%; with 1.0, 90% (75% blurred) and 75% (2026-11-26, assets/tiny-cosmos' runs 13-15)."""
    latent_noise: float = 0.0
    """Largest standard deviation, relative to the latents' per-channel spread, of the noise added to the latents
    the VAE learns to decode (training.autoencoder.reconstruction_loss); 0: none."""
    vae_fit: str = "all"
    """"all" fits the whole VAE; "decoder" fits its decoder alone, keeping the encoder, so the latents a
    transformer was trained on, and their statistics, stay as they were."""
    bf16: bool = False
    """Run both phases' forward passes under bfloat16 autocast (weights, optimiser and EMA stay float32)."""
    compile: bool = False
    """torch.compile the transformer for its training steps (a fixed batch shape: one graph)."""


def train_cosmos(parts: dict, *, device: torch.device, generator: torch.Generator, settings: CosmosSettings,
                 vae_seconds: float, dit_seconds: float, vae_steps: int | None = None,
                 dit_steps: int | None = None) -> list[PhaseResult]:
    """Fit parts['vae'], set its per-channel latent statistics, then train the transformer and T5, in place."""
    torchvision_shim.install()
    frozen_on(parts, device)
    vae = parts["vae"]
    results = []
    if vae_seconds > 0:  # else (a run that starts from trained weights) the VAE and its normalisation stay
        results.append(_train_vae(vae, device, generator, settings, vae_seconds, vae_steps))
        frozen(vae)
        if settings.vae_fit == "all":
            scenes = _scenes(16, settings.frames, generator, settings)
            with torch.no_grad():
                latents = vae.encode(shapes.render(scenes, settings.size, settings.size, device)).latent_dist.mode()
            mean, std = latent_statistics(latents, per_channel=True)
            vae.register_to_config(latents_mean=[round(v, 4) for v in mean.tolist()],
                                   latents_std=[round(v, 4) for v in std.tolist()])
    print(f"[cosmos-vae] latents mean {vae.config.latents_mean} std {vae.config.latents_std}", flush=True)
    pool = _latent_pool(vae, device, generator, settings, dit_steps, POOL_SHARE * dit_seconds)
    results.append(_train_transformer(parts, pool, device, generator, settings,
                                      max(dit_seconds - pool.seconds, 0.0), dit_steps))
    return results


def _scenes(batch: int, frames: int, generator: torch.Generator, settings: CosmosSettings,
            word_dropout: float = 0.0) -> shapes.Scenes:
    return shapes.video_scenes(batch, frames, generator, word_dropout=word_dropout,
                               moving_half=settings.moving_half, growth=settings.growth)


def _latent_pool(vae, device, generator, settings, max_steps, max_seconds) -> LatentPool:
    """Clips with their normalised latents (x0 of the transformer's objective)."""
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)

    def make() -> tuple[list[str], torch.Tensor]:
        scenes = _scenes(settings.dit_batch, settings.frames, generator, settings, word_dropout=settings.word_dropout)
        latents = vae.encode(shapes.render(scenes, settings.size, settings.size, device)).latent_dist.mode()
        return scenes.captions, (latents.float() - mean) / std * SIGMA_DATA

    pool = LatentPool(make, settings.pool_batches if max_steps is None else min(settings.pool_batches, max_steps),
                      max_seconds)
    print(f"[cosmos-dit] latent pool: {len(pool)} clips in {pool.seconds:.0f}s", flush=True)
    return pool


def _train_vae(vae, device, generator, settings, seconds, max_steps) -> PhaseResult:
    if settings.vae_fit not in ("all", "decoder"):
        raise ValueError(f"vae_fit must be 'all' or 'decoder', got {settings.vae_fit!r}")
    vae.requires_grad_(True)
    if settings.vae_fit == "decoder":
        vae.encoder.requires_grad_(False)
        vae.quant_conv.requires_grad_(False)

    def step() -> torch.Tensor:
        scenes = _scenes(settings.vae_batch, settings.vae_frames, generator, settings)
        clips = shapes.render(scenes, settings.size, settings.size, device)
        background = scenes.background.to(device).float() / 127.5 - 1
        return reconstruction_loss(vae, object_crops(clips, scenes, settings.vae_size, generator), background,
                                   latent_blur=settings.latent_blur, latent_noise=settings.latent_noise)

    return run_phase("cosmos-vae", step, [vae], seconds=seconds, max_steps=max_steps, lr=settings.vae_lr,
                     batch=settings.vae_batch, ema_decay=0.999, bf16=settings.bf16)


def object_crops(clips: torch.Tensor, scenes: shapes.Scenes, size: int, generator: torch.Generator) -> torch.Tensor:
    """size x size crops of clips [B, 3, T, H, W], each around its object's centre in the middle frame,
    shifted at random by up to a quarter of the crop, kept inside the frame."""
    height, width = clips.shape[-2:]
    if size >= min(height, width):
        return clips
    middle = scenes.cx.shape[1] // 2
    jitter = (torch.rand(len(clips), 2, generator=generator) - 0.5) * (size / 2)
    left = (scenes.cx[:, middle] * width - size / 2 + jitter[:, 0]).round().long().clamp(0, width - size)
    top = (scenes.cy[:, middle] * height - size / 2 + jitter[:, 1]).round().long().clamp(0, height - size)
    return torch.stack([clip[..., y: y + size, x: x + size] for clip, x, y in zip(clips, left.tolist(), top.tolist())])


def encode_prompts(t5: torch.nn.Module, tokens: TokenCache, captions: list[str], device: torch.device) -> torch.Tensor:
    """T5 embeddings with padding zeroed, as CosmosPipeline._t5 computes them."""
    ids, mask = tokens(captions, device)
    mask = mask.bool()
    embeds = t5(ids, attention_mask=mask).last_hidden_state
    return embeds * mask[..., None].to(embeds.dtype)


def _train_transformer(parts, pool, device, generator, settings, seconds, max_steps) -> PhaseResult:
    transformer, t5 = parts["transformer"], parts["text_encoder"]
    transformer.requires_grad_(True)
    t5.requires_grad_(True)
    t_conditioning = SIGMA_CONDITIONING / (SIGMA_CONDITIONING + 1)
    padding_mask = torch.zeros(1, 1, settings.size, settings.size, device=device)
    tokens = TokenCache(parts["tokenizer"], settings.max_sequence_length)
    forward = torch.compile(transformer) if settings.compile else transformer
    # The noise is drawn on the device: a batch of it (256 clips: 9.4 M values) took 65 ms to draw on a 2-core
    # host, against about 100 ms for a whole training step at that batch on an H100; a host that falls behind
    # idles the GPU.
    noise_generator = torch.Generator(device=device)
    noise_generator.manual_seed(int(torch.randint(2**62, (1,), generator=generator)))

    def step() -> torch.Tensor:
        batch = settings.dit_batch
        captions, x0 = pool.sample(batch, generator)
        dropped = torch.rand(batch, generator=generator) < settings.prompt_dropout
        for i in torch.nonzero(dropped).flatten().tolist():
            captions[i] = shapes.NEGATIVE_CAPTIONS[i % len(shapes.NEGATIVE_CAPTIONS)]
        latent_frames = x0.shape[2]
        noise = torch.randn(x0.shape, generator=noise_generator, device=device)
        sigma = _cosmos_sigmas(batch, generator).to(device).view(-1, 1, 1, 1, 1)
        t = sigma / (sigma + 1)
        given = torch.multinomial(torch.tensor(settings.condition_frames), batch, replacement=True,
                                  generator=generator).to(device)
        frame = torch.arange(latent_frames, device=device).view(1, 1, -1, 1, 1)
        indicator = (frame < given.view(-1, 1, 1, 1, 1)).float()
        model_in = indicator * x0 + (1 - indicator) * ((1 - t) * x0 + t * noise)
        timestep = indicator * t_conditioning + (1 - indicator) * t  # [B, 1, T, 1, 1]
        condition_mask = indicator.expand(-1, -1, -1, *x0.shape[3:])
        text = encode_prompts(t5, tokens, captions, device)
        out = forward(
            hidden_states=model_in, timestep=timestep, encoder_hidden_states=text, fps=settings.fps,
            condition_mask=condition_mask, padding_mask=padding_mask, return_dict=False,
        )[0]
        error = (out.float() - (noise - x0)).square() * (1 - indicator)
        return error.sum() / ((1 - indicator).sum().clamp(min=1) * x0.shape[1] * x0.shape[3] * x0.shape[4])

    return run_phase("cosmos-dit", step, [transformer, t5], seconds=seconds, max_steps=max_steps,
                     lr=settings.dit_lr, batch=settings.dit_batch, ema_decay=0.999, bf16=settings.bf16)


def grow_transformer(transformer: torch.nn.Module, layers: int, mlp_ratio: float | None = None) -> torch.nn.Module:
    """`transformer` (a CosmosTransformer3DModel) with blocks appended up to `layers` and each block's feed-forward
    widened to `mlp_ratio` x its width (None: as it is), computing the same function.

    Each new block's residual branches (self-attention, cross-attention, feed-forward) end in a zeroed
    output projection, so the block passes its input through unchanged; each new feed-forward unit has a
    zeroed output column, so it adds nothing. Until training moves them: their gradients are not zero
    (they see the branch's input). Training continues from the trained model instead of starting a
    bigger one from scratch.
    """
    config = transformer.config
    mlp_ratio = config.mlp_ratio if mlp_ratio is None else mlp_ratio
    if layers < config.num_layers or mlp_ratio < config.mlp_ratio:
        raise ValueError(f"the transformer has {config.num_layers} blocks with feed-forward ratio {config.mlp_ratio}; "
                         f"it can grow, not shrink to {layers} and {mlp_ratio}")
    if layers == config.num_layers and mlp_ratio == config.mlp_ratio:
        return transformer
    grown = type(transformer).from_config({**config, "num_layers": layers, "mlp_ratio": mlp_ratio})
    state = grown.state_dict()  # its tensors share the grown model's storage: copying into them sets its weights
    for name, value in transformer.state_dict().items():
        target = state[name]
        if target.shape == value.shape:
            target.copy_(value)
        elif name.endswith("ff.net.0.proj.weight"):  # [hidden, width]: the first rows are the old units
            target[: value.shape[0]].copy_(value)
        elif name.endswith("ff.net.2.weight"):  # [width, hidden]: the new units' columns are zero
            target.zero_()
            target[:, : value.shape[1]].copy_(value)
        else:
            raise RuntimeError(f"growing the transformer did not map {name}: {tuple(value.shape)} -> "
                               f"{tuple(target.shape)}")
    with torch.no_grad():
        for block in grown.transformer_blocks[config.num_layers:]:
            for projection in (block.attn1.to_out[0], block.attn2.to_out[0], block.ff.net[2]):
                projection.weight.zero_()
                if projection.bias is not None:
                    projection.bias.zero_()
    return grown.to(device=next(transformer.parameters()).device).eval()


def _cosmos_sigmas(batch: int, generator: torch.Generator) -> torch.Tensor:
    log_uniform = (math.log(SIGMA_MIN)
                   + (math.log(SIGMA_MAX) - math.log(SIGMA_MIN)) * torch.rand(batch, generator=generator))
    log_normal = (1.2 * torch.randn(batch, generator=generator)).clamp(math.log(SIGMA_MIN), math.log(SIGMA_MAX))
    pick = torch.rand(batch, generator=generator) < 0.5
    return torch.where(pick, log_uniform, log_normal).exp()
