"""Qwen-Image-Edit through the app, as users run it: generate a PNG from a diffusers QwenImageEditPipeline folder
with `--input` as the reference image, and the same image from 2 ranks (Ulysses on the generic engine: the image's
and the reference's tokens split together, guidance's two calls each split).

The checkpoint is pipelines.qwen_image.tiny' tiny random Qwen-Image-Edit folder, run under the qwen-image-edit name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines.media import read_png_settings
from tests.helpers import run_app

COMMON = ["--model", "qwen-image-edit", "--size", "64x48", "--steps", "2", "--prompt", "a big red circle",
          "--seed", "3"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.qwen_image.tiny import qwen_image_edit_components, save_qwen_image_edit

    path = tmp_path_factory.mktemp("qwen-image-edit") / "Qwen-Image-Edit"
    save_qwen_image_edit(path, qwen_image_edit_components(seed=2))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("input") / "in.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def one_rank_image(folder: Path, reference: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "i.png"
    result = run_app("generate", *COMMON, "--model-path", str(folder), "--input", str(reference), "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_generate_writes_an_image(one_rank_image: Path) -> None:
    image = np.asarray(Image.open(one_rank_image), np.int16)
    assert image.shape == (48, 64, 3) and image.std() > 1
    settings = read_png_settings(one_rank_image)
    assert settings["model"] == "qwen-image-edit" and settings["guidance"] == 4.0  # the checkpoint's defaults
    assert settings["negative_prompt"] == " " and settings["steps"] == 2


def test_generate_without_an_input_is_refused(folder: Path, tmp_path: Path) -> None:
    result = run_app("generate", *COMMON, "--model-path", str(folder), "--out", str(tmp_path / "i.png"))
    assert result.returncode != 0 and "edits an image: give one as its input" in result.stderr


def test_two_ranks_equal_one_rank(folder: Path, reference: Path, one_rank_image: Path, tmp_path: Path) -> None:
    out = tmp_path / "i2.png"
    result = run_app("launch", "--nproc", "2", "generate", *COMMON, "--model-path", str(folder), "--input",
                     str(reference), "--strategy", "ulysses", "--out", str(out))
    assert result.returncode == 0, result.stderr
    difference = np.abs(np.asarray(Image.open(out), np.int16) - np.asarray(Image.open(one_rank_image), np.int16))
    assert difference.max() <= 1, f"max pixel difference {difference.max()}"


def test_2511_two_ranks_equal_one_rank(reference: Path, tmp_path: Path) -> None:
    """Qwen-Image-Edit-2511 (QwenImageEditPlusPipeline, zero_cond_t): the transformer's per-token timestep index
    (its reference's tokens at timestep 0) is split with the tokens, as its plan says (modulate_index), so ring-2
    equals one rank."""
    from pipelines.qwen_image.tiny import write_tiny_qwen_image
    from pipelines.registry import get_spec

    folder = tmp_path / "Qwen-Image-Edit-2511"
    write_tiny_qwen_image(get_spec("qwen-image-edit-2511"), folder)
    common = ["--model", "qwen-image-edit-2511", *COMMON[2:], "--model-path", str(folder), "--input", str(reference)]
    one, two = tmp_path / "i1.png", tmp_path / "i2.png"
    result = run_app("generate", *common, "--out", str(one))
    assert result.returncode == 0, result.stderr
    assert read_png_settings(one)["model"] == "qwen-image-edit-2511"
    result = run_app("launch", "--nproc", "2", "generate", *common, "--strategy", "ring", "--out", str(two))
    assert result.returncode == 0, result.stderr
    difference = np.abs(np.asarray(Image.open(two), np.int16) - np.asarray(Image.open(one), np.int16))
    assert difference.max() <= 1, f"max pixel difference {difference.max()}"
