"""FLUX.2 through our pipeline: equal to diffusers' Flux2Pipeline (dev) and Flux2KleinPipeline (Klein, distilled
and base with classifier-free guidance) on tiny random checkpoints, text-only and with a reference image;
equal to one process at 2 gloo ranks through the app's runtime; bad requests refused by the checks.

The checkpoints are pipelines.flux2.tiny' FLUX.2 folders: Mistral 3 (dev) or Qwen3 (Klein) text encoders with
as many layers as the pipelines read, FLUX.2's VAE with batch-norm statistics, a 6-head transformer.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from pipelines.factory import load_pipeline
from pipelines.registry import resolve_model
from pipelines.requests import RequestError, make_request, read_limits
from tests.helpers import join_ranks, spawn_ranks

PROMPT = "a red circle on the left"
SEQUENCE = 32  # text tokens: the pipelines pad to max_sequence_length; 32 keeps the tiny runs quick


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from pipelines.flux2.tiny import flux2_components, save_flux2

    root = tmp_path_factory.mktemp("flux2")
    paths = {variant: root / f"tiny-flux2-{variant}" for variant in ("dev", "klein")}
    for seed, (variant, path) in enumerate(paths.items()):
        save_flux2(path, flux2_components(seed=seed, variant=variant))
    image = np.zeros((80, 112, 3), np.uint8)
    image[16:48, 20:70] = (200, 30, 30)
    PIL.Image.fromarray(image).save(root / "reference.png")
    PIL.Image.fromarray(image[:40, :56]).save(root / "small.png")
    PIL.Image.fromarray(np.zeros((64, 600, 3), np.uint8)).save(root / "wide.png")
    return paths


def request(folders: dict[str, Path], name: str, **fields):
    from dataclasses import replace

    spec, path = resolve_model(name, folders["dev" if name == "flux2-dev" else "klein"])
    spec = replace(spec, max_sequence_length=SEQUENCE)
    if "condition" in fields:
        fields["condition"] = str(path.parent / fields["condition"])
    fields = {"prompt": PROMPT, "seed": 7, "steps": 3, "height": 64, "width": 48, **fields}
    return spec, path, make_request(spec, read_limits(spec, path), **fields)


def diffusers_run(path: Path, req, output_type: str) -> tuple[torch.Tensor, object]:
    """diffusers' own pipeline on the same request: its final packed latents and its output."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep(_pipe, _step, _t, tensors):
        final["latents"] = tensors["latents"]
        return {}

    inputs = {"image": PIL.Image.open(req.condition).convert("RGB")} if req.condition else {}
    out = pipe(prompt=req.prompt, height=req.height, width=req.width, num_inference_steps=req.steps,
               guidance_scale=req.guidance, generator=torch.Generator().manual_seed(req.seed),
               max_sequence_length=SEQUENCE, output_type=output_type, callback_on_step_end=keep, **inputs)
    return final["latents"], out.images[0]


CASES = {
    "dev text": ("flux2-dev", {}),
    "dev reference": ("flux2-dev", {"condition": "reference.png"}),
    "klein text": ("flux2-klein-4b", {}),
    "klein-base guidance text": ("flux2-klein-base-4b", {}),
    "klein-base guidance reference": ("flux2-klein-base-4b", {"condition": "reference.png"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_equals_diffusers_pipeline(folders: dict[str, Path], case: str) -> None:
    name, fields = CASES[case]
    spec, path, req = request(folders, name, **fields)
    pipeline = load_pipeline(spec, path)
    cond = pipeline.encode(req)
    assert cond.prompt_embeds.shape[0] == (2 if "guidance" in case else 1)
    assert (cond.reference_latents is not None) == ("reference" in case)
    ours = pipeline.denoise(req, cond)
    latents, image = diffusers_run(path, req, "pil")
    assert ours.shape == latents.shape
    assert (ours - latents).abs().max().item() < 1e-5
    result = pipeline.decode(req, ours)
    assert result.size == (48, 64)
    assert np.abs(np.asarray(result, np.int16) - np.asarray(image, np.int16)).max() <= 1


def test_bad_requests_refused_by_the_checks(folders: dict[str, Path]) -> None:
    spec, path = resolve_model("flux2-klein-4b", folders["klein"])
    limits = read_limits(spec, path)
    assert (limits.size_multiple, limits.reference_image) == (16, True)
    root = path.parent
    with pytest.raises(RequestError, match="width 40 is not a multiple of 16"):
        make_request(spec, limits, prompt=PROMPT, width=40)
    with pytest.raises(RequestError, match="reference image small.png is 56x40; both sides must be at least 64"):
        make_request(spec, limits, prompt=PROMPT, condition=str(root / "small.png"))
    with pytest.raises(RequestError, match="wide.png is 600x64; its long side may be at most 8 times"):
        make_request(spec, limits, prompt=PROMPT, condition=str(root / "wide.png"))
    with pytest.raises(RequestError, match="clip.mp4 is a video; this model takes a reference image"):
        make_request(spec, limits, prompt=PROMPT, condition=str(root / "clip.mp4"))
    with pytest.raises(RequestError, match="input file missing.png does not exist"):
        make_request(spec, limits, prompt=PROMPT, condition=str(root / "missing.png"))
    flux1, flux1_path = resolve_model("tiny-flux", None)
    with pytest.raises(RequestError, match="takes no input image"):
        make_request(flux1, read_limits(flux1, flux1_path), prompt=PROMPT, condition=str(root / "reference.png"))
    base, _ = resolve_model("flux2-klein-base-4b", folders["klein"])
    with pytest.raises(RequestError, match="guidance must be above 1 here"):
        make_request(base, read_limits(base, path, cfg_parallel=True), prompt=PROMPT, guidance=1.0)


# --- several ranks through the app's runtime ----------------------------------------------------

RANK_CASES = {
    # name: (model, run options, request fields)
    # (every strategy and hybrid at 2/3/4 ranks on the transformer alone: tests/test_engines_flux2.py)
    "dev ulysses-2 reference": ("flux2-dev", dict(strategy="ulysses"), {"condition": "reference.png"}),
    "klein-base cfg-2 reference": ("flux2-klein-base-4b", dict(strategy="ring", cfg_parallel=True),
                                   {"condition": "reference.png"}),
}


def _rank(rank: int, world_size: int, port: int, folders: dict[str, Path], case: str, out: str) -> None:
    join_ranks(rank, world_size, port)
    from app.ranks.runtime import start_runtime
    from engines.options import RunOptions

    name, options, fields = RANK_CASES[case]
    spec, path, req = request(folders, name, **fields)
    with start_runtime([(spec, path)], RunOptions(device="cpu", rank_timeout=120, **options),
                       stop=threading.Event()) as runtime:
        if not runtime.is_main:
            runtime.service.follow()
            return
        assert ("cfg-2" in runtime.plan) == bool(options.get("cfg_parallel")), runtime.plan
        np.save(out, np.asarray(runtime.service.run("image", req).result))


@pytest.mark.parametrize("case", list(RANK_CASES))
def test_ranks_equal_one_process(folders: dict[str, Path], case: str, tmp_path: Path) -> None:
    name, _, fields = RANK_CASES[case]
    out = tmp_path / "ranks.npy"
    spawn_ranks(_rank, 2, folders, case, str(out))
    spec, path, req = request(folders, name, **fields)
    single = np.asarray(load_pipeline(spec, path).generate(req), np.int16)
    parallel = np.load(out).astype(np.int16)
    assert parallel.shape == single.shape
    assert np.abs(parallel - single).max() <= 1, f"max pixel difference {np.abs(parallel - single).max()}"
