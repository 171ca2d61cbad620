"""FLUX.3 text-to-image, and image-conditioned with a reference image, on diffusers' FLUX.3 components
(Flux3ModularPipeline and its step-distilled Flux3DistilledModularPipeline), in three stages.

    encode (rank 0: Qwen3-VL; the reference image through the VAE)  ->  denoise (every rank)  ->
    decode (rank 0: the FLUX.2 VAE)

The prompt encoding (Qwen3-VL's chat template, the window padded to a multiple of 80 tokens, hidden layers
4, 8, ..., 32 stacked), the noise and its position ids (image rows and columns at rotary scale 0.5), the text
ids, the timesteps (a constant shift, as the scheduler diffusers makes for FLUX.3), the reference image's
preprocessing, latents and ids, the unpacking and the batch-norm de-normalisation are diffusers' FLUX.3 blocks'
own helpers (diffusers.modular_pipelines.flux3), called with the defaults its blocks use; the transformer
is called with the keyword arguments its loop denoisers pass: classifier-free guidance as the base model's
guider combines two calls (prompt, then negative prompt, each with its own text length), and a
distilled (flow-map) checkpoint's single call with the timestep each step jumps to. So our image equals
the modular pipeline's (tests/test_conformance.py). What differs:
- only rank 0 loads the text encoder and the VAE;
- prompt upsampling (the auto blocks' first step, a separate Qwen3.5 model that rewrites the prompt) is not
  offered: the prompt is encoded as given, as diffusers does with that step popped;
- prompts are cut at the checkpoint's max_sequence_length (512 tokens) where diffusers' default is 8192;
- a reference image is always generated at the request's size (the request has one), so nothing is cropped
  back: diffusers' "generate at the reference's padded canvas, crop back" applies only without a size;
  one reference image, not several;
- a folder whose processor is a plain tokenizer (the tiny test folders: Qwen3-VL's processor needs
  torchvision for its video half) is used through ChatTokenizer, its own chat template unchanged;
- LoRAs and the step cache apply as for the other families; guidance never runs batched (the two calls may
  differ in text length, and FLUX.3 attends to its padding, so they cannot share a batch): with --cfg-parallel
  the base model's two calls run at once, each on its own half of the ranks (StagedPipeline.predict_guided);
  a distilled checkpoint has no guidance, so --cfg-parallel does not apply to it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers.modular_pipelines.flux3.before_denoise import (
    Flux3PrepareImageCondLatentsStep,
    Flux3PrepareLatentsStep,
    Flux3SetTimestepsStep,
    Flux3TextRoPEInputsStep,
    _prepare_image_ids,
    retrieve_timesteps,
)
from diffusers.modular_pipelines.flux3.decoders import Flux3DecodeStep
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep, Flux3VaeEncoderStep
from diffusers.utils.torch_utils import randn_tensor

from pipelines.flux2.pipeline import unpack_latents
from pipelines.media import open_image
from pipelines.registry import ModelSpec, read_component_config, read_model_index
from pipelines.requests import GenerationRequest
from pipelines.stages import StagedPipeline, StepCallback


def _created(block: Any, name: str) -> Any:
    """The component `name` as diffusers' FLUX.3 `block` makes it from its own config (FLUX.3's folders hold
    no scheduler or image processor)."""
    return next(spec for spec in block.expected_components if spec.name == name).create()


class ChatTokenizer:
    """A tokenizer in the place of Qwen3-VL's processor: diffusers' FLUX.3 text encoding uses only the
    processor's chat template and its `.tokenizer`, which a tokenizer with the same chat template provides."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(*args, **kwargs)


def as_processor(tokenizer: Any) -> Any:
    """`tokenizer` (a folder's "tokenizer" component) as FLUX.3's text encoding uses it: a processor as is, a
    plain tokenizer through ChatTokenizer."""
    return tokenizer if hasattr(tokenizer, "tokenizer") else ChatTokenizer(tokenizer)


@dataclass(kw_only=True)
class Flux3Conditioning:
    """What rank 0 encodes once and every rank's transformer needs."""

    prompt_embeds: torch.Tensor
    """[1, L, D]: the prompt's stacked hidden states, its window padded to a multiple of 80 tokens."""
    negative_embeds: torch.Tensor | None = None
    """[1, L', D]: the negative prompt's, when guidance is on; None otherwise (and always for a distilled model)."""
    reference_latents: torch.Tensor | None = None
    """The reference image's normalised latents as tokens [1, N, C], or None."""
    reference_ids: torch.Tensor | None = None
    """Their position ids [N, 4] (l = -1: the first reference)."""


class Flux3ImagePipeline(StagedPipeline):
    """Prompt (and optional reference image) -> image with a Flux3Transformer2DModel."""

    def __init__(self, *, spec: ModelSpec, folder: Path, transformer: torch.nn.Module, scheduler=None,
                 text_encoder=None, tokenizer=None, vae=None, device: torch.device | str = "cpu") -> None:
        scheduler = scheduler if scheduler is not None else _created(Flux3SetTimestepsStep(), "scheduler")
        self._hold(spec=spec, folder=folder, transformer=transformer, scheduler=scheduler, vae=vae, device=device)
        self.distilled = bool(transformer.config.flow_map)
        self.text_encoder = text_encoder
        self.processor = as_processor(tokenizer) if tokenizer is not None else None
        self.image_processor = _created(Flux3DecodeStep(), "image_processor")
        # from the folder's config, not the loaded VAE, which ranks > 0 lack (the latent grid is every rank's)
        vae_config = read_component_config(folder, "vae")
        self.vae_scale_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
        self.vae_spatial_factor = self.vae_scale_factor
        self._text_step = Flux3TextEncoderStep()
        self._rope_scale = Flux3PrepareLatentsStep().image_rope_scale

    @classmethod
    def components(cls, folder: Path, with_encoders: bool) -> list[str]:
        """A FLUX.3 folder (modular_model_index.json) without a scheduler, as diffusers saves them, gets the one
        diffusers' FLUX.3 blocks make."""
        names = super().components(folder, with_encoders)
        return names if "scheduler" in read_model_index(folder) else [name for name in names if name != "scheduler"]

    def _guided(self, request: GenerationRequest) -> bool:
        """Whether `request` makes two calls a step: the base model's guider, on unless its scale is 1."""
        return not self.distilled and not math.isclose(request.guidance, 1.0)

    def _latent_grid(self, request: GenerationRequest) -> tuple[int, int]:
        factor = self.vae_scale_factor * 2  # the VAE's 8x, then 2x2 latent patches per token
        return request.height // factor, request.width // factor

    # --- rank 0 ---------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, request: GenerationRequest) -> Flux3Conditioning:
        """Prompt embeddings (and the negative prompt's with guidance), and the reference image's latents."""
        self.require_encoders(self.text_encoder, self.processor)
        cond = Flux3Conditioning(prompt_embeds=self._text(request.prompt))
        if self._guided(request):
            cond.negative_embeds = self._text(request.negative_prompt or "")
        if request.condition is not None:
            cond.reference_latents, cond.reference_ids = self._reference(Path(request.condition))
        return cond

    def _text(self, prompt: str) -> torch.Tensor:
        """One prompt through diffusers' FLUX.3 text encoding, from the prompt cache if it holds it."""
        length = self.spec.max_sequence_length
        step = self._text_step
        return self.cached_text(
            ("flux3", prompt, length),
            lambda: step._get_qwen3_vl_prompt_embeds(self.text_encoder, self.processor, prompt, device=self.device,
                                                     max_sequence_length=length, pad_multiple=step.pad_multiple))

    def _reference(self, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference image as diffusers' FLUX.3 blocks prepare one: scaled to fit its canvas and reflect-padded
        to the 16-pixel grid, VAE-encoded (the mode), packed 2x2 and batch-norm normalised, as tokens with ids."""
        self.require_vae()
        image = open_image(path)  # upright, as diffusers' load_image gives it
        pixels, _ = self.image_processor.preprocess(image, resize_mode="fill")  # one reference: kept whole
        vae = self.vae
        latents = vae.encode(pixels.to(self.device, vae.dtype)).latent_dist.mode()
        latents = Flux3VaeEncoderStep._patchify_latents(latents)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(self.device, vae.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(self.device, vae.dtype)
        latents = (latents - mean) / std
        rows, cols = latents.shape[-2:]
        ids = _prepare_image_ids(rows, cols, Flux3PrepareImageCondLatentsStep().image_rope_scale, l_coord=-1)
        return latents.flatten(2).transpose(1, 2), ids

    # --- every rank -----------------------------------------------------------------------------

    @torch.no_grad()
    def denoise(self, request: GenerationRequest, cond: Flux3Conditioning,
                on_step: StepCallback | None = None) -> torch.Tensor:
        """The flow-matching loop from the seed's noise; returns the image tokens [1, tokens, C]."""
        device, dtype = self.device, self.dtype
        text = cond.prompt_embeds.to(device, dtype)
        negative = cond.negative_embeds.to(device, dtype) if cond.negative_embeds is not None else None
        rows, cols = self._latent_grid(request)
        generator = torch.Generator("cpu").manual_seed(request.seed)
        # Flux3PrepareLatentsStep: drawn in float32 (the reference implementation's RNG stream), then cast
        noise = randn_tensor((1, self.transformer_config.in_channels, rows, cols), generator=generator,
                             device=device, dtype=torch.float32)
        latents = noise.to(dtype).flatten(2).transpose(1, 2)
        fixed: dict[str, Any] = {"img_ids": _prepare_image_ids(rows, cols, self._rope_scale).to(device)}
        if cond.reference_latents is not None:
            fixed["image_cond_hidden_states"] = cond.reference_latents.to(device, dtype)
            fixed["image_cond_ids"] = cond.reference_ids.to(device)
        text_ids = Flux3TextRoPEInputsStep._prepare_text_ids(text).to(device)
        negative_ids = Flux3TextRoPEInputsStep._prepare_text_ids(negative).to(device) if negative is not None else None

        scheduler = copy.deepcopy(self.scheduler)  # the step index lives on the instance
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        timesteps, _ = retrieve_timesteps(scheduler, request.steps, device, sigmas=sigmas)
        scheduler.set_begin_index(0)

        def predict(i: int, t: torch.Tensor, latents: torch.Tensor, name: str) -> torch.Tensor:
            model_input = latents.to(dtype)
            timestep = (t / 1000).expand(1).to(model_input.dtype)
            if self.distilled:  # Flux3DistilledLoopDenoiser: one call, told the timestep it jumps to
                following = timesteps[i + 1] if i + 1 < len(timesteps) else torch.zeros_like(t)
                return self.transformer(
                    hidden_states=model_input, encoder_hidden_states=text, timestep=timestep,
                    target_timestep=(following / 1000).expand(1).to(model_input.dtype), return_dict=False,
                    txt_ids=text_ids, **fixed)[0]
            # Flux3LoopDenoiser: the prompt's call, then the negative prompt's
            calls = [dict(hidden_states=model_input, timestep=timestep, **fixed, encoder_hidden_states=embeds,
                          txt_ids=ids)
                     for embeds, ids in ((text, text_ids), (negative, negative_ids)) if embeds is not None]
            prediction, *rest = self.predict_guided(calls)
            if negative is not None:  # ClassifierFreeGuidance.forward
                prediction = rest[0] + request.guidance * (prediction - rest[0])
            return prediction

        return self.run_denoise_loop(request, scheduler, timesteps, latents, predict, on_step)

    # --- rank 0 ---------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, request: GenerationRequest, latents: torch.Tensor) -> PIL.Image.Image | None:
        """Unpack, de-normalise with the VAE's batch-norm statistics, un-patch and VAE-decode (None on a rank > 0
        of a split decode)."""
        self.require_vae()
        latents = unpack_latents(self.vae, latents.to(self.device), *self._latent_grid(request))
        image = self.decode_latents(request, latents.to(self.vae.dtype))
        if image is None:
            return None
        return self.image_processor.postprocess(image, output_type="pil")[0]
