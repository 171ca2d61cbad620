"""`ulysses-studio generate` end to end, as a user runs it (a subprocess of `python -m app`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines.media import read_png_settings, read_video
from tests.helpers import REPO, import_noise, tiny_cosmos_frames_problem


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_generate_tiny_flux_png_with_settings(tmp_path):
    out = tmp_path / "out.png"
    result = cli("generate", "--model", "tiny-flux", "--prompt", "a red circle", "--seed", "1",
                 "--steps", "3", "--size", "128x96", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "denoising" in result.stderr  # the progress bar
    assert not import_noise(result.stderr), result.stderr
    with Image.open(out) as image:
        assert image.size == (128, 96)
    settings = read_png_settings(out)
    assert settings == {
        "model": "tiny-flux", "prompt": "a red circle", "negative_prompt": "", "seed": 1, "steps": 3,
        "guidance": 3.5, "height": 96, "width": 128, "condition": None,
    }
    with Image.open(out) as image:
        assert image.text["seed"] == "1" and image.text["prompt"] == "a red circle"

    again = tmp_path / "again.png"
    assert cli("generate", "--prompt", "a red circle", "--seed", "1", "--steps", "3", "--size", "128x96",
               "--out", str(again), "--quiet").returncode == 0
    assert np.array_equal(np.asarray(Image.open(out)), np.asarray(Image.open(again)))


def test_an_fp8_run_prints_nothing_from_torchao_s_import(tmp_path):
    result = cli("generate", "--model", "tiny-flux", "--prompt", "a red circle", "--steps", "1", "--size", "64x64",
                 "--fp8", "--out", str(tmp_path / "fp8.png"))
    assert result.returncode == 0, result.stderr
    assert "denoising" in result.stderr
    assert not import_noise(result.stderr), result.stderr


def test_generate_tiny_cosmos_mp4_decodes_with_frames_and_fps(tmp_path):
    out = tmp_path / "out.mp4"
    result = cli("generate", "--model", "tiny-cosmos", "--prompt", "a blue square moving right", "--seed", "2",
                 "--steps", "2", "--frames", "9", "--fps", "12", "--size", "96x64", "--out", str(out))
    assert result.returncode == 0, result.stderr
    frames, fps = read_video(out)
    assert len(frames) == 9
    assert fps == pytest.approx(12)
    assert frames[0].shape == (64, 96, 3)


def test_generate_video_to_world_from_an_image(tmp_path):
    start = tmp_path / "start.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(start)
    out = tmp_path / "world.mp4"
    result = cli("generate", "--model", "tiny-cosmos", "--prompt", "the red square moves", "--input", str(start),
                 "--steps", "2", "--frames", "5", "--size", "64x64", "--out", str(out))
    assert result.returncode == 0, result.stderr
    frames, _ = read_video(out)
    assert len(frames) == 5


BAD_INPUTS = [  # (arguments, the one line's words)
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--model", "flux-dev"], "weights for 'flux-dev' not found in"),
    (["--model-path", "/nonexistent/folder"], "does not exist"),
    (["--height", "250"], "height 250 is not a multiple of 16"),
    (["--width", "0"], "width 0 is too small: at least 16"),
    (["--steps", "0"], "steps must be between 1"),
    (["--steps", "-3"], "steps must be between 1"),
    (["--size", "12by12"], "--size must look like"),
    (["--guidance", "nan"], "guidance must be a finite number"),
    (["--prompt", "   "], "prompt is empty"),
    (["--out", "/proc/forbidden/x.png"], "does not exist"),
    (["--out", "OUT_DIR/image.mp4"], "should end in .png"),
    (["--model", "tiny-cosmos", "--frames", "0", "--out", "OUT_DIR/v.mp4"], "frames 0 is too small: at least 1"),
    (["--model", "tiny-cosmos", "--frames", "16", "--out", "OUT_DIR/v.mp4"], tiny_cosmos_frames_problem(16)),
    (["--model", "tiny-cosmos", "--input", "/nonexistent.png", "--out", "OUT_DIR/v.mp4"], "does not exist"),
    (["--frames", "9"], "makes images; frames must be 1"),
]

CALLS = """
import contextlib, io, json, sys
from app.commands.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        status = main(argv)
    results.append([status, stderr.getvalue()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory) -> tuple[Path, list[tuple[int, str]]]:
    """Each of BAD_INPUTS through the command line's main(), in one process (a process each took 5 s of imports):
    its exit status and what it wrote to stderr."""
    import json

    out_dir = tmp_path_factory.mktemp("bad-inputs")
    argvs = []
    for args, _ in BAD_INPUTS:
        args = [a.replace("OUT_DIR", str(out_dir)) for a in args]
        base = {"--prompt": "a circle", "--out": str(out_dir / "x.png")}
        argvs.append(["generate", *args, *(item for flag, value in base.items() if flag not in args
                                           for item in (flag, value))])
    done = subprocess.run([sys.executable, "-c", CALLS, json.dumps(argvs)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "ULYSSES_STUDIO_MODELS": str(out_dir / "models")})
    assert done.returncode == 0, done.stderr
    return out_dir, [tuple(result) for result in json.loads(done.stdout.strip().splitlines()[-1])]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)), ids=[message[:40] for _, message in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(bad_input_runs, case):
    out_dir, runs = bad_input_runs
    status, stderr = runs[case]
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert BAD_INPUTS[case][1] in lines[0]
    assert "Traceback" not in stderr
    assert not list(out_dir.glob("*.png")) and not list(out_dir.glob("*.mp4"))


def test_output_that_is_a_folder_is_refused(tmp_path):
    folder = tmp_path / "taken.png"
    folder.mkdir()
    result = cli("generate", "--prompt", "x", "--out", str(folder))
    assert result.returncode == 2 and "it is a folder" in result.stderr


def test_help_names_every_command_and_every_batch_field() -> None:
    from app.commands.prompt_files import FIELDS

    top = cli("--help")
    for command in ("generate", "serve", "batch", "build", "bench", "launch"):
        assert command in top.stdout
    batch = cli("batch", "--help").stdout
    assert all(field in batch for field in FIELDS) and "prompt_files.py" not in batch
    generate = cli("generate", "--help").stdout
    for option, words in (("--prompt", "what to draw"), ("--seed", "same seed"), ("--height", "pixels"),
                          ("--width", "pixels")):
        assert option in generate and words in generate, option


def test_a_video_model_is_refused_before_any_work_where_mp4_cannot_be_written(tmp_path, monkeypatch):
    """imageio-ffmpeg with no ffmpeg to run: generate, batch and serve refuse a video model up front, in one
    line, instead of computing the video and losing it at its file; image models still run."""
    from app.commands.cli import build_parser
    from app.server.serve import ServeError, serve_plan

    env = {"IMAGEIO_FFMPEG_EXE": str(tmp_path / "no-ffmpeg")}
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle moving right\n")
    for args in (("generate", "--model", "tiny-cosmos", "--prompt", "a red circle", "--out", str(tmp_path / "v.mp4")),
                 ("batch", str(prompts), "--model", "tiny-cosmos", "--out", str(tmp_path / "videos"))):
        result = cli(*args, env=env)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert "model 'tiny-cosmos' makes MP4 videos, which cannot be written here" in lines[0]
        assert "no-ffmpeg" in lines[0] and "denoising" not in result.stderr
    assert not list(tmp_path.rglob("*.mp4"))

    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", env["IMAGEIO_FFMPEG_EXE"])
    with pytest.raises(ServeError, match="or serve an image model alone"):
        serve_plan(build_parser().parse_args(["serve"]))  # the default: an image and a video model
    assert [spec.name for spec, _ in serve_plan(build_parser().parse_args(["serve", "--model", "tiny-flux"])).models] \
        == ["tiny-flux"]
    image = cli("generate", "--model", "tiny-flux", "--prompt", "a red circle", "--steps", "2", "--size", "64x64",
                "--out", str(tmp_path / "still.png"), env=env)
    assert image.returncode == 0, image.stderr
