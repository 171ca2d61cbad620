"""Cosmos 3 through our pipeline, beyond its equality with diffusers and its ranks' with one process
(tests/test_conformance.py): given frames are kept, bad requests refused by the checks, compiled blocks take any
prompt length.

The checkpoint is pipelines.cosmos3.tiny' Cosmos 3 folder (Qwen-style tokenizer, Wan 2.2-style VAE, the
packed transformer with 24 query heads over 2 K/V heads), served under the cosmos3-nano names.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from pipelines.factory import load_pipeline
from pipelines.registry import resolve_model
from pipelines.requests import RequestError, make_request, read_limits

PROMPT = "a red circle moving right on a black background"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.cosmos3.tiny import cosmos3_components, save_cosmos3

    path = tmp_path_factory.mktemp("cosmos3") / "tiny-cosmos3"
    save_cosmos3(path, cosmos3_components(seed=3))
    image = np.zeros((64, 96, 3), np.uint8)
    image[16:40, 20:60] = (200, 30, 30)
    PIL.Image.fromarray(image).save(path.parent / "input.png")
    from pipelines.media import save_mp4

    frames = np.stack([np.roll(image, 6 * i, axis=1) for i in range(9)])
    save_mp4(frames, path.parent / "input.mp4", fps=8)
    return path


def request(folder: Path, name: str = "cosmos3-nano", **fields):
    spec, path = resolve_model(name, folder)
    fields = {"prompt": PROMPT, "negative_prompt": "blurry", "seed": 7, "steps": 3, "height": 64, "width": 96,
              "fps": 8, **fields}
    if spec.media == "video":
        fields.setdefault("frames", 9)
    return spec, path, make_request(spec, read_limits(spec, path), **fields)


def test_given_frames_are_kept(folder: Path) -> None:
    spec, path, req = request(folder, condition=str(folder.parent / "input.png"))
    pipeline = load_pipeline(spec, path)
    cond = pipeline.encode(req)
    assert cond.condition_mask[:, 0, 0].tolist() == [1.0, 0.0, 0.0]
    latents = pipeline.denoise(req, cond)
    # the conditioning frame's velocity is zeroed, so the loop leaves it where it started (up to UniPC's rounding)
    assert (latents[:, :, :1] - cond.condition_latents[:, :, :1]).abs().max().item() < 1e-4


def test_bad_requests_refused_by_the_checks(folder: Path) -> None:
    video, path = resolve_model("cosmos3-nano", folder)
    image, _ = resolve_model("cosmos3-nano-image", folder)
    video_limits, image_limits = read_limits(video, path), read_limits(image, path)
    assert (video_limits.size_multiple, video_limits.frame_multiple, video_limits.min_frames) == (16, 4, 5)
    with pytest.raises(RequestError, match="frames 8 is not 1 \\+ a multiple of 4.*use 5 or 9"):
        make_request(video, video_limits, prompt=PROMPT, frames=8)
    with pytest.raises(RequestError,
                       match=r"frames 1 is too small: at least 5 \(1 \+ a multiple of 4, from 5 to 189\)"):
        make_request(video, video_limits, prompt=PROMPT, frames=1)
    with pytest.raises(RequestError, match="height 72 is not a multiple of 16"):
        make_request(video, video_limits, prompt=PROMPT, height=72)
    with pytest.raises(RequestError, match="width 1920 is too large: at most 1280"):
        make_request(video, video_limits, prompt=PROMPT, width=1920)
    with pytest.raises(RequestError, match="input file missing.png does not exist"):
        make_request(video, video_limits, prompt=PROMPT, condition=str(folder.parent / "missing.png"))
    with pytest.raises(RequestError, match="makes images"):
        make_request(image, image_limits, prompt=PROMPT, frames=9)
    with pytest.raises(RequestError, match="takes no input"):
        make_request(image, image_limits, prompt=PROMPT, condition=str(folder.parent / "input.png"))


# --- several ranks through the app's runtime ----------------------------------------------------


def test_one_rank_compiled_blocks_take_any_prompt_length(folder: Path) -> None:
    """The layers compile once for prompts of different token counts (and the guidance calls' two
    lengths), and the compiled run equals the eager one."""
    import torch._dynamo

    from app.ranks.runtime import start_runtime
    from engines.options import RunOptions

    prompts = ["a red circle", "a big blue square moving left on a white background", "a star"]
    results = {}
    for backend in ("eager", "inductor-blocks"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        with start_runtime([resolve_model("cosmos3-nano", folder)], RunOptions(device="cpu", backend=backend),
                           stop=threading.Event()) as runtime:
            results[backend] = [np.asarray(runtime.service.run("video", request(folder, prompt=p)[2]).result)
                                for p in prompts]
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 1  # the compiled run's: one graph of the decoder layer for every length
    for eager, compiled in zip(results["eager"], results["inductor-blocks"]):
        assert np.abs(eager.astype(np.int16) - compiled.astype(np.int16)).max() <= 1
