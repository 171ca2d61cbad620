"""Wan 2.1 text-to-video and image-to-video, Wan 2.2 TI2V and A14B, on diffusers' Wan components, in three stages.

    encode (rank 0: UMT5; an input image: CLIP, the VAE)  ->  denoise (every rank)  ->  decode (rank 0, or the
    split group: Wan VAE)

The prompt encoding (cleaned, padded to max_sequence_length with zeros), the noise's shape, the UniPC
flow-matching loop and the latent de-normalisation are diffusers' WanPipeline's own (rank 0 builds one
over the loaded parts and calls its encode_prompt; every rank draws the noise with its prepare_latents),
so our video equals its video (tests/test_conformance.py). What differs is where things run:
- only rank 0 loads the text encoder, and the VAE (unless the decode is split over the ranks);
- classifier-free guidance runs its two branches as one batch-2 transformer call (prompt and negative
  prompt are both padded to max_sequence_length), which a CFG-parallel run splits over two rank
  groups; diffusers calls the branches one after the other (equal up to float rounding);
- the seed's noise is drawn from a CPU generator on every rank (the same numbers everywhere).

The kinds of folder, told apart by their configs:
- Wan 2.1 text-to-video (WanPipeline): the above.
- Wan 2.1 image-to-video (WanImageToVideoPipeline, a transformer with image_dim): rank 0 also encodes the input
  image with the CLIP vision encoder (its penultimate hidden states, encoder_hidden_states_image) and VAE-encodes
  the image followed by black frames; the transformer takes those latents and a first-frame mask (4 channels,
  one per frame of the VAE's first temporal group) as extra input channels, as WanImageToVideoPipeline does.
- Wan 2.2 TI2V (expand_timesteps in model_index.json): one timestep per token ([B, tokens]); with an input
  image its VAE latent replaces the first latent frame and that frame's tokens get timestep 0, as
  WanImageToVideoPipeline does for such a folder; without one, WanPipeline's text-to-video.
- Wan 2.2 A14B, text-to-video (WanPipeline) and image-to-video (WanImageToVideoPipeline without CLIP): two
  expert transformers of one architecture (transformer_2 in model_index.json), as WanPipeline runs them: the
  steps whose timestep is at or above boundary_ratio x the scheduler's training timesteps call `transformer`
  (high noise), the rest `transformer_2`. Each expert is a whole transformer on every rank, parallelized,
  compiled and step-cached on its own (a cache's first step after the switch is computed). The second expert's
  steps take the request's guidance_2 (WanPipeline's guidance_scale_2; the model's default is Wan-AI's).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from diffusers import WanPipeline
from diffusers.video_processor import VideoProcessor

from pipelines.media import open_image
from pipelines.registry import ModelSpec, folder_experts, read_component_config, read_model_index
from pipelines.requests import GenerationRequest
from pipelines.stages import StagedPipeline, StepCallback, latent_statistics


@dataclass(kw_only=True)
class WanConditioning:
    """What rank 0 encodes once and every rank's transformer needs."""

    prompt_embeds: torch.Tensor
    """[B, L, D] UMT5 embeddings, padding zeroed: the prompt's, then the negative prompt's with guidance (B = 2)."""
    image_embeds: torch.Tensor | None = None
    """[1, N, D] the input image's CLIP vision penultimate hidden states (Wan 2.1 image-to-video); else None."""
    image_latents: torch.Tensor | None = None
    """The input image's normalised VAE latents (float32), else None: Wan 2.1 image-to-video's extra input
    channels [1, 4 + C, T, h, w] (first-frame mask, then the latents of the image followed by black frames);
    Wan 2.2 TI2V's first latent frame [1, C, 1, h, w]."""


class WanVideoPipeline(StagedPipeline):
    """Prompt -> video with a WanTransformer3DModel."""

    COMPONENT_DTYPES = {"vae": torch.float32, "image_encoder": torch.float32}
    """Components kept in their own dtype whatever the run's: the Wan VAE and the CLIP image encoder run in
    float32, as diffusers' Wan examples load them (bf16 costs visible banding)."""

    def __init__(self, *, spec: ModelSpec, folder: Path, transformer: torch.nn.Module, scheduler,
                 text_encoder=None, tokenizer=None, vae=None, image_encoder=None, image_processor=None,
                 transformer_2: torch.nn.Module | None = None, device: torch.device | str = "cpu") -> None:
        self._hold(spec=spec, folder=folder, transformer=transformer, scheduler=scheduler, vae=vae, device=device)
        self.image_encoder = image_encoder
        self.image_processor = image_processor
        index = read_model_index(folder)
        self.boundary_ratio: float | None = None
        """Wan 2.2 A14B: the steps below this fraction of the training timesteps go to transformer_2."""
        if transformer_2 is not None:
            self.transformer_2 = transformer_2
            self.transformer_names = ("transformer", "transformer_2")
            self.boundary_ratio = float(index["boundary_ratio"])
        self.expand_timesteps = bool(index.get("expand_timesteps"))
        """Wan 2.2 TI2V: a timestep per token, the input image as the first latent frame."""
        self.image_context = self.transformer_config.get("image_dim") is not None
        """Wan 2.1 image-to-video: CLIP image context."""
        self.needs_image = self.transformer_config.in_channels != self.transformer_config.out_channels
        """Image-to-video (Wan 2.1's; Wan 2.2 A14B's without CLIP): the image's latents as extra input channels."""
        vae_config = read_component_config(folder, "vae")
        # AutoencoderKLWan's own config attributes (WanPipeline reads them from the loaded VAE, which ranks > 0 lack)
        self.spatial_factor = int(vae_config.get("scale_factor_spatial", 2 ** len(vae_config["temperal_downsample"])))
        self.temporal_factor = int(vae_config.get("scale_factor_temporal", 2 ** sum(vae_config["temperal_downsample"])))
        self.vae_spatial_factor = self.spatial_factor
        self.video_processor = VideoProcessor(vae_scale_factor=self.spatial_factor)
        # diffusers' pipeline over the same parts: its prompt encoding.
        self._diffusers = None
        if text_encoder is not None:
            self._diffusers = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                                          transformer=transformer)

    @classmethod
    def components(cls, folder: Path, with_encoders: bool) -> list[str]:
        """A WanPipeline or WanImageToVideoPipeline folder: both experts of a two-expert one, and with the encoders
        an image-to-video folder's image encoder and processor."""
        index = read_model_index(folder)
        names = super().components(folder, with_encoders)
        if folder_experts(index) > 1:
            names.insert(1, "transformer_2")
        if with_encoders and (index.get("image_encoder") or [None])[0] is not None:
            names += ["image_encoder", "image_processor"]
        return names

    # --- rank 0 ---------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, request: GenerationRequest) -> WanConditioning:
        """UMT5 embeddings of the prompt, and of the negative prompt when guidance is on (above 1)."""
        pipe = self._diffusers
        self.require_encoders(pipe)
        guided = request.guidance > 1.0
        negative = request.negative_prompt if guided else None
        length = self.spec.max_sequence_length

        def encode() -> torch.Tensor:
            embeds, negative_embeds = pipe.encode_prompt(
                prompt=request.prompt, negative_prompt=negative, do_classifier_free_guidance=guided,
                max_sequence_length=length, device=self.device, dtype=self.dtype)
            return embeds if negative_embeds is None else torch.cat([embeds, negative_embeds])

        embeds = self.cached_text(("wan", request.prompt, negative, length), encode)
        cond = WanConditioning(prompt_embeds=embeds)
        if request.condition is None:
            if self.needs_image:
                raise ValueError("this image-to-video model needs an input image")
            return cond
        image = open_image(request.condition)  # upright, as diffusers' load_image gives it
        cond.image_latents = self._image_latents(request, image)
        if self.image_context:
            cond.image_embeds = self._clip(image)
        return cond

    def _clip(self, image) -> torch.Tensor:
        """WanImageToVideoPipeline.encode_image: CLIP vision's penultimate hidden states of the raw image."""
        if self.image_encoder is None:
            raise RuntimeError("this pipeline was loaded without an image encoder")
        pixels = self.image_processor(images=image, return_tensors="pt").to(self.device)
        return self.image_encoder(**pixels, output_hidden_states=True).hidden_states[-2].to(self.dtype)

    def _image_latents(self, request: GenerationRequest, image) -> torch.Tensor:
        """The image resized to the request's size and VAE-encoded (the posterior's mode), normalised by the
        VAE's latent statistics, as WanImageToVideoPipeline.prepare_latents does: the image alone (TI2V), or
        followed by black frames to the request's length behind a first-frame mask (Wan 2.1)."""
        self.require_vae()
        height, width = request.height, request.width
        pixels = self.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
        video = pixels.unsqueeze(2)
        if not self.expand_timesteps:
            video = torch.cat([video, video.new_zeros(1, 3, request.frames - 1, height, width)], dim=2)
        latents = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode().float()
        mean, inverse_std = latent_statistics(self.vae.config, latents)
        latents = (latents - mean) * inverse_std
        if self.expand_timesteps:
            return latents
        # 1 on the first latent frame, 0 after: a channel per frame of the VAE's first temporal group (the
        # first pixel frame repeated to fill it), the same as WanImageToVideoPipeline's reshaped pixel mask.
        mask = latents.new_zeros(1, self.temporal_factor, *latents.shape[2:])
        mask[:, :, 0] = 1.0
        return torch.cat([mask, latents], dim=1)

    # --- every rank -----------------------------------------------------------------------------

    @torch.no_grad()
    def denoise(self, request: GenerationRequest, cond: WanConditioning,
                on_step: StepCallback | None = None) -> torch.Tensor:
        """The UniPC flow-matching loop from the seed's noise; returns latents [1, C, T, h, w] (float32)."""
        device, dtype = self.device, self.dtype
        text = cond.prompt_embeds.to(device, dtype)
        branches = text.shape[0]
        # WanPipeline.prepare_latents reads only the VAE's factors from its pipeline: given here from the config
        factors = SimpleNamespace(vae_scale_factor_temporal=self.temporal_factor,
                                  vae_scale_factor_spatial=self.spatial_factor)
        generator = torch.Generator("cpu").manual_seed(request.seed)
        # out_channels: the VAE's latent (an image-to-video transformer's in_channels add the image's channels)
        latents = WanPipeline.prepare_latents(factors, 1, self.transformer_config.out_channels, request.height,
                                              request.width, request.frames, torch.float32, device, generator)
        given = cond.image_latents.to(device) if cond.image_latents is not None else None
        extra = {}
        if cond.image_embeds is not None:
            extra["encoder_hidden_states_image"] = cond.image_embeds.to(device, dtype).expand(branches, -1, -1)
        noisy = None
        if self.expand_timesteps:  # 1 on latents being denoised, 0 on the given first frame (TI2V)
            noisy = torch.ones(1, 1, *latents.shape[2:], device=device)
            if given is not None:
                noisy[:, :, 0] = 0.0
            _, patch_h, patch_w = self.transformer_config.patch_size
        scheduler = copy.deepcopy(self.scheduler)  # UniPC keeps per-loop state on the instance
        scheduler.set_timesteps(request.steps, device=device)
        scheduler.set_begin_index(0)
        # WanPipeline: transformer_2 from the first step whose t < boundary_ratio x training steps
        boundary = None if self.boundary_ratio is None else self.boundary_ratio * scheduler.config.num_train_timesteps

        def predict(i: int, t: torch.Tensor, latents: torch.Tensor, name: str) -> torch.Tensor:
            if noisy is not None:
                model_input = latents if given is None else (1 - noisy) * given + noisy * latents
                timestep = (noisy[0, 0, :, ::patch_h, ::patch_w] * t).flatten().expand(branches, -1)  # [B, tokens]
            else:
                model_input = latents if given is None else torch.cat([latents, given], dim=1)
                timestep = t.expand(branches)
            model_input = model_input.to(dtype)
            prediction = getattr(self, name)(
                hidden_states=model_input.expand(branches, *model_input.shape[1:]),
                timestep=timestep,
                encoder_hidden_states=text,
                return_dict=False,
                **extra,
            )[0]
            if branches == 2:
                scale = request.guidance if name == "transformer" or request.guidance_2 is None else request.guidance_2
                prediction = prediction[1:] + scale * (prediction[:1] - prediction[1:])
            return prediction

        latents = self.run_denoise_loop(request, scheduler, scheduler.timesteps, latents, predict, on_step,
                                        expert_boundary=boundary)
        if noisy is not None and given is not None:
            latents = (1 - noisy) * given + noisy * latents
        return latents

    # --- rank 0 (and the split group) -----------------------------------------------------------

    @torch.no_grad()
    def decode(self, request: GenerationRequest, latents: torch.Tensor) -> np.ndarray | None:
        """De-normalise with the VAE's latent statistics and VAE-decode: uint8 frames [T, H, W, 3] (None on a
        rank > 0 of a split decode)."""
        self.require_vae()
        latents = latents.to(self.device, self.vae.dtype)
        mean, inverse_std = latent_statistics(self.vae.config, latents)
        video = self.decode_latents(request, latents / inverse_std + mean)  # WanPipeline's arithmetic, to the bit
        if video is None:
            return None
        frames = self.video_processor.postprocess_video(video, output_type="np")[0]
        return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)
