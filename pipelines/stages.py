"""What every pipeline here shares: the three stages' contract, the model's limits, the transformer seam,
the prompt-embedding cache and the split VAE decode.

A pipeline is encode (rank 0) -> denoise (every rank) -> decode (rank 0, or every rank with a split decode). Its
denoise prepares the latents, timesteps and conditioning and runs the one denoising loop, `run_denoise_loop`,
with the family's step (model inputs, transformer calls, guidance). That step calls the transformer in one
place, through `self.transformer`, which engines/ replaces (use_transformer) with a context-parallel or compiled
module of the same call signature. Its decode calls the VAE in one place, `decode_latents`, which splits the
decode over the ranks of `use_split_vae`'s group (pipelines.split_vae) where the image is tall enough; a family
that splits part of its encoding over them (Cosmos-Predict2's input video) does it in `prepare`, which every
rank runs once rank 0's encoding reached it. Its encode runs the text encoders through `cached_text`, so that a
repeated prompt is not encoded again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import Any, TypeVar

from pipelines.prompt_cache import PromptCache
from pipelines.registry import ModelSpec, family_of
from pipelines.requests import GenerationRequest, MediaLimits, read_limits

T = TypeVar("T")
StepCallback = Callable[[int, int], None]
"""Called after each denoising step with (steps done, total); it may raise to cancel the request."""
Predict = Callable[[int, Any, Any, str], Any]
"""A family's denoising step up to the scheduler: (index, timestep, latents, transformer name) -> the prediction
the scheduler steps with (the step's model inputs, the transformer call or calls, the guidance)."""


def latent_statistics(vae_config: Any, like: Any) -> tuple[Any, Any]:
    """A Wan-style VAE's per-channel latent mean and inverse standard deviation (its config's latents_mean and
    latents_std), [1, z_dim, 1, 1, 1] on `like`'s device and in its dtype: diffusers' Wan and Qwen-Image pipelines'
    arithmetic (latents normalised as (x - mean) * inverse_std, de-normalised as x / inverse_std + mean)."""
    import torch

    mean = torch.tensor(vae_config.latents_mean).view(1, vae_config.z_dim, 1, 1, 1).to(like)
    inverse_std = 1.0 / torch.tensor(vae_config.latents_std).view(1, vae_config.z_dim, 1, 1, 1).to(like)
    return mean, inverse_std


class StagedPipeline:
    """Base of the family pipelines (each family folder's pipeline.py)."""

    spec: ModelSpec
    folder: Path
    transformer: Any
    transformer_names: tuple[str, ...] = ("transformer",)
    """The attributes that hold the transformers its denoising loop calls: one, or Wan 2.2 A14B's two experts
    ("transformer" for the high-noise steps, "transformer_2" after the boundary). Whatever engines/ does to a
    transformer (FP8, LoRA, the parallel plan, the engine, the step cache) it does to each."""
    step_caches: dict[str, Any] = {}
    """Each transformer's step cache (engines.levers.step_cache.StepCache, `--cache`) by attribute name; empty: every
    step computed."""
    vae: Any = None
    vae_spatial_factor: int = 8
    """Image rows per latent row of what the VAE decodes (set by each family's pipeline)."""
    vae_group: Any = None
    """The process group over whose ranks the VAE decode is split (use_split_vae), or None: rank 0 decodes."""
    prompt_cache: PromptCache | None = None
    """Rank 0's recent text encodings (use_prompt_cache), or None: every request encodes its prompt."""
    loras: list[Any] = []
    """The LoRAs each transformer carries (engines.weights.lora.LoraSet, use_loras; in transformer_names' order), or
    none."""
    attention_precision: str = "full"
    """The run's --attention-precision (engines.options.ATTENTION_PRECISIONS), applied by cache_step per step."""
    ENCODERS: tuple[str, ...] = ("text_encoder", "tokenizer")
    """The components only rank 0 loads: what encodes a request."""
    COMPONENT_DTYPES: dict[str, Any] = {}
    """Components kept in their own dtype whatever the run's (e.g. a VAE in float32); none by default."""

    @classmethod
    def components(cls, folder: Path, with_encoders: bool) -> list[str]:
        """The components from_folder loads from `folder` besides the VAE: the transformer, the scheduler and, with
        the encoders, ENCODERS (a family whose folders differ in what they hold reads it here)."""
        return ["transformer", "scheduler", *(cls.ENCODERS if with_encoders else ())]

    @classmethod
    def from_folder(cls, spec: ModelSpec, folder: Path, *, device: Any = "cpu", dtype: Any, with_encoders: bool = True,
                    with_vae: bool | None = None, share: Any = None) -> Any:
        """Load from a diffusers folder of the checkpoint's pipeline class. `with_encoders=False` (ranks > 0) skips
        the ENCODERS, and the VAE too unless `with_vae` (a split decode runs it on every rank); `share`: only this
        rank's tensor-parallel share of the transformer is read (pipelines.loading.TransformerShare)."""
        from pipelines.loading import load_parts

        names = cls.components(folder, with_encoders)
        names += ["vae"] if (with_encoders if with_vae is None else with_vae) else []
        parts = load_parts(folder, names, dtype=dtype, device=device, dtypes=cls.COMPONENT_DTYPES, share=share)
        return cls(spec=spec, folder=folder, device=device, **parts)

    def _hold(self, *, spec: ModelSpec, folder: Path, transformer: Any, scheduler: Any, vae: Any, device: Any) -> None:
        """Keep what every pipeline keeps of its parts (a family's __init__ calls it first): the spec and folder,
        the transformer with its config and dtype, the scheduler, the VAE (None on ranks that do not decode)."""
        import torch

        self.spec, self.folder, self.device = spec, folder, torch.device(device)
        self.transformer_config, self.transformer, self.dtype = transformer.config, transformer, transformer.dtype
        self.scheduler, self.vae = scheduler, vae

    def limits(self) -> MediaLimits:
        """What sizes and frame counts this pipeline's checkpoint accepts (from its configs)."""
        return read_limits(self.spec, self.folder)

    def transformers(self) -> list[tuple[str, Any]]:
        """(attribute, module) of each transformer the denoising loop calls, in transformer_names' order."""
        return [(name, getattr(self, name)) for name in self.transformer_names]

    def use_transformer(self, module: Any, name: str = "transformer") -> None:
        """Replace the module the denoising loop calls as `name` (engines/ parallel or compiled wrapper)."""
        if name not in self.transformer_names:
            raise ValueError(f"this pipeline has no transformer {name!r} (it has {', '.join(self.transformer_names)})")
        setattr(self, name, module)

    def use_loras(self, files: Any, *, tp: int = 1, tp_rank: int = 0, fitting: bool = False) -> None:
        """Give each transformer (a diffusers model, split for `tp` and/or FP8 already) every LoRA of `files`
        (engines.options.LoraFile: each expert of a two-expert model its own file where the LoRA has two), all at
        scale 0 until a request chooses (apply_loras). fitting: only those that fit every transformer, the others
        left to the server's other models (none fits: no LoRA, self.loras stays empty)."""
        from engines.levers.fp8 import is_fp8
        from engines.weights.lora import attach_loras, check_lora_files, fitting_lora_files
        from pipelines.family import load

        per_transformer = []
        for index, (_, model) in enumerate(self.transformers()):
            mine = [file.for_expert(index) for file in files]
            if fitting:
                per_transformer.append(fitting_lora_files(mine, type(model), dict(model.config))[0])
            else:
                per_transformer.append(check_lora_files(mine, type(model), dict(model.config)))
        names = set.intersection(*({weights.name for weights in loras} for loras in per_transformer))
        if not names:
            return
        self.loras = []
        for (_, model), loras in zip(self.transformers(), per_transformer, strict=True):
            split = load(family_of(self.spec).tensor_parallel)(model, tp) if tp > 1 else None
            dtype = next(p.dtype for p in model.parameters() if not is_fp8(p))  # the run's (FP8 layers' are bf16)
            self.loras.append(attach_loras(model, [weights for weights in loras if weights.name in names], dtype=dtype,
                                           split=split, tp=tp, rank=tp_rank))

    def apply_loras(self, request: GenerationRequest) -> None:
        """Before a denoising loop, on every rank: the request's LoRAs and scales, written in place (no recompile)."""
        if not self.loras and request.lora:
            raise ValueError(f"this pipeline carries no LoRA, the request asks for {dict(request.lora)}")
        for loras in self.loras:
            loras.select(request.lora)

    def use_step_cache(self, options: Any, group: Any = None) -> None:
        """A step cache (engines.levers.step_cache; `options`: its CacheOptions) on each transformer as it is now
        (after use_transformer: compiled blocks are wrapped, not traced), deciding over `group`'s ranks."""
        from engines.levers.step_cache import install_step_cache

        family = family_of(self.spec)
        self.step_caches = {name: install_step_cache(module, options, block_lists=family.repeated_blocks,
                                                     outputs=family.block_outputs, stream=family.cache_stream,
                                                     group=group)
                            for name, module in self.transformers()}

    def remove_step_caches(self) -> None:
        """Put every transformer's blocks back as they were before use_step_cache."""
        for cache in self.step_caches.values():
            cache.remove()
        self.step_caches = {}

    def reset_step_caches(self) -> None:
        """Before a denoising loop that may not call every transformer (Wan 2.2 A14B's experts): each cache forgets
        the last request, so that computed_steps counts this one's steps only."""
        for cache in self.step_caches.values():
            cache.reset()

    def cache_step(self, request: GenerationRequest, index: int, total: int,
                   name: str = "transformer") -> AbstractContextManager:
        """Around denoising step `index` of `total` of transformer `name` (its own count: an expert's steps are its
        share of the loop): the step cache's step, if there is one, and the step's attention precision
        (engines.options.attention_precision_at: the run's, full on the first and last steps or where the
        request asks for full precision)."""
        cache = self.step_caches.get(name)
        precision = self.attention_precision if request.quantized_attention else "full"
        if cache is None and precision == "full":
            return nullcontext()
        from engines.levers.quantized_attention import attention_precision
        from engines.options import attention_precision_at

        stack = ExitStack()
        stack.enter_context(attention_precision(attention_precision_at(precision, index, total)))
        if cache is not None:
            stack.enter_context(cache.step(index, total, skip=request.step_cache))
        return stack

    def predict_guided(self, calls: list[dict[str, Any]]) -> list[Any]:
        """The model's `sample` for each call of one step's guidance (keyword arguments of the transformer,
        conditional first), where the branches are separate calls (guidance_calls: text lengths differ): through
        the transformer's forward_guided where it has one (a parallel transformer, or its engine), which runs
        each branch on its own rank group with --cfg-parallel and the calls in turn without; else in turn."""
        import torch

        guided = getattr(self.transformer, "forward_guided", None)
        if guided is not None and len(calls) > 1:
            return [p if isinstance(p, torch.Tensor) else torch.stack(list(p)) for p in guided(calls)]
        return [self.transformer(**call, return_dict=False)[0] for call in calls]

    def run_denoise_loop(self, request: GenerationRequest, scheduler: Any, timesteps: Any, latents: Any,
                         predict: Predict, on_step: StepCallback | None = None, *,
                         expert_boundary: float | None = None) -> Any:
        """The denoising loop of every family: the request's LoRAs, then for each timestep `predict` within the
        step cache and attention precision (cache_step), the scheduler's step and on_step; returns the latents.

        Args:
            expert_boundary: Wan 2.2 A14B's two experts: "transformer" predicts the steps whose timestep is at or
                above it, "transformer_2" the others; each expert's step cache counts its own steps.
        """
        self.apply_loras(request)
        total = len(timesteps)
        switch = total  # the first step of transformer_2
        if expert_boundary is not None:
            switch = next((i for i, t in enumerate(timesteps) if t < expert_boundary), total)
            self.reset_step_caches()
        for i, t in enumerate(timesteps):
            name, index, count = ("transformer", i, switch) if i < switch else \
                ("transformer_2", i - switch, total - switch)
            with self.cache_step(request, index, count, name):
                prediction = predict(i, t, latents, name)
            latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
            if on_step is not None:
                on_step(i + 1, total)
        return latents

    def generate(self, request: GenerationRequest, on_step: StepCallback | None = None) -> Any:
        """All three stages in one process: the family's encode, denoise and decode."""
        return self.decode(request, self.denoise(request, self.encode(request), on_step))

    def computed_steps(self) -> int | None:
        """Steps of the last denoising loop whose transformer blocks all ran; None without a step cache."""
        if not self.step_caches:
            return None
        return sum(cache.computed for cache in self.step_caches.values())

    def use_prompt_cache(self, cache: PromptCache | None) -> None:
        """Keep text encodings in `cache` (rank 0): a request whose prompt settings were seen reuses them."""
        self.prompt_cache = cache

    def cached_text(self, key: Hashable, encode: Callable[[], T]) -> T:
        """encode()'s result for `key` (what the text encoding depends on), from the prompt cache if it holds it."""
        if self.prompt_cache is None:
            return encode()
        return self.prompt_cache.get_or_compute(key, encode)

    def encode_is_split(self, request: GenerationRequest) -> bool:
        """Whether part of `request`'s encoding runs on every rank (`prepare`); families that split none: False."""
        return False

    def prepare(self, request: GenerationRequest, encoded: Any) -> Any:
        """Every rank, once rank 0's encoding has reached it: the part of the encoding split over the ranks
        (a family's input VAE encode), if any; here none, so the encoding as it came."""
        return encoded

    def use_split_vae(self, group: Any) -> None:
        """Split the VAE decode over the ranks of `group` (every rank must then hold the VAE and call decode);
        None: rank 0 decodes alone."""
        self.vae_group = group

    def decode_is_split(self, request: GenerationRequest) -> bool:
        """Whether `request`'s decode runs on every rank of the split group (else on rank 0 alone)."""
        if self.vae_group is None:
            return False
        import torch.distributed as dist

        from pipelines.split_vae import splits

        return splits(request.height // self.vae_spatial_factor, dist.get_world_size(self.vae_group))

    @staticmethod
    def require_encoders(*parts: Any) -> None:
        """RuntimeError where this pipeline was loaded without the encoders `parts` are (with_encoders=False: a rank
        other than 0, which encodes nothing)."""
        if any(part is None for part in parts):
            raise RuntimeError("this pipeline was loaded without its encoders (with_encoders=False)")

    def require_vae(self) -> None:
        """RuntimeError where this pipeline was loaded without its VAE (with_vae=False: a rank that does not decode)."""
        if self.vae is None:
            raise RuntimeError("this pipeline was loaded without a VAE (with_vae=False)")

    def decode_latents(self, request: GenerationRequest, latents: Any) -> Any:
        """`self.vae.decode(latents).sample`: split over the ranks when decode_is_split(request) (then every rank
        calls it and rank 0 alone gets the result, the others None), else whole."""
        self.require_vae()
        if self.decode_is_split(request):
            from pipelines.split_vae import Parts, split_decode

            return split_decode(self.vae, latents, Parts.ranks(self.vae_group))
        return self.vae.decode(latents, return_dict=False)[0]
