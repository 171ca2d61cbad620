"""FLUX.3 through the app, as users run it: generate a PNG from an unchanged FLUX.3 folder (as diffusers'
modular pipeline saves one: modular_model_index.json, no scheduler), and the same image from 2 ranks splitting
the text and image tokens (Ulysses on the generic context-parallel engine, pipelines.flux3.parallel; guidance's two
calls each split, or each on its own rank with --cfg-parallel).

The checkpoint is pipelines.flux3.tiny' tiny random FLUX.3 folder, run under the flux3-klein-base name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines.media import read_png_settings
from tests.helpers import run_app

COMMON = ["--model", "flux3-klein-base", "--size", "64x48", "--steps", "2", "--prompt", "a big red circle",
          "--seed", "3"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.flux3.tiny import flux3_components, save_flux3

    path = tmp_path_factory.mktemp("flux3") / "flux-3-image-klein-base"
    save_flux3(path, flux3_components(seed=2))
    return path


@pytest.fixture(scope="module")
def one_rank_image(folder: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "i.png"
    result = run_app("generate", *COMMON, "--model-path", str(folder), "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_generate_writes_an_image(one_rank_image: Path) -> None:
    image = np.asarray(Image.open(one_rank_image), np.int16)
    assert image.shape == (48, 64, 3) and image.std() > 1
    settings = read_png_settings(one_rank_image)
    assert settings["model"] == "flux3-klein-base" and settings["guidance"] == 3.5  # the checkpoint's defaults
    assert settings["steps"] == 2 and settings["seed"] == 3


@pytest.mark.parametrize("plan", [["--strategy", "ulysses"], ["--cfg-parallel"]], ids=["ulysses", "cfg-parallel"])
def test_two_ranks_equal_one_rank(folder: Path, one_rank_image: Path, tmp_path: Path, plan: list[str]) -> None:
    """Ulysses (guidance's two calls each split), or --cfg-parallel (each call whole on its own rank)."""
    out = tmp_path / "i2.png"
    result = run_app("launch", "--nproc", "2", "generate", *COMMON, "--model-path", str(folder), *plan,
                     "--out", str(out))
    assert result.returncode == 0, result.stderr
    difference = np.abs(np.asarray(Image.open(out), np.int16) - np.asarray(Image.open(one_rank_image), np.int16))
    assert difference.max() <= 1, f"max pixel difference {difference.max()}"
