"""Cosmos 3 text-to-video, image/video-to-video and text-to-image on Cosmos3OmniPipeline's components.

    encode (rank 0: tokenize, conditioning frames through the VAE)  ->  denoise (every rank)  ->  decode (rank 0)

Cosmos 3 has no separate text encoder: its transformer embeds the prompt's token ids itself (the
"und" stream packed before the vision tokens), so encoding is tokenizing plus packing. The packing,
the templates appended to the prompt, the conditioning latents and the UniPC loop are diffusers'
Cosmos3OmniPipeline's own (rank 0 builds one over the loaded parts and calls its helpers), so our
output equals its output (tests/test_conformance.py). What differs is where things run:
- ranks > 0 load the transformer and scheduler only, and receive the packed prompt from rank 0;
- the seed's noise is drawn on every rank from a CPU generator (the same numbers everywhere), and
  text-only requests skip diffusers' VAE encode of an all-black video, which only gave the shape;
- the conditional and unconditional calls go through `forward_guided` when the transformer has one
  (pipelines.cosmos3.parallel), so a CFG-parallel run puts them on two rank groups at once.
Sound and action generation are not offered. The Cosmos guardrail follows pipelines.guardrail's
policy: used where the cosmos_guardrail package is installed, otherwise one warning.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import Cosmos3OmniPipeline
from diffusers.utils.torch_utils import randn_tensor

from pipelines.guardrail import Guardrail
from pipelines.media import read_frames
from pipelines.registry import ModelSpec, read_component_config
from pipelines.requests import GenerationRequest
from pipelines.stages import StagedPipeline, StepCallback

PASS_KEYS = ("input_ids", "text_indexes", "position_ids", "und_len", "sequence_length", "vision_token_shapes",
             "vision_sequence_indexes", "vision_mse_loss_indexes", "vision_noisy_frame_indexes")
"""The transformer arguments a packed prompt fixes for the whole loop (diffusers' "packed static")."""


@dataclass(kw_only=True)
class Cosmos3Conditioning:
    """Everything the denoising loop needs from rank 0: small tensors and ints, broadcast once."""

    passes: list[dict[str, Any]]
    """The transformer's per-prompt arguments (PASS_KEYS), conditional first; two with guidance."""
    num_noisy_tokens: int
    """Vision tokens that are denoised (the rest are given frames)."""
    condition_mask: torch.Tensor
    """[latent frames, 1, 1]: 1 on given (conditioning) latent frames."""
    condition_latents: torch.Tensor | None
    """Normalised VAE latents of the conditioning frames [1, C, T, h, w], None for text-only requests."""
    latent_shape: tuple[int, ...]


class Cosmos3Pipeline(StagedPipeline):
    """Prompt (and optional input image or video) -> video, or an image when one frame is asked for."""

    COMPONENT_DTYPES = {"vae": torch.float32}
    """The Wan VAE runs in float32 as in the other Cosmos pipelines here (bf16 costs visible banding)."""
    ENCODERS = ("text_tokenizer",)

    def __init__(self, *, spec: ModelSpec, folder: Path, transformer: torch.nn.Module, scheduler,
                 text_tokenizer=None, vae=None, device: torch.device | str = "cpu") -> None:
        self._hold(spec=spec, folder=folder, transformer=transformer, scheduler=scheduler, vae=vae, device=device)
        vae_config = read_component_config(folder, "vae")
        self.spatial_factor = int(vae_config.get("scale_factor_spatial", 16))
        self.temporal_factor = int(vae_config.get("scale_factor_temporal", 4))
        self.vae_spatial_factor = self.spatial_factor
        self.latent_channels = int(vae_config["z_dim"])
        # diffusers' pipeline over the same parts: its tokenizer templates, packing and latent helpers.
        self._diffusers = None
        if text_tokenizer is not None and vae is not None:
            self._diffusers = Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=text_tokenizer, vae=vae,
                                                  scheduler=scheduler, enable_safety_checker=False)
        self.guardrail = Guardrail.load() if self._diffusers is not None and not spec.embedded else None

    # --- rank 0 ---------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, request: GenerationRequest) -> Cosmos3Conditioning:
        """Tokenized, packed prompt and negative prompt, and latents of the conditioning frames if any."""
        pipe = self._diffusers
        self.require_encoders(pipe)
        if self.guardrail is not None:
            self.guardrail.check_text(request.prompt)
        cond_ids, uncond_ids = self.cached_text(
            ("cosmos3", request.prompt, request.negative_prompt, request.frames, request.height, request.width,
             request.fps),
            lambda: pipe.tokenize_prompt(request.prompt, request.negative_prompt, num_frames=request.frames,
                                         height=request.height, width=request.width, fps=float(request.fps)))
        latent_shape = (1, self.latent_channels, (request.frames - 1) // self.temporal_factor + 1,
                        request.height // self.spatial_factor, request.width // self.spatial_factor)
        condition_latents, mask = None, torch.zeros(latent_shape[2], 1, 1)
        if request.condition is not None:
            condition_latents, mask = self._encode_condition(request)
        given = [int(i) for i in torch.nonzero(mask[:, 0, 0] > 0).flatten()]
        passes, noisy = [], 0
        for ids in [cond_ids, uncond_ids] if request.guidance > 1.0 else [cond_ids]:
            text = pipe._prepare_text_segment(ids, device="cpu")
            vision = pipe._prepare_vision_segment(
                input_vision_tokens=torch.empty(latent_shape, device="meta"), has_image_condition=bool(given),
                mrope_offset=text["vision_start_temporal_offset"], vision_fps=float(request.fps),
                curr=text["und_len"], device="cpu", condition_frame_indexes=given)
            packed = {**text, **vision,
                      "position_ids": torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], 1),
                      "sequence_length": text["und_len"] + vision["num_vision_tokens"]}
            passes.append({key: packed[key] for key in PASS_KEYS})
            noisy = vision["num_noisy_vision_tokens"]
        return Cosmos3Conditioning(passes=passes, num_noisy_tokens=noisy, condition_mask=mask,
                                   condition_latents=condition_latents, latent_shape=latent_shape)

    def _encode_condition(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents whose given frames hold the conditioning latents, and the mask of those frames.

        An image conditions latent frame 0 (image-to-video). A video's last 1 + 4 frames condition latent
        frames 0 and 1 (diffusers' default indexes, kept from the end: the video is continued, as
        Cosmos-Predict2's video-to-world does). diffusers' prepare_latents blends the given latents
        into the seed's noise by the mask; the given frames are exactly the latents, and the rest is
        drawn again on every rank (denoise), so only the mask's frames matter here.
        """
        count = self.temporal_factor + 1
        frames = read_frames(request.condition, (request.width, request.height), last=count)
        inputs: dict[str, Any] = dict(image=frames[0]) if len(frames) == 1 else dict(
            video=frames, condition_video_keep="last")
        out = self._diffusers.prepare_latents(
            **inputs, num_frames=request.frames, height=request.height, width=request.width, fps=float(request.fps),
            generator=torch.Generator("cpu").manual_seed(request.seed), device=self.device, dtype=torch.float32)
        latents, mask = out[0], out[5]
        return (latents * mask).float().cpu(), mask.float().cpu()

    # --- every rank -----------------------------------------------------------------------------

    @torch.no_grad()
    def denoise(self, request: GenerationRequest, cond: Cosmos3Conditioning,
                on_step: StepCallback | None = None) -> torch.Tensor:
        """UniPC loop from the seed's noise; returns latents [1, C, T, h, w] (float32)."""
        device, dtype = self.device, self.dtype
        mask = cond.condition_mask.to(device)
        generator = torch.Generator("cpu").manual_seed(request.seed)
        noise = randn_tensor(cond.latent_shape, generator=generator, device=device, dtype=torch.float32)
        latents = noise if cond.condition_latents is None else (
            mask * cond.condition_latents.to(device) + (1.0 - mask) * noise)
        passes = [{key: (value.to(device) if isinstance(value, torch.Tensor) else
                         [v.to(device) for v in value] if key == "vision_noisy_frame_indexes" else value)
                   for key, value in p.items()} for p in cond.passes]
        scheduler = copy.deepcopy(self.scheduler)  # UniPC keeps per-loop state on the instance
        scheduler.set_timesteps(request.steps, device=device)
        noisy = (1.0 - mask).to(dtype)

        def predict(i: int, t: torch.Tensor, batched: torch.Tensor, name: str) -> torch.Tensor:
            """The guided velocity, batched like the latents the scheduler steps (the model's are unbatched)."""
            tokens = batched.squeeze(0).to(device=device, dtype=dtype)
            timesteps = torch.full((cond.num_noisy_tokens,), t.item(), device=device)
            calls = [dict(p, vision_tokens=[tokens], vision_timesteps=timesteps) for p in passes]
            predicted = self._predict(calls)
            predictions = [pred * noisy if noisy.sum() > 0 else torch.zeros_like(pred) for pred in predicted]
            velocity = predictions[0].float()
            if len(predictions) > 1:
                velocity = predictions[1].float() + request.guidance * (velocity - predictions[1].float())
            return velocity.unsqueeze(0)

        batched = latents.unsqueeze(0)  # the scheduler steps a batch of one
        return self.run_denoise_loop(request, scheduler, scheduler.timesteps, batched, predict, on_step).squeeze(0)

    def _predict(self, calls: list[dict[str, Any]]) -> list[torch.Tensor]:
        """The vision prediction of each call: through forward_guided when the transformer splits the
        guidance calls over rank groups, else one call after the other."""
        guided = getattr(self.transformer, "forward_guided", None)
        if guided is not None:
            return [preds[0] for preds in guided(calls)]
        return [self.transformer(**call, return_dict=False)[0][0] for call in calls]

    # --- rank 0 ---------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, request: GenerationRequest, latents: torch.Tensor) -> np.ndarray | PIL.Image.Image | None:
        """VAE-decode latents: uint8 frames [T, H, W, 3], or a PIL image for a one-frame request (None on a
        rank > 0 of a split decode)."""
        self.require_vae()
        # diffusers' Cosmos3OmniPipeline's latent statistics (its _vae_latents_mean / _inv_std), from the VAE's config
        mean = torch.tensor(self.vae.config.latents_mean, dtype=self.vae.dtype)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std, dtype=self.vae.dtype)
        mean = mean.to(self.device, torch.float32).view(1, -1, 1, 1, 1)
        inv_std = inv_std.to(self.device, torch.float32).view(1, -1, 1, 1, 1)
        raw = latents.to(self.device, torch.float32) / inv_std + mean
        video = self.decode_latents(request, raw.to(self.vae.dtype))
        if video is None:
            return None
        video = video.float()
        frames = self._diffusers.video_processor.postprocess_video(video, output_type="np")[0]
        frames = (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)
        if self.guardrail is not None:
            frames = self.guardrail.check_frames(frames)
        if request.frames == 1:
            return PIL.Image.fromarray(frames[0])
        return frames
