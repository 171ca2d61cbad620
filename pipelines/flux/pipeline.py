"""FLUX-style text-to-image on diffusers' FLUX components, in three stages.

    encode (rank 0: CLIP + T5)  ->  denoise (every rank: the transformer seam)  ->  decode (rank 0: VAE)

The stages mirror diffusers' FluxPipeline step for step (same latents for a seed, same timesteps,
same scheduler calls), so with the same components the image equals FluxPipeline's; a test checks it.
The transformer is called in exactly one place, `denoise`, through `self.transformer`, which
engines/ replaces with a context-parallel or compiled module of the same call signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from pipelines.registry import ModelSpec, read_component_config
from pipelines.requests import GenerationRequest
from pipelines.stages import StagedPipeline, StepCallback


@dataclass(kw_only=True)
class FluxText:
    """Encoded prompt: what rank 0 computes once and every rank's transformer needs."""

    prompt_embeds: torch.Tensor
    """T5 token embeddings, [B, L, D]."""
    pooled_prompt_embeds: torch.Tensor
    """CLIP pooled embedding, [B, D]."""
    text_ids: torch.Tensor
    """Rotary position ids of the text tokens, [L, 3] (all zero in FLUX)."""


class FluxImagePipeline(StagedPipeline):
    """Prompt -> image with a FluxTransformer2DModel; see the module docstring for the stages."""

    ENCODERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")

    def __init__(self, *, spec: ModelSpec, folder: Path, transformer: torch.nn.Module, scheduler, text_encoder=None,
                 tokenizer=None, text_encoder_2=None, tokenizer_2=None, vae=None,
                 device: torch.device | str = "cpu") -> None:
        self._hold(spec=spec, folder=folder, transformer=transformer, scheduler=scheduler, vae=vae, device=device)
        self.text_encoder, self.tokenizer = text_encoder, tokenizer
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2
        vae_config = read_component_config(folder, "vae")
        self.vae_scale_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
        self.vae_spatial_factor = self.vae_scale_factor
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    @torch.no_grad()
    def encode(self, request: GenerationRequest) -> FluxText:
        """CLIP pooled + T5 sequence embeddings of the prompt, as FluxPipeline.encode_prompt computes them."""
        self.require_encoders(self.text_encoder, self.text_encoder_2)
        return self.cached_text(("flux", request.prompt, self.spec.max_sequence_length),
                                lambda: self._encode_prompt(request.prompt))

    def _encode_prompt(self, text: str) -> FluxText:
        prompt = [text]
        clip_ids = self.tokenizer(
            prompt, padding="max_length", max_length=self.tokenizer.model_max_length, truncation=True,
            return_tensors="pt",
        ).input_ids
        pooled = self.text_encoder(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        pooled = pooled.to(dtype=self.text_encoder.dtype)
        t5_ids = self.tokenizer_2(
            prompt, padding="max_length", max_length=self.spec.max_sequence_length, truncation=True,
            return_tensors="pt",
        ).input_ids
        prompt_embeds = self.text_encoder_2(t5_ids.to(self.device), output_hidden_states=False)[0]
        prompt_embeds = prompt_embeds.to(dtype=self.text_encoder_2.dtype)
        text_ids = torch.zeros(prompt_embeds.shape[1], 3, device=self.device, dtype=self.text_encoder.dtype)
        return FluxText(prompt_embeds=prompt_embeds, pooled_prompt_embeds=pooled, text_ids=text_ids)

    @torch.no_grad()
    def denoise(self, request: GenerationRequest, text: FluxText, on_step: StepCallback | None = None) -> torch.Tensor:
        """Run the flow-matching loop from the seed's noise; returns packed latents [B, tokens, C*4]."""
        text = FluxText(**{k: v.to(self.device) for k, v in vars(text).items()})
        batch = text.prompt_embeds.shape[0]
        channels = self.transformer_config.in_channels // 4
        height = 2 * (request.height // (self.vae_scale_factor * 2))
        width = 2 * (request.width // (self.vae_scale_factor * 2))
        generator = torch.Generator("cpu").manual_seed(request.seed)
        noise = randn_tensor((batch, channels, height, width), generator=generator, device=self.device,
                             dtype=text.prompt_embeds.dtype)
        latents = FluxPipeline._pack_latents(noise, batch, channels, height, width)
        image_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, self.device,
                                                           text.prompt_embeds.dtype)

        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        config = self.scheduler.config
        mu = calculate_shift(
            latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5), config.get("max_shift", 1.15),
        )
        timesteps, _ = retrieve_timesteps(self.scheduler, request.steps, self.device, sigmas=sigmas, mu=mu)
        guidance = None
        if self.transformer_config.guidance_embeds:
            guidance = torch.full([1], request.guidance, device=self.device, dtype=torch.float32).expand(batch)

        self.scheduler.set_begin_index(0)

        def predict(i: int, t: torch.Tensor, latents: torch.Tensor, name: str) -> torch.Tensor:
            return self.transformer(
                hidden_states=latents,
                timestep=t.expand(batch).to(latents.dtype) / 1000,
                guidance=guidance,
                pooled_projections=text.pooled_prompt_embeds,
                encoder_hidden_states=text.prompt_embeds,
                txt_ids=text.text_ids,
                img_ids=image_ids,
                joint_attention_kwargs={},
                return_dict=False,
            )[0]

        return self.run_denoise_loop(request, self.scheduler, timesteps, latents, predict, on_step)

    @torch.no_grad()
    def decode(self, request: GenerationRequest, latents: torch.Tensor) -> PIL.Image.Image | None:
        """VAE-decode packed latents into the image (None on a rank > 0 of a split decode)."""
        self.require_vae()
        latents = FluxPipeline._unpack_latents(latents.to(self.device), request.height, request.width,
                                               self.vae_scale_factor)
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.decode_latents(request, latents.to(self.vae.dtype))
        if image is None:
            return None
        return self.image_processor.postprocess(image, output_type="pil")[0]
