"""Wan 2.1 and Wan 2.2 A14B through our pipeline, beyond their equality with diffusers (tests/test_conformance.py):
the checkpoint's limits read from its configs; bad requests refused by the checks; image-to-video needs one input
image; a folder resolves to its name; two experts take the steps either side of their boundary, each with its step
cache and its LoRA file (equal to diffusers' PEFT adapters).

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
"""Largest difference of the final latents from diffusers', relative to their largest magnitude (as in
pipelines.wan.conformance)."""


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
def test_two_experts_take_the_steps_either_side_of_the_boundary(a14b_folder: Path, guidance_2: float | None) -> None:
    """Wan 2.2 A14B text-to-video: the high-noise expert takes the steps at or above the boundary timestep, the
    low-noise one the rest with its own guidance scale (the model's 3.0, or the request's guidance_2); a folder
    alone resolves to its name. (Equal to diffusers' WanPipeline, which switches them so: tests/test_conformance.py.)"""
    spec, path = resolve_model(None, a14b_folder)
    assert spec.name == "wan2.2-t2v-a14b" and spec.experts == 2
    spec = replace(spec, max_sequence_length=SEQUENCE)
    req = make_request(spec, read_limits(spec, path), prompt=PROMPT, seed=7, steps=4, height=48, width=64, frames=9,
                       negative_prompt="blurry, static", guidance=4.0, guidance_2=guidance_2)
    assert req.guidance_2 == (3.0 if guidance_2 is None else guidance_2)
    pipeline = load_pipeline(spec, path)
    assert pipeline.transformer_names == ("transformer", "transformer_2") and pipeline.boundary_ratio == 0.875
    calls = expert_calls(pipeline)
    pipeline.denoise(req, pipeline.encode(req))
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0 and sum(calls.values()) == 4, calls


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
    from pipelines.conformance import diffusers_run, seeded

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
    pipe.load_lora_weights(str(high), adapter_name="fast")
    pipe.load_lora_weights(str(low), adapter_name="fast", load_into_transformer_2=True)
    pipe.set_adapters(["fast"], adapter_weights=[0.7])
    latents, _ = diffusers_run(pipe, prompt=req.prompt, height=req.height, width=req.width, num_frames=req.frames,
                               num_inference_steps=req.steps, guidance_scale=req.guidance, generator=seeded(req.seed),
                               max_sequence_length=SEQUENCE, output_type="latent")
    assert (ours - latents).abs().max().item() <= RELATIVE_TOLERANCE * latents.abs().max().item()
    plain = load_pipeline(spec, path).denoise(replace(req, lora=()), pipeline.encode(req))
    assert (ours - plain).abs().max().item() > 100 * RELATIVE_TOLERANCE * plain.abs().max().item()  # it acts
