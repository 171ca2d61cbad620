"""Cosmos 3 through the app, as users run it: a 2-rank server with its video and image tabs on one loaded checkpoint,
batch, and bad requests refused before any rank starts work (`generate` under both names: the family conformance
suite's app cases, pipelines/cosmos3/conformance.py).

The checkpoint is pipelines.cosmos3.tiny' tiny random Cosmos 3 folder, run under the cosmos3-nano names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from PIL import Image

from pipelines.media import read_video
from tests.helpers import free_port, run_app
from tests.test_app_serve import START_SECONDS, AppProcess


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.cosmos3.tiny import cosmos3_components, save_cosmos3

    path = tmp_path_factory.mktemp("cosmos3") / "Cosmos3-Nano"
    save_cosmos3(path, cosmos3_components(seed=3))
    return path


@pytest.mark.parametrize(("args", "message"), [
    (["--frames", "8"], "frames 8 is not 1 + a multiple of 4"),
    (["--frames", "1"], "frames 1 is too small: at least 5 (1 + a multiple of 4, from 5 to 189)"),
    (["--size", "72x64"], "width 72 is not a multiple of 16"),
    (["--input", "/nonexistent/start.png"], "input file start.png does not exist"),
])
def test_bad_request_refused_before_the_ranks_start(folder: Path, tmp_path: Path, args: list[str],
                                                    message: str) -> None:
    result = run_app("launch", "--nproc", "2", "generate", "--model", "cosmos3-nano", "--model-path", str(folder),
                 "--prompt", "a red circle", "--steps", "2", "--out", str(tmp_path / "x.mp4"), *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "rank" not in result.stderr.lower()  # refused by the launcher's checks: no rank was started
    assert not (tmp_path / "x.mp4").exists()


def test_server_serves_video_and_image_tabs_from_one_checkpoint(folder: Path, tmp_path: Path) -> None:
    port = free_port()
    server = AppProcess("launch", "--nproc", "2", "serve", "--port", str(port), "--out", str(tmp_path / "out"),
                        "--model", "cosmos3-nano-image", "--model-path", str(folder),
                        "--video-model", "cosmos3-nano", "--video-model-path", str(folder), "--cfg-parallel")
    try:
        server.wait_for("serving on", START_SECONDS)
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        status = client.predict(api_name="/status")
        assert "cosmos3-nano-image (image)" in status and "cosmos3-nano (video)" in status and "cfg-2" in status

        _, png, settings, *_ = client.predict("a red circle", 4, False, 2, 6.0, 96, 64, api_name="/generate_image")
        assert settings["model"] == "cosmos3-nano-image" and Image.open(png).size == (96, 64)

        start = tmp_path / "start.png"
        Image.new("RGB", (96, 64), (200, 30, 30)).save(start)
        _, mp4, settings, *_ = client.predict("the red square moves", "", handle_file(str(start)), 5, 8, 3, False, 2,
                                              6.0, 96, 64, api_name="/generate_video")
        frames, _ = read_video(mp4)
        assert settings["model"] == "cosmos3-nano" and len(frames) == 5 and frames[0].shape == (64, 96, 3)
    finally:
        server.stop()


def test_batch_on_two_ranks(folder: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red circle", "seed": 1}) + "\n"
                       + json.dumps({"prompt": "a blue square", "frames": 6}) + "\n")
    out = tmp_path / "out"
    result = run_app("launch", "--nproc", "2", "batch", str(prompts), "--model", "cosmos3-nano", "--model-path",
                 str(folder), "--out", str(out), "--size", "96x64", "--frames", "5", "--steps", "2")
    assert result.returncode == 1, result.stderr  # 1: line 2 was bad, line 1 was written
    assert "prompts.jsonl:2" in result.stderr and "frames 6 is not 1 + a multiple of 4" in result.stderr
    entries = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert len(entries) == 1 and entries[0]["file"].endswith(".mp4") and entries[0]["ranks"] == 2
    assert len(read_video(out / entries[0]["file"])[0]) == 5
