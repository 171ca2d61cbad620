"""Wan 2.1 text-to-video through our pipeline: equal to diffusers' WanPipeline on a tiny random checkpoint, with
classifier-free guidance (our one batch-2 call against diffusers' two calls) and without; the checkpoint's
limits read from its configs; bad requests refused by the checks. Wan 2.1 image-to-video equal to diffusers'
WanImageToVideoPipeline on a tiny random I2V folder (the same parts with a CLIP vision encoder, a 20-channel
transformer with image context), which needs one input image.

The checkpoint is pipelines.wan.tiny' tiny Wan folder: a UMT5 encoder, a Wan 2.1-style VAE (8x space, 4x
time) with per-channel latent statistics, a 12-head transformer, UniPC with flow sigmas.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.factory import load_pipeline
from pipelines.registry import resolve_model
from pipelines.requests import RequestError, make_request, read_limits

PROMPT = "a red circle moving right"
SEQUENCE = 32  # text tokens: the pipelines pad to max_sequence_length; 32 keeps the tiny runs quick
RELATIVE_TOLERANCE = 1e-5
"""Largest difference of the final latents with guidance, relative to their largest magnitude: the batch-2 call
rounds differently from diffusers' two batch-1 calls, and guidance 5 amplifies the difference of the branches
(measured 8.6e-6 on latents up to 5.6, 1.5e-6 relative, after 3 steps). Without guidance the loops are the
same operations and the latents equal to the bit."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.wan.tiny import save_wan, wan_components

    path = tmp_path_factory.mktemp("wan") / "Wan2.1-T2V-1.3B-Diffusers"
    save_wan(path, wan_components(seed=1))
    return path


def request(folder: Path, **fields):
    spec, path = resolve_model("wan2.1-t2v-1.3b", folder)
    spec = replace(spec, max_sequence_length=SEQUENCE)
    fields = {"prompt": PROMPT, "seed": 7, "steps": 3, "height": 48, "width": 64, "frames": 9,
              "negative_prompt": "blurry, static", **fields}
    return spec, path, make_request(spec, read_limits(spec, path), **fields)


def diffusers_run(path: Path, req) -> tuple[torch.Tensor, np.ndarray]:
    """diffusers' own WanPipeline on the same request: its final latents and its frames (float, [T, H, W, 3])."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep(_pipe, _step, _t, tensors):
        final["latents"] = tensors["latents"]
        return {}

    second = {} if req.guidance_2 is None else {"guidance_scale_2": req.guidance_2}  # a two-expert model's
    out = pipe(prompt=req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
               num_frames=req.frames, num_inference_steps=req.steps, guidance_scale=req.guidance,
               generator=torch.Generator().manual_seed(req.seed), max_sequence_length=SEQUENCE, output_type="np",
               callback_on_step_end=keep, **second)
    return final["latents"], out.frames[0]


@pytest.mark.parametrize("guidance", [5.0, 1.0], ids=["guidance", "no-guidance"])
def test_equals_diffusers_pipeline(folder: Path, guidance: float) -> None:
    spec, path, req = request(folder, guidance=guidance)
    pipeline = load_pipeline(spec, path)
    cond = pipeline.encode(req)
    assert tuple(cond.prompt_embeds.shape) == (2 if guidance > 1 else 1, SEQUENCE, 64)
    ours = pipeline.denoise(req, cond)
    latents, frames = diffusers_run(path, req)
    assert ours.shape == latents.shape == (1, 8, 3, 6, 8)
    if guidance > 1:
        assert (ours - latents).abs().max().item() <= RELATIVE_TOLERANCE * latents.abs().max().item()
    else:
        assert torch.equal(ours, latents)
    video = pipeline.decode(req, ours)
    assert video.shape == (9, 48, 64, 3) and video.dtype == np.uint8
    expected = (np.clip(frames, 0.0, 1.0) * 255).round()
    assert np.abs(video.astype(np.float64) - expected).max() <= 1
    assert video.std() > 1  # random weights still draw something


def test_limits_from_the_configs_and_bad_requests_refused(folder: Path) -> None:
    spec, path = resolve_model("wan2.1-t2v-1.3b", folder)
    limits = read_limits(spec, path)
    assert (limits.size_multiple, limits.frame_multiple, limits.max_frames) == (16, 4, 81)
    assert (limits.max_height, limits.max_width) == (832, 832)  # 480p, either orientation
    big, _ = resolve_model("wan2.1-t2v-14b", folder)  # the same configs under the 14B name: 720p
    assert (read_limits(big, path).max_height, read_limits(big, path).max_width) == (1280, 1280)
    with pytest.raises(RequestError, match="width 40 is not a multiple of 16"):
        make_request(spec, limits, prompt=PROMPT, width=40)
    with pytest.raises(RequestError, match="frames 8 is not 1 \\+ a multiple of 4"):
        make_request(spec, limits, prompt=PROMPT, frames=8)
    with pytest.raises(RequestError, match="makes videos from text alone; it takes no input image or video"):
        make_request(spec, limits, prompt=PROMPT, condition=str(path / "start.png"))
    with pytest.raises(RequestError, match="guidance must be above 1 here"):
        make_request(spec, read_limits(spec, path, cfg_parallel=True), prompt=PROMPT, guidance=1.0)


def test_a_folder_alone_resolves_to_the_name_of_its_size(folder: Path, tmp_path: Path) -> None:
    """--model-path without --model: a WanPipeline folder whose transformer is the 14B's runs under the 14B's
    name (its 720p defaults and limits), any other under the first name of the class."""
    import json
    import shutil

    from pipelines.registry import get_spec

    big = tmp_path / "Wan2.1-T2V-14B-Diffusers"
    shutil.copytree(folder, big, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((big / "transformer" / "config.json").read_text())
    published = get_spec("wan2.1-t2v-14b").architecture.transformer
    (big / "transformer" / "config.json").write_text(json.dumps({**config, **published}))
    assert resolve_model(None, big)[0].name == "wan2.1-t2v-14b"
    assert resolve_model(None, folder)[0].name == "wan2.1-t2v-1.3b"


@pytest.fixture(scope="module")
def i2v_folder(tmp_path_factory) -> Path:
    from pipelines.wan.tiny import save_wan, wan_components

    path = tmp_path_factory.mktemp("wan-i2v") / "Wan2.1-I2V-14B-720P-Diffusers"
    save_wan(path, wan_components(seed=1, kind="i2v"))
    return path


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    from PIL import Image

    path = tmp_path_factory.mktemp("input") / "start.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(path)
    return path


def diffusers_image_to_video(path: Path, image: Path, cond, req) -> tuple[torch.Tensor, np.ndarray]:
    """diffusers' own WanImageToVideoPipeline on the same request, given our prompt embeddings (its I2V prompt
    cleaning needs ftfy, which WanPipeline's, ours, does without): its final latents and its frames."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    pipe = WanImageToVideoPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep(_pipe, _step, _t, tensors):
        final["latents"] = tensors["latents"]
        return {}

    out = pipe(image=Image.open(image).convert("RGB"), prompt_embeds=cond.prompt_embeds[:1],
               negative_prompt_embeds=cond.prompt_embeds[1:], height=req.height, width=req.width,
               num_frames=req.frames, num_inference_steps=req.steps, guidance_scale=req.guidance,
               generator=torch.Generator().manual_seed(req.seed), output_type="np", callback_on_step_end=keep)
    return final["latents"], out.frames[0]


def test_image_to_video_equals_diffusers_pipeline(i2v_folder: Path, image: Path) -> None:
    """WanImageToVideoPipeline's video from the same image: CLIP image context, the first frame's latents and mask
    as extra channels. Measured 1.6e-6 relative after 3 steps at guidance 5."""
    spec, path = resolve_model(None, i2v_folder)
    assert spec.name == "wan2.1-i2v-14b"  # the folder's class picks the name
    spec = replace(spec, max_sequence_length=SEQUENCE)
    req = make_request(spec, read_limits(spec, path), prompt=PROMPT, seed=7, steps=3, height=48, width=64, frames=9,
                       negative_prompt="blurry, static", condition=str(image))
    pipeline = load_pipeline(spec, path)
    cond = pipeline.encode(req)
    assert tuple(cond.image_embeds.shape) == (1, 17, 32)  # CLIP's class token and 4 x 4 patches
    assert tuple(cond.image_latents.shape) == (1, 4 + 8, 3, 6, 8)
    ours = pipeline.denoise(req, cond)
    latents, frames = diffusers_image_to_video(path, image, cond, req)
    assert ours.shape == latents.shape == (1, 8, 3, 6, 8)
    assert (ours - latents).abs().max().item() <= RELATIVE_TOLERANCE * latents.abs().max().item()
    video = pipeline.decode(req, ours)
    expected = (np.clip(frames, 0.0, 1.0) * 255).round()
    assert video.shape == (9, 48, 64, 3) and np.abs(video.astype(np.float64) - expected).max() <= 1


def test_image_to_video_needs_one_image(i2v_folder: Path, image: Path, tmp_path: Path) -> None:
    spec, path = resolve_model("wan2.1-i2v-14b", i2v_folder)
    limits = read_limits(spec, path)
    assert limits.video_input and limits.first_frame_input and limits.input_required
    assert (limits.size_multiple, limits.max_height, limits.max_frames) == (16, 1280, 81)
    with pytest.raises(RequestError, match="makes videos from an image: give one as its input"):
        make_request(spec, limits, prompt=PROMPT)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"")
    with pytest.raises(RequestError, match="is a video; this model starts a video from an image"):
        make_request(spec, limits, prompt=PROMPT, condition=str(clip))
    assert make_request(spec, limits, prompt=PROMPT, condition=str(image)).condition == str(image)


@pytest.fixture(scope="module")
def a14b_folder(tmp_path_factory) -> Path:
    """A tiny Wan 2.2 A14B text-to-video folder: two experts, boundary_ratio 0.875 (the published one)."""
    from pipelines.registry import get_spec
    from pipelines.wan.tiny import write_tiny_wan

    path = tmp_path_factory.mktemp("wan-a14b") / "Wan2.2-T2V-A14B-Diffusers"
    write_tiny_wan(get_spec("wan2.2-t2v-a14b"), path)
    return path


def expert_calls(pipeline) -> dict[str, int]:
    """Counts of each expert's calls from now on (forward hooks on the pipeline's transformers)."""
    calls = {name: 0 for name in pipeline.transformer_names}
    for name, module in pipeline.transformers():
        module.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    return calls


@pytest.mark.parametrize("guidance_2", [None, 6.0], ids=["default-guidance-2", "guidance-2"])
def test_two_experts_equal_diffusers_pipeline(a14b_folder: Path, guidance_2: float | None) -> None:
    """Wan 2.2 A14B text-to-video: the high-noise expert takes the steps at or above the boundary timestep, the
    low-noise one the rest with its own guidance scale (the model's 3.0, or the request's guidance_2), as diffusers'
    WanPipeline switches them (guidance_scale_2); a folder alone resolves to its name."""
    spec, path = resolve_model(None, a14b_folder)
    assert spec.name == "wan2.2-t2v-a14b" and spec.experts == 2
    spec = replace(spec, max_sequence_length=SEQUENCE)
    req = make_request(spec, read_limits(spec, path), prompt=PROMPT, seed=7, steps=4, height=48, width=64, frames=9,
                       negative_prompt="blurry, static", guidance=4.0, guidance_2=guidance_2)
    assert req.guidance_2 == (3.0 if guidance_2 is None else guidance_2)
    pipeline = load_pipeline(spec, path)
    assert pipeline.transformer_names == ("transformer", "transformer_2") and pipeline.boundary_ratio == 0.875
    calls = expert_calls(pipeline)
    ours = pipeline.denoise(req, pipeline.encode(req))
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0 and sum(calls.values()) == 4, calls
    latents, frames = diffusers_run(path, req)
    assert (ours - latents).abs().max().item() <= RELATIVE_TOLERANCE * latents.abs().max().item()
    expected = (np.clip(frames, 0.0, 1.0) * 255).round()
    assert np.abs(pipeline.decode(req, ours).astype(np.float64) - expected).max() <= 1


def test_guidance_2_is_refused_by_a_model_of_one_transformer(folder: Path, a14b_folder: Path) -> None:
    """guidance_2 belongs to a two-expert model: a one-transformer model refuses it with a message; the two-expert
    one checks it as guidance (0 to 100)."""
    spec, path = resolve_model("wan2.1-t2v-1.3b", folder)
    with pytest.raises(RequestError, match="model 'wan2.1-t2v-1.3b' has one transformer: use guidance"):
        make_request(spec, read_limits(spec, path), prompt=PROMPT, guidance_2=3.0)
    assert make_request(spec, read_limits(spec, path), prompt=PROMPT).guidance_2 is None
    spec, path = resolve_model("wan2.2-t2v-a14b", a14b_folder)
    with pytest.raises(RequestError, match="guidance_2 must be between 0 and 100, got 150"):
        make_request(spec, read_limits(spec, path), prompt=PROMPT, guidance_2=150)


def test_two_experts_each_have_their_step_cache(a14b_folder: Path) -> None:
    """--cache on a two-expert model: a cache per expert, each counting its own steps (its first and last
    computed), and the request's computed steps the sum of both."""
    from engines.options import CacheOptions

    spec, path = resolve_model("wan2.2-t2v-a14b", a14b_folder)
    spec = replace(spec, max_sequence_length=SEQUENCE)
    pipeline = load_pipeline(spec, path)
    pipeline.use_step_cache(CacheOptions.parse("fbcache:10"))  # a threshold that skips every step it may
    assert set(pipeline.step_caches) == {"transformer", "transformer_2"}
    for steps in (8, 2):
        req = make_request(spec, read_limits(spec, path), prompt=PROMPT, seed=7, steps=steps, height=48, width=64,
                           frames=9, guidance=1.0)
        pipeline.denoise(req, pipeline.encode(req))
        caches = pipeline.step_caches.values()
        assert pipeline.computed_steps() == sum(cache.steps - len(cache.skipped) for cache in caches)
        assert sum(cache.steps for cache in caches) == steps  # the other request's counts are gone
        for cache in caches:  # its own first and last steps computed, every one between skipped
            assert cache.skipped == list(range(1, cache.steps - 1)), (steps, cache.steps, cache.skipped)
    pipeline.remove_step_caches()
    assert pipeline.computed_steps() is None


def test_two_experts_image_to_video_equals_diffusers_pipeline(image: Path, tmp_path: Path) -> None:
    """Wan 2.2 I2V-A14B: WanImageToVideoPipeline's video from two experts, the image's latents and first-frame
    mask as extra channels and no CLIP image context."""
    from pipelines.registry import get_spec
    from pipelines.wan.tiny import write_tiny_wan

    folder = tmp_path / "Wan2.2-I2V-A14B-Diffusers"
    write_tiny_wan(get_spec("wan2.2-i2v-a14b"), folder)
    spec, path = resolve_model(None, folder)
    assert spec.name == "wan2.2-i2v-a14b"
    spec = replace(spec, max_sequence_length=SEQUENCE)
    req = make_request(spec, read_limits(spec, path), prompt=PROMPT, seed=7, steps=4, height=48, width=64, frames=9,
                       negative_prompt="blurry, static", condition=str(image))
    pipeline = load_pipeline(spec, path)
    cond = pipeline.encode(req)
    assert cond.image_embeds is None and tuple(cond.image_latents.shape) == (1, 4 + 8, 3, 6, 8)
    calls = expert_calls(pipeline)
    ours = pipeline.denoise(req, cond)
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0, calls
    latents, _ = diffusers_image_to_video(path, image, cond, req)
    assert (ours - latents).abs().max().item() <= RELATIVE_TOLERANCE * latents.abs().max().item()


def test_a_name_and_a_folder_with_other_expert_counts_are_refused(folder: Path, a14b_folder: Path) -> None:
    from pipelines.registry import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="holds 2 transformers .* but model 'wan2.1-t2v-14b' denoises with 1"):
        resolve_model("wan2.1-t2v-14b", a14b_folder)
    with pytest.raises(ModelNotFoundError, match="holds 1 transformer .* but model 'wan2.2-t2v-a14b' denoises with 2"):
        resolve_model("wan2.2-t2v-a14b", folder)


def expert_lora(folder: Path, component: str, path: Path, seed: int) -> Path:
    """A random rank-4 LoRA (diffusers/PEFT keys) on every attention and MLP linear of `folder`'s `component`."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    transformer = WanTransformer3DModel.from_pretrained(folder / component)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for index in range(len(transformer.blocks)):
        for layer in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_v",
                      "ffn.net.0.proj", "ffn.net.2"):
            linear = transformer.get_submodule(f"blocks.{index}.{layer}")
            state[f"transformer.blocks.{index}.{layer}.lora_A.weight"] = \
                torch.randn(4, linear.in_features, generator=generator) * 0.3
            state[f"transformer.blocks.{index}.{layer}.lora_B.weight"] = \
                torch.randn(linear.out_features, 4, generator=generator) * 0.3
    save_file(state, str(path))
    return path


def test_two_experts_take_a_lora_file_each(a14b_folder: Path, tmp_path: Path) -> None:
    """A Wan 2.2 LoRA as published (a high-noise and a low-noise file: `--lora NAME=HIGH,LOW`): each expert adapted
    by its file, equal to diffusers' WanPipeline with the high file loaded into transformer and the low one into
    transformer_2 (load_into_transformer_2), at the same scale; one file adapts both experts."""
    pytest.importorskip("peft")
    from diffusers import DiffusionPipeline

    from engines.options import LoraFile

    high = expert_lora(a14b_folder, "transformer", tmp_path / "high.safetensors", 0)
    low = expert_lora(a14b_folder, "transformer_2", tmp_path / "low.safetensors", 1)
    lora = LoraFile.parse(f"fast={high},{low}:0.7")
    assert (lora.path, lora.path_2, lora.scale) == (high, low, 0.7)
    spec, path = resolve_model("wan2.2-t2v-a14b", a14b_folder)
    spec = replace(spec, max_sequence_length=SEQUENCE)
    limits = replace(read_limits(spec, path), loras=(("fast", 0.7),))
    req = make_request(spec, limits, prompt=PROMPT, seed=7, steps=4, height=48, width=64, frames=9, guidance=1.0,
                       lora={"fast": 0.7})
    pipeline = load_pipeline(spec, path)
    pipeline.use_loras([lora])
    assert [loras.names for loras in pipeline.loras] == [("fast",), ("fast",)]
    ours = pipeline.denoise(req, pipeline.encode(req))

    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(high), adapter_name="fast")
    pipe.load_lora_weights(str(low), adapter_name="fast", load_into_transformer_2=True)
    pipe.set_adapters(["fast"], adapter_weights=[0.7])
    final = {}

    def keep(_pipe, _step, _t, tensors):
        final["latents"] = tensors["latents"]
        return {}

    pipe(prompt=req.prompt, height=req.height, width=req.width, num_frames=req.frames, num_inference_steps=req.steps,
         guidance_scale=req.guidance, generator=torch.Generator().manual_seed(req.seed), max_sequence_length=SEQUENCE,
         output_type="latent", callback_on_step_end=keep)
    latents = final["latents"]
    assert (ours - latents).abs().max().item() <= RELATIVE_TOLERANCE * latents.abs().max().item()
    plain = load_pipeline(spec, path).denoise(replace(req, lora=()), pipeline.encode(req))
    assert (ours - plain).abs().max().item() > 100 * RELATIVE_TOLERANCE * plain.abs().max().item()  # it acts
