"""FLUX.2 (dev and Klein) text-to-image, and image-conditioned with a reference image, on diffusers'
FLUX.2 components, in three stages.

    encode (rank 0: the text encoder; the reference image through the VAE)  ->  denoise (every rank)  ->
    decode (rank 0: VAE)

The prompt encoding (Mistral Small 3.1 for dev, Qwen3 for Klein: stacked hidden layers), the
reference image's preprocessing and latents, the noise, ids, timesteps and the unpacking are
diffusers' Flux2Pipeline's and Flux2KleinPipeline's own (rank 0 builds the one its folder names over
the loaded parts and calls its helpers), so our image equals theirs (tests/test_conformance.py).
What differs is where things run:
- only rank 0 loads the text encoder and VAE; FLUX.2-dev's 24B encoder is never on another rank;
- Klein base checkpoints' classifier-free guidance runs its two branches as one batch-2 transformer
  call (the prompt and negative prompt are padded to the same length), which a CFG-parallel run splits
  over two rank groups; diffusers calls the branches one after the other. The negative prompt is the
  request's (empty by default, diffusers' fixed one);
- reference K/V caching (the Klein KV checkpoints) is not offered: every step attends to the
  reference tokens afresh, as without the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from pipelines.flux2.limits import REFERENCE_MAX_AREA
from pipelines.media import open_image
from pipelines.registry import ModelSpec, read_component_config
from pipelines.requests import GenerationRequest, uses_guidance_batch
from pipelines.stages import StagedPipeline, StepCallback


@dataclass(kw_only=True)
class Flux2Conditioning:
    """What rank 0 encodes once and every rank's transformer needs."""

    prompt_embeds: torch.Tensor
    """[B, L, D]: the prompt's, then the negative prompt's when guidance has two branches."""
    text_ids: torch.Tensor
    """Rotary ids of the text tokens, [L, 4] (0, 0, 0, position)."""
    reference_latents: torch.Tensor | None = None
    """The reference image's packed, normalised latents [1, N, C], or None."""
    reference_ids: torch.Tensor | None = None
    """Their rotary ids [N, 4] (time coordinate 10: they follow the generated image's tokens)."""


def unpack_latents(vae: Any, latents: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Packed tokens [B, rows x cols, 4C] -> what the FLUX.2 VAE (FLUX.3's too) decodes, [B, C, 2 rows, 2 cols]:
    de-normalised with the VAE's batch-norm statistics, then un-patched (2x2), as Flux2Pipeline does."""
    latents = latents.reshape(latents.shape[0], rows, cols, -1).permute(0, 3, 1, 2)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents)
    return Flux2Pipeline._unpatchify_latents(latents * std + mean)


class Flux2ImagePipeline(StagedPipeline):
    """Prompt (and optional reference image) -> image with a Flux2Transformer2DModel."""

    def __init__(self, *, spec: ModelSpec, folder: Path, transformer: torch.nn.Module, scheduler,
                 text_encoder=None, tokenizer=None, vae=None, device: torch.device | str = "cpu") -> None:
        self._hold(spec=spec, folder=folder, transformer=transformer, scheduler=scheduler, vae=vae, device=device)
        self.guidance_branches = 2 if uses_guidance_batch(spec) else 1
        vae_config = read_component_config(folder, "vae")
        self.vae_scale_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
        self.vae_spatial_factor = self.vae_scale_factor
        # diffusers' pipeline over the same parts: its prompt encoding, image preprocessing and latent helpers.
        self._diffusers = None
        if text_encoder is not None and vae is not None:
            cls = Flux2KleinPipeline if spec.checkpoint_class == "Flux2KleinPipeline" else Flux2Pipeline
            self._diffusers = cls(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                  transformer=transformer)

    def _branches(self, request: GenerationRequest) -> int:
        return self.guidance_branches if request.guidance > 1.0 else 1

    # --- rank 0 ---------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, request: GenerationRequest) -> Flux2Conditioning:
        """Prompt embeddings (and the negative prompt's with guidance), and the reference image's latents."""
        pipe = self._diffusers
        self.require_encoders(pipe)
        prompts = [request.prompt, request.negative_prompt][: self._branches(request)]
        embeds, text_ids = self.cached_text(
            ("flux2", tuple(prompts), self.spec.max_sequence_length),
            lambda: pipe.encode_prompt(prompt=prompts, device=self.device,
                                       max_sequence_length=self.spec.max_sequence_length))
        cond = Flux2Conditioning(prompt_embeds=embeds, text_ids=text_ids[0])
        if request.condition is not None:
            image = self._reference_image(Path(request.condition))
            latents, ids = pipe.prepare_image_latents(images=[image], batch_size=1, generator=None,
                                                      device=self.device, dtype=self.vae.dtype)
            cond.reference_latents, cond.reference_ids = latents, ids[0]
        return cond

    def _reference_image(self, path: Path) -> torch.Tensor:
        """The reference image as diffusers prepares it: scaled down to REFERENCE_MAX_AREA if larger, cropped
        to a multiple of the VAE factor x 2, in [-1, 1]."""
        processor = self._diffusers.image_processor
        image = open_image(path)  # upright, as diffusers' load_image gives it
        if image.width * image.height > REFERENCE_MAX_AREA:
            image = processor._resize_to_target_area(image, REFERENCE_MAX_AREA)
        multiple = self.vae_scale_factor * 2
        width, height = image.width // multiple * multiple, image.height // multiple * multiple
        return processor.preprocess(image, height=height, width=width, resize_mode="crop")

    # --- every rank -----------------------------------------------------------------------------

    @torch.no_grad()
    def denoise(self, request: GenerationRequest, cond: Flux2Conditioning,
                on_step: StepCallback | None = None) -> torch.Tensor:
        """The flow-matching loop from the seed's noise; returns packed latents [1, tokens, C]."""
        device = self.device
        embeds = cond.prompt_embeds.to(device)
        branches = embeds.shape[0]
        pipe_cls = Flux2Pipeline  # the static latent helpers, the same in both pipelines
        rows, cols = request.height // (self.vae_scale_factor * 2), request.width // (self.vae_scale_factor * 2)
        generator = torch.Generator("cpu").manual_seed(request.seed)
        noise = randn_tensor((1, self.transformer_config.in_channels, rows, cols), generator=generator,
                             device=device, dtype=embeds.dtype)
        latents = pipe_cls._pack_latents(noise)
        ids = pipe_cls._prepare_latent_ids(noise)[0].to(device)
        reference = None
        if cond.reference_latents is not None:
            reference = cond.reference_latents.to(device, embeds.dtype)
            ids = torch.cat([ids, cond.reference_ids.to(device)])

        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        if getattr(self.scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        mu = compute_empirical_mu(image_seq_len=latents.shape[1], num_steps=request.steps)
        timesteps, _ = retrieve_timesteps(self.scheduler, request.steps, device, sigmas=sigmas, mu=mu)
        guidance = None
        if self.transformer_config.guidance_embeds:
            guidance = torch.full([1], request.guidance, device=device, dtype=torch.float32).expand(branches)

        self.scheduler.set_begin_index(0)

        def predict(i: int, t: torch.Tensor, latents: torch.Tensor, name: str) -> torch.Tensor:
            model_input = latents if reference is None else torch.cat([latents, reference], dim=1)
            prediction = self.transformer(
                hidden_states=model_input.expand(branches, -1, -1).to(self.dtype),
                timestep=t.expand(branches).to(latents.dtype) / 1000,
                guidance=guidance,
                encoder_hidden_states=embeds,
                txt_ids=cond.text_ids.to(device),
                img_ids=ids,
                joint_attention_kwargs={},
                return_dict=False,
            )[0][:, : latents.shape[1]]
            if branches == 2:
                prediction = prediction[1:] + request.guidance * (prediction[:1] - prediction[1:])
            return prediction

        return self.run_denoise_loop(request, self.scheduler, timesteps, latents, predict, on_step)

    # --- rank 0 ---------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, request: GenerationRequest, latents: torch.Tensor) -> PIL.Image.Image | None:
        """Unpack, de-normalise with the VAE's batch-norm statistics, un-patch and VAE-decode (None on a rank > 0
        of a split decode)."""
        self.require_vae()
        rows, cols = request.height // (self.vae_scale_factor * 2), request.width // (self.vae_scale_factor * 2)
        latents = unpack_latents(self.vae, latents.to(self.device), rows, cols)
        image = self.decode_latents(request, latents.to(self.vae.dtype))
        if image is None:
            return None
        return self._diffusers.image_processor.postprocess(image, output_type="pil")[0]
