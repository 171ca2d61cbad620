"""Cosmos-style text-to-video, image/video-to-video and text-to-image on the Cosmos-Predict2 components.

    encode (rank 0: T5, conditioning frames through the VAE)  ->  denoise (every rank)  ->  decode (rank 0)

The denoising loop is diffusers' Cosmos2VideoToWorldPipeline / Cosmos2TextToImagePipeline loop (EDM
preconditioning on a flow-match Euler scheduler with Karras sigmas), with one change that matters for
parallelism: the conditional and unconditional branches of classifier-free guidance go through the
transformer as one batch of two, so a cfg-parallel engine can put them on different ranks.
Conditioning latents use the VAE posterior's mode (not a sample), so the seed's noise is the same on
every rank whether or not that rank encoded anything. The Cosmos guardrail is used where the
cosmos_guardrail package is installed (pipelines.guardrail).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from diffusers.pipelines.cosmos.pipeline_cosmos2_video2world import retrieve_timesteps
from diffusers.utils import PIL_INTERPOLATION
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor

from pipelines.cosmos import torchvision_shim
from pipelines.guardrail import Guardrail
from pipelines.media import read_frames
from pipelines.registry import ModelSpec, read_component_config
from pipelines.requests import GenerationRequest
from pipelines.stages import StagedPipeline, StepCallback

# The EDM constants diffusers' Cosmos-Predict2 pipelines write into the scheduler config.
SIGMA_MAX = 80.0
SIGMA_MIN = 0.002
SIGMA_DATA = 1.0
SIGMA_CONDITIONING = 0.0001


@dataclass(kw_only=True)
class CosmosConditioning:
    """Everything the denoising loop needs from rank 0's encoders."""

    prompt_embeds: torch.Tensor
    """T5 embeddings, [1, L, D]."""
    negative_prompt_embeds: torch.Tensor | None
    """T5 embeddings of the negative prompt, or None when guidance is off."""
    conditioning_latents: torch.Tensor | None
    """VAE latents of the input image/video, normalised, [1, C, T, h, w]; None for text-only requests."""
    num_cond_latent_frames: int
    """How many leading latent frames are given rather than generated."""
    condition_frames: torch.Tensor | None = None
    """The input's frames, uint8 [frames, H, W, 3] at the request's size, while every rank still has to
    VAE-encode them together (a split encode: `prepare` turns them into conditioning_latents); else None."""


class CosmosPipeline(StagedPipeline):
    """Prompt (and optional input frames) -> video, or image for text2image checkpoints."""

    COMPONENT_DTYPES = {"vae": torch.float32}
    """Components kept in their own dtype whatever the run's: the Wan VAE runs in float32 in
    diffusers' Cosmos examples; bf16 costs visible banding."""

    def __init__(self, *, spec: ModelSpec, folder: Path, transformer: torch.nn.Module, scheduler, text_encoder=None,
                 tokenizer=None, vae=None, device: torch.device | str = "cpu") -> None:
        self._hold(spec=spec, folder=folder, transformer=transformer, scheduler=scheduler, vae=vae, device=device)
        self.scheduler.register_to_config(
            sigma_max=SIGMA_MAX, sigma_min=SIGMA_MIN, sigma_data=SIGMA_DATA, final_sigmas_type="sigma_min"
        )
        self.text_encoder, self.tokenizer = text_encoder, tokenizer
        vae_config = read_component_config(folder, "vae")
        self.vae_config = vae_config
        self.temporal_factor = 2 ** sum(vae_config["temperal_downsample"])
        self.spatial_factor = 2 ** len(vae_config["temperal_downsample"])
        self.vae_spatial_factor = self.spatial_factor
        self.video_processor = VideoProcessor(vae_scale_factor=self.spatial_factor)
        # The guardrail is part of the NVIDIA Open Model License terms; the embedded tiny model is not under it.
        self.guardrail = Guardrail.load() if text_encoder is not None and not spec.embedded else None
        if self.transformer_config.concat_padding_mask:
            torchvision_shim.install()

    @property
    def uses_condition_mask(self) -> bool:
        """Video2World transformers take an extra condition-mask channel; Text2Image ones do not."""
        return self.transformer_config.in_channels == self.vae_config["z_dim"] + 1

    def _t5(self, text: str) -> torch.Tensor:
        inputs = self.tokenizer(
            [text], padding="max_length", max_length=self.spec.max_sequence_length, truncation=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask.bool().to(self.device)
        embeds = self.text_encoder(inputs.input_ids.to(self.device), attention_mask=mask).last_hidden_state
        embeds = embeds.to(self.dtype)
        # Cosmos zeroes the embeddings of padding tokens (diffusers' _get_t5_prompt_embeds does too).
        return embeds * mask[..., None].to(embeds.dtype)

    @torch.no_grad()
    def encode(self, request: GenerationRequest) -> CosmosConditioning:
        """T5 embeddings of prompt and negative prompt, and latents of the conditioning frames if any."""
        self.require_encoders(self.text_encoder, self.vae)
        if self.guardrail is not None:
            self.guardrail.check_text(request.prompt)
        negative_text = request.negative_prompt if request.guidance > 1.0 else None
        prompt_embeds, negative = self.cached_text(
            ("cosmos", request.prompt, negative_text, self.spec.max_sequence_length),
            lambda: (self._t5(request.prompt), self._t5(negative_text) if negative_text is not None else None))
        conditioning_latents, num_cond, frames = None, 0, None
        if request.condition is not None and self.encode_is_split(request):
            frames, num_cond = self._condition_frames(request)  # every rank encodes them in prepare
        elif request.condition is not None:
            conditioning_latents, num_cond = self._encode_condition(request)
        return CosmosConditioning(
            prompt_embeds=prompt_embeds, negative_prompt_embeds=negative,
            conditioning_latents=conditioning_latents, num_cond_latent_frames=num_cond, condition_frames=frames,
        )

    def _read_condition(self, request: GenerationRequest) -> list[PIL.Image.Image]:
        # Only the last `request.frames` frames are used: read just those, resized as they stream (with the
        # video processor's own filter, so that its resize in preprocess_video is the identity).
        resample = PIL_INTERPOLATION[self.video_processor.config.resample]
        return read_frames(request.condition, (request.width, request.height), last=request.frames,
                           resample=resample)

    def _given_latent_frames(self, request: GenerationRequest, given: int) -> int:
        """Latent frames the input's `given` frames condition (the last request.frames of them are used)."""
        return (min(given, request.frames) - 1) // self.temporal_factor + 1

    def _encode_condition(self, request: GenerationRequest) -> tuple[torch.Tensor, int]:
        video = self.video_processor.preprocess_video([self._read_condition(request)], request.height, request.width)
        video = video.to(self.device, torch.float32)
        num_given = video.shape[2]
        if num_given >= request.frames:
            video = video[:, :, -request.frames:]
        else:  # the last frame repeated up to the request's length
            padding = video[:, :, -1:].repeat(1, 1, request.frames - num_given, 1, 1)
            video = torch.cat([video, padding], dim=2)
        latents = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode().float()
        return self._normalised(latents), self._given_latent_frames(request, num_given)

    def _condition_frames(self, request: GenerationRequest) -> tuple[torch.Tensor, int]:
        """The input's frames as uint8 [request.frames, H, W, 3] (the last frame repeated up to the request's
        length, as _encode_condition does), and the latent frames they condition."""
        frames = np.stack([np.asarray(frame.convert("RGB")) for frame in self._read_condition(request)])
        num_given = frames.shape[0]
        frames = frames[-request.frames:]
        if num_given < request.frames:
            frames = np.concatenate([frames, np.repeat(frames[-1:], request.frames - num_given, axis=0)])
        return torch.from_numpy(np.ascontiguousarray(frames)), self._given_latent_frames(request, num_given)

    def _latent_statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel latent mean and standard deviation (its config's), [1, C, 1, 1, 1] float32."""
        mean = torch.tensor(self.vae_config["latents_mean"], device=self.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(self.vae_config["latents_std"], device=self.device).view(1, -1, 1, 1, 1)
        return mean, std

    def _normalised(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._latent_statistics()
        return (latents - mean) / std * SIGMA_DATA

    def encode_is_split(self, request: GenerationRequest) -> bool:
        """Whether `request`'s input is VAE-encoded by every rank of the split group (Wan 2.1's encoder, an
        image tall enough to gain: pipelines.split_vae.encode_splits) rather than by rank 0 alone."""
        if self.vae_group is None or request.condition is None:
            return False
        import torch.distributed as dist

        from pipelines.split_vae import encode_splits

        return encode_splits(self.vae, request.height, dist.get_world_size(self.vae_group))

    @torch.no_grad()
    def prepare(self, request: GenerationRequest, cond: CosmosConditioning) -> CosmosConditioning:
        """Every rank, after rank 0's encoding reached it: the input's frames VAE-encoded over the ranks of the
        split group, when rank 0 left them to it (condition_frames); every rank gets the latents."""
        if cond.condition_frames is None:
            return cond
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        from pipelines.split_vae import Parts, encode_wan

        self.require_vae()
        # [T, H, W, 3] uint8 -> [1, 3, T, H, W] in [-1, 1]: the float32 arithmetic of VideoProcessor.preprocess_video
        video = cond.condition_frames.to(self.device).permute(3, 0, 1, 2).unsqueeze(0).float() / 255.0
        video = 2.0 * video - 1.0
        moments = encode_wan(self.vae, video.to(self.vae.dtype), Parts.ranks(self.vae_group))
        latents = DiagonalGaussianDistribution(moments).mode().float()
        return replace(cond, conditioning_latents=self._normalised(latents), condition_frames=None)

    @torch.no_grad()
    def denoise(
        self, request: GenerationRequest, cond: CosmosConditioning, on_step: StepCallback | None = None
    ) -> torch.Tensor:
        """EDM-preconditioned Euler loop from the seed's noise; returns latents [1, C, T, h, w] (float32)."""
        device, dtype = self.device, self.dtype
        use_cfg = request.guidance > 1.0
        num_latent_frames = (request.frames - 1) // self.temporal_factor + 1
        shape = (1, self.vae_config["z_dim"], num_latent_frames,
                 request.height // self.spatial_factor, request.width // self.spatial_factor)
        generator = torch.Generator("cpu").manual_seed(request.seed)
        latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32) * SIGMA_MAX

        sigmas = torch.linspace(0, 1, request.steps, dtype=torch.float64)
        timesteps, _ = retrieve_timesteps(self.scheduler, device=device, sigmas=sigmas)
        # Cosmos ends on sigma_min instead of zero (final_sigmas_type="sigma_min").
        self.scheduler.sigmas[-1] = self.scheduler.sigmas[-2]

        # indicator = 1 on given (conditioning) latent frames, 0 on frames to generate.
        indicator = latents.new_zeros(1, 1, num_latent_frames, 1, 1)
        indicator[:, :, : cond.num_cond_latent_frames] = 1.0
        given = (cond.conditioning_latents.to(device) if cond.conditioning_latents is not None
                 else torch.zeros_like(latents))
        text = cond.prompt_embeds.to(device, dtype)
        if use_cfg:
            text = torch.cat([text, cond.negative_prompt_embeds.to(device, dtype)])
        branches = text.shape[0]
        extra: dict = {"padding_mask": latents.new_zeros(1, 1, request.height, request.width, dtype=dtype)}
        if self.uses_condition_mask:
            extra["fps"] = request.fps
            mask = (indicator * latents.new_ones(1, 1, *shape[2:])).to(dtype)
            extra["condition_mask"] = mask.expand(branches, -1, -1, -1, -1)
        t_conditioning = SIGMA_CONDITIONING / (SIGMA_CONDITIONING + 1)

        def predict(i: int, t: torch.Tensor, latents: torch.Tensor, name: str) -> torch.Tensor:
            """The velocity of the EDM-preconditioned denoised estimate, which the Euler scheduler steps with."""
            sigma = self.scheduler.sigmas[i]
            current_t = sigma / (sigma + 1)
            c_in, c_skip, c_out = 1 - current_t, 1 - current_t, -current_t
            model_in = indicator * given + (1 - indicator) * (latents * c_in)
            if self.uses_condition_mask:
                timestep = current_t.view(1, 1, 1, 1, 1).expand(1, -1, num_latent_frames, -1, -1)
                timestep = indicator * t_conditioning + (1 - indicator) * timestep
            else:
                timestep = current_t.expand(1)
            out = self.transformer(
                hidden_states=model_in.to(dtype).expand(branches, *model_in.shape[1:]),
                timestep=timestep.to(dtype).expand(branches, *timestep.shape[1:]),
                encoder_hidden_states=text,
                return_dict=False,
                **extra,
            )[0]
            x0 = (c_skip * latents + c_out * out.float()).to(dtype)
            x0 = indicator * given + (1 - indicator) * x0
            if use_cfg:
                x0_cond, x0_uncond = x0[:1], x0[1:]
                x0 = x0_cond + request.guidance * (x0_cond - x0_uncond)
            return (latents - x0) / sigma

        return self.run_denoise_loop(request, self.scheduler, timesteps, latents, predict, on_step)

    @torch.no_grad()
    def decode(self, request: GenerationRequest, latents: torch.Tensor) -> np.ndarray | PIL.Image.Image | None:
        """VAE-decode latents: uint8 frames [T, H, W, 3] for video models, a PIL image for image models (None
        on a rank > 0 of a split decode)."""
        self.require_vae()
        mean, std = self._latent_statistics()
        latents = latents.to(self.device, torch.float32) * std / SIGMA_DATA + mean
        video = self.decode_latents(request, latents.to(self.vae.dtype))
        if video is None:
            return None
        frames = self.video_processor.postprocess_video(video, output_type="np")[0]
        frames = (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)
        if self.guardrail is not None:
            frames = self.guardrail.check_frames(frames)
        if self.spec.media == "image":
            return PIL.Image.fromarray(frames[0])
        return frames
