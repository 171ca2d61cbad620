"""Wan 2.2 TI2V through the app, as users run it: generate an MP4 from an unchanged diffusers WanPipeline folder
with expand_timesteps, from text alone and from an input image (its first frame), and the same image-to-video
from 2 ranks splitting the tokens and their per-token timesteps (Ulysses on the generic context-parallel engine).

The checkpoint is pipelines.wan.tiny' tiny random TI2V folder, run under the wan2.2-ti2v-5b name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from pipelines.media import read_mp4_settings, read_video
from tests.helpers import run_app

# 27 tokens (3 latent frames of 3 x 3): the 2-rank split pads them, and cuts the given first frame's timestep-0
# tokens from the others' on rank 0.
COMMON = ["--model", "wan2.2-ti2v-5b", "--frames", "9", "--size", "96x96", "--steps", "2", "--prompt", "a red circle",
          "--seed", "3"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.wan.tiny import save_wan, wan_components

    path = tmp_path_factory.mktemp("wan22") / "Wan2.2-TI2V-5B-Diffusers"
    save_wan(path, wan_components(seed=2, kind="ti2v"), expand_timesteps=True)
    return path


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("input") / "start.png"
    PIL.Image.fromarray(np.random.default_rng(1).integers(0, 256, (96, 96, 3), dtype=np.uint8)).save(path)
    return path


def frames_of(path: Path) -> np.ndarray:
    frames, fps = read_video(path)
    assert fps == pytest.approx(24)  # the checkpoint's default frame rate
    return np.asarray(frames, np.int16)


@pytest.fixture(scope="module")
def one_rank_video(folder: Path, image: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "v.mp4"
    result = run_app("generate", *COMMON, "--model-path", str(folder), "--input", str(image), "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_generate_from_text_and_from_an_image(folder: Path, one_rank_video: Path, tmp_path: Path) -> None:
    frames = frames_of(one_rank_video)
    assert frames.shape == (9, 96, 96, 3) and frames.std() > 1
    settings = read_mp4_settings(one_rank_video)
    assert settings["model"] == "wan2.2-ti2v-5b" and settings["guidance"] == 5.0
    out = tmp_path / "t.mp4"
    result = run_app("generate", *COMMON, "--model-path", str(folder), "--out", str(out))
    assert result.returncode == 0, result.stderr
    text_only = frames_of(out)
    assert text_only.shape == (9, 96, 96, 3) and np.abs(text_only - frames).max() > 10  # the image changed it


def test_two_ranks_ulysses_equal_one_rank(folder: Path, image: Path, one_rank_video: Path, tmp_path: Path) -> None:
    out = tmp_path / "v2.mp4"
    result = run_app("launch", "--nproc", "2", "generate", *COMMON, "--model-path", str(folder), "--input", str(image),
                 "--strategy", "ulysses", "--out", str(out))
    assert result.returncode == 0, result.stderr
    difference = np.abs(frames_of(out) - frames_of(one_rank_video))
    assert difference.max() <= 2, f"max pixel difference {difference.max()}"  # measured 0
