"""Wan through the app, as users run it, beyond what every family does (tests/test_conformance.py): a batch of two
lines, requests it cannot run refused before any rank starts, Wan 2.2 A14B's two experts from its folder alone with
a LoRA file for each (the same video from 2 ranks splitting each expert's tokens), and Wan 2.1 image-to-video from
a WanImageToVideoPipeline folder alone, which needs --input.

The checkpoints are pipelines.wan.tiny' tiny random Wan folders, run under the wan2.1-t2v-1.3b,
wan2.1-i2v-14b and wan2.2-t2v-a14b names.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipelines.media import read_mp4_settings, read_video
from tests.helpers import run_app

COMMON = ["--model", "wan2.1-t2v-1.3b", "--frames", "5", "--size", "64x48", "--steps", "2"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.wan.tiny import save_wan, wan_components

    path = tmp_path_factory.mktemp("wan") / "Wan2.1-T2V-1.3B-Diffusers"
    save_wan(path, wan_components(seed=2))
    return path


def frames_of(path: Path) -> np.ndarray:
    frames, fps = read_video(path)
    assert fps == pytest.approx(16)  # the checkpoint's default frame rate
    return np.asarray(frames, np.int16)


def test_batch_of_two_lines(folder: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red circle", "seed": 1}) + "\n"
                       + json.dumps({"prompt": "a blue square", "guidance": 1.0}) + "\n")
    out = tmp_path / "out"
    result = run_app("batch", str(prompts), *COMMON, "--model-path", str(folder), "--out", str(out))
    assert result.returncode == 0, result.stderr
    entries = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert len(entries) == 2 and all(entry["file"].endswith(".mp4") for entry in entries)
    assert [entry["settings"]["guidance"] for entry in entries] == [5.0, 1.0]
    for entry in entries:
        assert frames_of(out / entry["file"]).shape == (5, 48, 64, 3)


@pytest.mark.parametrize(("args", "message"), [
    (["--input", "start.png"], "makes videos from text alone; it takes no input image or video"),
    (["--size", "1280x720"], "width 1280 is too large: at most 832"),
])
def test_bad_request_refused_before_the_ranks_start(folder: Path, tmp_path: Path, args: list[str],
                                                    message: str) -> None:
    result = run_app("launch", "--nproc", "2", "generate", *COMMON, "--model-path", str(folder), "--prompt", "a circle",
                 "--out", str(tmp_path / "x.mp4"), *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "rank" not in result.stderr.lower()  # refused by the launcher's checks: no rank was started
    assert not (tmp_path / "x.mp4").exists()


A14B = ["--frames", "5", "--size", "64x48", "--steps", "4", "--prompt", "a red circle", "--seed", "3"]
"""4 steps: the tiny scheduler's first two timesteps are above Wan 2.2 A14B's boundary, the last two below."""


@pytest.fixture(scope="module")
def a14b_folder(tmp_path_factory) -> Path:
    from pipelines.registry import get_spec
    from pipelines.wan.tiny import write_tiny_wan

    path = tmp_path_factory.mktemp("wan-a14b") / "Wan2.2-T2V-A14B-Diffusers"
    write_tiny_wan(get_spec("wan2.2-t2v-a14b"), path)
    return path


def test_two_experts_with_a_lora_two_ranks_equal_one_rank(folder: Path, a14b_folder: Path, tmp_path: Path) -> None:
    """Wan 2.2 A14B from its folder alone, with a LoRA of two files (one per expert) and the low-noise expert's own
    guidance (--guidance-2, in the video's settings): each expert's tokens split
    over the ranks (Ulysses keeps the batch, so the video is one process's; with --cfg-parallel the groups' batch-1
    calls round apart from one batch-2 call, which 4 steps at guidance 4 drew up to 5 levels apart on 0.3% of the
    pixels). Two files for a model of one transformer are refused before any rank starts."""
    from tests.test_pipelines_wan import expert_lora

    high = expert_lora(a14b_folder, "transformer", tmp_path / "high.safetensors", 0)
    low = expert_lora(a14b_folder, "transformer_2", tmp_path / "low.safetensors", 1)
    lora = ["--lora", f"fast={high},{low}:0.7"]
    guidance_2 = ["--guidance-2", "2.5"]  # the low-noise expert's own guidance
    one, two = tmp_path / "v1.mp4", tmp_path / "v2.mp4"
    result = run_app("generate", *A14B, *lora, *guidance_2, "--model-path", str(a14b_folder), "--out", str(one))
    assert result.returncode == 0, result.stderr
    settings = read_mp4_settings(one)
    assert settings["model"] == "wan2.2-t2v-a14b" and settings["lora"] == {"fast": 0.7}
    assert settings["guidance_2"] == 2.5
    result = run_app("launch", "--nproc", "2", "generate", *A14B, *lora, *guidance_2, "--model-path",
                     str(a14b_folder), "--out", str(two))
    assert result.returncode == 0, result.stderr
    difference = np.abs(frames_of(two) - frames_of(one))
    assert difference.max() <= 2, f"max pixel difference {difference.max()}"  # measured 0
    result = run_app("launch", "--nproc", "2", "generate", *COMMON, *lora, "--model-path", str(folder), "--prompt",
                     "a circle", "--out", str(tmp_path / "x.mp4"))
    assert result.returncode == 2 and "two files are a two-expert model's" in result.stderr, result.stderr
    assert "rank" not in result.stderr.lower()


I2V = ["--frames", "5", "--size", "64x48", "--steps", "2", "--prompt", "a red circle", "--seed", "3"]


@pytest.fixture(scope="module")
def i2v_folder(tmp_path_factory) -> Path:
    from pipelines.wan.tiny import save_wan, wan_components

    path = tmp_path_factory.mktemp("wan-i2v") / "Wan2.1-I2V-14B-720P-Diffusers"
    save_wan(path, wan_components(seed=2, kind="i2v"))
    return path


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    from PIL import Image

    path = tmp_path_factory.mktemp("input") / "start.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def i2v_video(i2v_folder: Path, image: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("i2v") / "v.mp4"
    result = run_app("generate", *I2V, "--model-path", str(i2v_folder), "--input", str(image), "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_image_to_video_from_a_folder_alone(i2v_folder: Path, i2v_video: Path, tmp_path: Path) -> None:
    """--model-path without --model: the WanImageToVideoPipeline folder runs as wan2.1-i2v-14b, which needs --input."""
    frames = frames_of(i2v_video)
    assert frames.shape == (5, 48, 64, 3) and frames.std() > 1
    assert read_mp4_settings(i2v_video)["model"] == "wan2.1-i2v-14b"
    result = run_app("generate", *I2V, "--model-path", str(i2v_folder), "--out", str(tmp_path / "x.mp4"))
    assert result.returncode == 2 and "makes videos from an image: give one as its input" in result.stderr


