"""Qwen-Image text-to-image on diffusers' QwenImagePipeline components, in three stages.

    encode (rank 0: Qwen2.5-VL)  ->  denoise (every rank)  ->  decode (rank 0: Qwen-Image VAE)

The prompt encoding (Qwen-Image's system template, its first 34 tokens dropped, the last hidden layer),
the noise's shape and packing, the timesteps (dynamic shift from the image's token count), the
classifier-free guidance with its norm rescaling, the unpacking and the latent de-normalisation are
diffusers' QwenImagePipeline's own (rank 0 builds one over the loaded parts and calls its encode_prompt;
every rank uses its static packing helpers and calculate_shift), so our image equals its image
(tests/test_conformance.py). What differs is where things run, and how the text is masked:
- only rank 0 loads the text encoder and the VAE;
- the transformer is called without an attention mask (encoder_hidden_states_mask=None), which the split
  attention of engines.parallel.generic requires: each prompt is encoded on its own and kept to its real tokens, so
  every text token is real and the mask would be all True (diffusers then passes None too);
- classifier-free guidance (`guidance` above 1 is Qwen-Image's true_cfg_scale) makes two transformer calls
  a step, the prompt's and the negative prompt's, as diffusers does: the two have their own lengths, and
  without a mask they cannot share one batch; with --cfg-parallel each runs on its own half of the ranks at
  once (StagedPipeline.predict_guided, the transformer's forward_guided);
- the VAE decode runs whole on rank 0: pipelines.split_vae does not know AutoencoderKLQwenImage's decoder
  (decode_is_split says so).
As in diffusers, the text is as long as the prompt is, not padded: a compiled engine (static shapes) builds
once per distinct prompt length it meets.

Qwen-Image-Edit (QwenImageEditImagePipeline, checkpoint class QwenImageEditPipeline) is the same three stages with
the request's input image (`condition`: --input, a batch line's input, the UI's and API's input image) as its
reference, prepared as diffusers' QwenImageEditPipeline prepares it: resized to the input's aspect ratio at about
1024² pixels (its calculate_dimensions), given with the prompt to Qwen2.5-VL's vision tower (its edit template, its
first 64 tokens dropped, through its own encode_prompt), and VAE-encoded, normalised and packed into tokens that
follow the image's (img_shapes' second entry); each step's prediction is sliced back to the image's tokens. The
output size is the request's height and width (default 1024x1024); diffusers' own default is the reference's
calculated size, which a request gets by asking for that size. Its processor folder is loaded as
Qwen2VLProcessor over transformers' PIL image processor (Qwen2VLImageProcessorPil) and no video processor:
transformers' default image and video processors need torchvision, which the CPU test machine cannot have.

Qwen-Image-Edit-2509 and -2511 (QwenImageEditPlusImagePipeline, checkpoint class QwenImageEditPlusPipeline) take the
same stages with QwenImageEditPlusPipeline's preparation of one reference: the vision tower sees it at about 384²
(CONDITION_IMAGE_SIZE) under a "Picture 1:" prompt, the VAE encodes it at about 1024² (VAE_IMAGE_SIZE) from the
input itself. 2511's transformer (zero_cond_t in its config) gives the reference's tokens timestep 0 by itself,
from img_shapes: the generic path splits the per-token index it makes as its plan says (modulate_index).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import QwenImagePipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline, calculate_dimensions
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    VAE_IMAGE_SIZE,
    QwenImageEditPlusPipeline,
)
from diffusers.utils.torch_utils import randn_tensor
from transformers import Qwen2VLProcessor

from pipelines.media import open_image
from pipelines.qwen_image.limits import EDIT_AREA, QWEN_EDIT_CHECKPOINT, QWEN_EDIT_PLUS_CHECKPOINT
from pipelines.registry import ModelSpec, read_component_config
from pipelines.requests import GenerationRequest
from pipelines.stages import StagedPipeline, StepCallback, latent_statistics

PACK = 2
"""Latent rows and columns per token: QwenImagePipeline's packing helpers take 2x2 patches."""


@dataclass(kw_only=True)
class QwenImageConditioning:
    """What rank 0 encodes once and every rank's transformer needs."""

    prompt_embeds: torch.Tensor
    """[1, L, D]: the prompt's last hidden states, its real tokens only."""
    negative_embeds: torch.Tensor | None = None
    """[1, L', D]: the negative prompt's, when guidance is on (above 1); None otherwise."""
    image_latents: torch.Tensor | None = None
    """[1, R, C]: Qwen-Image-Edit's reference image, VAE-encoded, normalised and packed; None for text-to-image."""
    reference_grid: tuple[int, int] | None = None
    """Rows and columns of the reference's packed tokens (its img_shapes entry)."""


class QwenImageImagePipeline(StagedPipeline):
    """Prompt -> image with a QwenImageTransformer2DModel."""

    def __init__(self, *, spec: ModelSpec, folder: Path, transformer: torch.nn.Module, scheduler,
                 text_encoder=None, tokenizer=None, vae=None, device: torch.device | str = "cpu") -> None:
        self._hold(spec=spec, folder=folder, transformer=transformer, scheduler=scheduler, vae=vae, device=device)
        vae_config = read_component_config(folder, "vae")
        # QwenImagePipeline reads it from the loaded VAE, which ranks > 0 lack: the same from its config
        self.vae_scale_factor = 2 ** len(vae_config.get("temperal_downsample", [False, True, True]))
        self.vae_spatial_factor = self.vae_scale_factor
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * PACK)
        # diffusers' pipeline over the same parts: its prompt encoding.
        self._diffusers = None
        if text_encoder is not None:
            self._diffusers = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                                tokenizer=tokenizer, transformer=transformer)

    @classmethod
    def from_folder(cls, spec: ModelSpec, folder: Path, **options: Any) -> QwenImageImagePipeline:
        """StagedPipeline.from_folder; an editing checkpoint's folder (EDIT_PIPELINES) loads as its edit pipeline."""
        edit = EDIT_PIPELINES.get(spec.checkpoint_class)
        if edit is not None and cls is not edit:
            return edit.from_folder(spec, folder, **options)
        return super().from_folder(spec, folder, **options)

    def _grid(self, request: GenerationRequest) -> tuple[int, int]:
        """Rows and columns of packed latent tokens (VAE factor x 2x2 patches per token)."""
        step = self.vae_scale_factor * PACK
        return request.height // step, request.width // step

    # --- rank 0 ---------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, request: GenerationRequest) -> QwenImageConditioning:
        """The prompt's embeddings, and the negative prompt's when guidance is on (above 1)."""
        pipe = self._diffusers
        self.require_encoders(pipe)
        guided = request.guidance > 1.0
        prompts = (request.prompt, request.negative_prompt) if guided else (request.prompt,)
        length = self.spec.max_sequence_length

        def encode() -> list[torch.Tensor]:
            return [self._encode_one(pipe, prompt, length) for prompt in prompts]

        embeds = self.cached_text(("qwen-image", prompts, length), encode)
        return QwenImageConditioning(prompt_embeds=embeds[0], negative_embeds=embeds[1] if guided else None)

    def _encode_one(self, pipe: QwenImagePipeline | QwenImageEditPipeline, prompt: str, length: int,
                    **inputs) -> torch.Tensor:
        """One prompt alone through diffusers' encode_prompt (a batch of one has no padding), kept to the tokens
        its mask marks real: every token the transformer then sees is real, so it needs no mask.

        inputs: more of encode_prompt's arguments (Qwen-Image-Edit's image)."""
        embeds, mask = pipe.encode_prompt(prompt=prompt, device=self.device, max_sequence_length=length, **inputs)
        if mask is not None:
            embeds = embeds[:, mask[0].bool()]
        return embeds

    # --- every rank -----------------------------------------------------------------------------

    @torch.no_grad()
    def denoise(self, request: GenerationRequest, cond: QwenImageConditioning,
                on_step: StepCallback | None = None) -> torch.Tensor:
        """The flow-matching loop from the seed's noise; returns packed latents [1, tokens, C]."""
        device = self.device
        text = cond.prompt_embeds.to(device)
        negative = cond.negative_embeds.to(device) if cond.negative_embeds is not None else None
        rows, cols = self._grid(request)
        channels = self.transformer_config.in_channels // (PACK * PACK)
        generator = torch.Generator("cpu").manual_seed(request.seed)
        # QwenImagePipeline.prepare_latents: one frame of noise in the prompt's dtype, packed into 2x2 patches
        noise = randn_tensor((1, 1, channels, rows * PACK, cols * PACK), generator=generator,
                             device=device, dtype=text.dtype)
        latents = QwenImagePipeline._pack_latents(noise, 1, channels, rows * PACK, cols * PACK)
        img_shapes = [[(1, rows, cols)]]
        reference = cond.image_latents.to(device) if cond.image_latents is not None else None
        if reference is not None:  # Qwen-Image-Edit: the reference's tokens after the image's, as diffusers joins them
            img_shapes = [[(1, rows, cols), (1, *cond.reference_grid)]]

        config = self.scheduler.config
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        scheduler = copy.deepcopy(self.scheduler)  # the step index lives on the instance
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        timesteps, _ = retrieve_timesteps(scheduler, request.steps, device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)

        def predict(i: int, t: torch.Tensor, latents: torch.Tensor, name: str) -> torch.Tensor:
            timestep = t.expand(1).to(latents.dtype)
            tokens = latents if reference is None else torch.cat([latents, reference], dim=1)
            calls = [dict(hidden_states=tokens.to(self.dtype), timestep=timestep / 1000,
                          encoder_hidden_states=embeds.to(self.dtype), encoder_hidden_states_mask=None,
                          img_shapes=img_shapes, attention_kwargs={})
                     for embeds in (text, negative) if embeds is not None]
            prediction, *rest = self.predict_guided(calls)
            prediction = prediction[:, : latents.shape[1]]  # the image's tokens (the reference's follow them)
            if negative is not None:
                unconditional = rest[0][:, : latents.shape[1]]
                combined = unconditional + request.guidance * (prediction - unconditional)
                # Qwen-Image's rescaling: the guided prediction keeps the conditional one's norm per token
                prediction = combined * (torch.norm(prediction, dim=-1, keepdim=True)
                                         / torch.norm(combined, dim=-1, keepdim=True))
            return prediction

        return self.run_denoise_loop(request, scheduler, timesteps, latents, predict, on_step)

    # --- rank 0 ---------------------------------------------------------------------------------

    def decode_is_split(self, request: GenerationRequest) -> bool:
        """Never: pipelines.split_vae does not know AutoencoderKLQwenImage's decoder, so rank 0 decodes whole."""
        return False

    @torch.no_grad()
    def decode(self, request: GenerationRequest, latents: torch.Tensor) -> PIL.Image.Image:
        """Unpack, de-normalise with the VAE's latent statistics and VAE-decode the one frame."""
        self.require_vae()
        latents = QwenImagePipeline._unpack_latents(latents.to(self.device), request.height, request.width,
                                                    self.vae_scale_factor).to(self.vae.dtype)
        mean, inverse_std = latent_statistics(self.vae.config, latents)
        image = self.decode_latents(request, latents / inverse_std + mean)[:, :, 0]  # QwenImagePipeline's arithmetic
        return self.image_processor.postprocess(image, output_type="pil")[0]


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """transformers' Qwen2VLProcessor for text and images only: ProcessorMixin takes the parts this __init__ names,
    so the video processor (which needs torchvision) is neither asked for nor checked."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_edit_processor(folder: Path) -> Qwen2VLImageTextProcessor:
    """A Qwen-Image-Edit folder's processor/ (preprocessor_config.json and the tokenizer's files) without
    torchvision: transformers' PIL image processor, the folder's tokenizer, no video processor."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = folder / "processor"
    return Qwen2VLImageTextProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
                                     tokenizer=AutoTokenizer.from_pretrained(path))


class QwenImageEditImagePipeline(QwenImageImagePipeline):
    """Prompt and reference image -> image with Qwen-Image-Edit's QwenImageTransformer2DModel (module docstring)."""

    DIFFUSERS = QwenImageEditPipeline
    """diffusers' pipeline whose prompt-and-image encoding and VAE encoding this one uses."""
    VISION_AREA = EDIT_AREA
    """Pixels of the reference the vision tower sees (about: calculate_dimensions keeps its aspect)."""
    VAE_AREA = EDIT_AREA
    """Pixels of the reference the VAE encodes into the tokens that follow the image's."""

    def __init__(self, *, spec: ModelSpec, folder: Path, transformer: torch.nn.Module, scheduler,
                 text_encoder=None, tokenizer=None, vae=None, device: torch.device | str = "cpu") -> None:
        super().__init__(spec=spec, folder=folder, transformer=transformer, scheduler=scheduler, vae=vae,
                         device=device)
        # diffusers' pipeline over the same parts and the folder's processor: its prompt-and-image encoding and its
        # reference's VAE encoding (rank 0's; None on the ranks that load no encoders).
        self._diffusers = None if text_encoder is None else self.DIFFUSERS(
            scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
            processor=load_edit_processor(folder), transformer=transformer)

    @torch.no_grad()
    def encode(self, request: GenerationRequest) -> QwenImageConditioning:
        """The prompt's embeddings with the reference image (and the negative prompt's when guidance is on), and
        the reference's packed latents, as DIFFUSERS makes them."""
        pipe = self._diffusers
        self.require_encoders(pipe, self.vae)
        if request.condition is None:
            raise ValueError(f"model '{self.spec.name}' edits an image: the request brings none (its input)")
        image = open_image(request.condition)  # upright, as diffusers' load_image gives it
        width, height, _ = calculate_dimensions(self.VISION_AREA, image.width / image.height)
        reference = self.image_processor.resize(image, height, width)  # what the vision tower sees, as diffusers
        guided = request.guidance > 1.0
        prompts = (request.prompt, request.negative_prompt) if guided else (request.prompt,)
        length = self.spec.max_sequence_length

        def encode() -> list[torch.Tensor]:
            return [self._encode_one(pipe, prompt, length, image=reference) for prompt in prompts]

        picture = (reference.size, hashlib.sha256(reference.tobytes()).hexdigest())
        embeds = self.cached_text((self.DIFFUSERS.__name__, prompts, picture), encode)
        # the VAE's reference from the input itself (the same pixels as from `reference` where the areas agree:
        # resizing to the size an image has already is no change)
        width, height, _ = calculate_dimensions(self.VAE_AREA, image.width / image.height)
        pixels = self.image_processor.preprocess(image, height, width).unsqueeze(2)  # [1, 3, 1, H, W]
        latents = pipe._encode_vae_image(pixels.to(self.device, embeds[0].dtype), generator=None)  # normalised
        channels, rows, cols = latents.shape[1], latents.shape[3], latents.shape[4]
        packed = QwenImageEditPipeline._pack_latents(latents, 1, channels, rows, cols)
        return QwenImageConditioning(prompt_embeds=embeds[0], negative_embeds=embeds[1] if guided else None,
                                     image_latents=packed, reference_grid=(rows // PACK, cols // PACK))


class QwenImageEditPlusImagePipeline(QwenImageEditImagePipeline):
    """Prompt and reference image -> image with Qwen-Image-Edit-2509 or -2511 (QwenImageEditPlusPipeline's
    preparation of one reference: module docstring)."""

    DIFFUSERS = QwenImageEditPlusPipeline
    VISION_AREA = CONDITION_IMAGE_SIZE
    VAE_AREA = VAE_IMAGE_SIZE


EDIT_PIPELINES = {QWEN_EDIT_CHECKPOINT: QwenImageEditImagePipeline,
                  QWEN_EDIT_PLUS_CHECKPOINT: QwenImageEditPlusImagePipeline}
"""An editing checkpoint's class (model_index.json) -> the pipeline that loads it (from_folder)."""
