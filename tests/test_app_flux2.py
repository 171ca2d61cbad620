"""FLUX.2 through the app, as users run it: a 2-rank CFG-parallel server whose image tab takes a reference image,
batch with a reference line, and bad reference images refused before any rank starts (`generate` with a reference
image: the family conformance suite's app cases, pipelines/flux2/conformance.py).

The checkpoints are pipelines.flux2.tiny' tiny random FLUX.2 folders: dev-style (Mistral 3 encoder, guidance
embedding) and Klein-base-style (Qwen3 encoder, classifier-free guidance).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gradio_client import Client, handle_file
from PIL import Image

from pipelines.media import read_png_settings
from tests.helpers import free_port, run_app
from tests.test_app_serve import START_SECONDS, AppProcess


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from pipelines.flux2.tiny import flux2_components, save_flux2

    root = tmp_path_factory.mktemp("flux2")
    paths = {"dev": root / "FLUX.2-dev", "klein": root / "FLUX.2-klein-base-4B"}
    for seed, (variant, path) in enumerate(paths.items()):
        save_flux2(path, flux2_components(seed=seed, variant=variant))
    image = np.zeros((80, 112, 3), np.uint8)
    image[16:48, 20:70] = (200, 30, 30)
    Image.fromarray(image).save(root / "reference.png")
    Image.fromarray(image[:40, :56]).save(root / "small.png")
    return paths


def test_bad_reference_refused_before_the_ranks_start(folders: dict[str, Path], tmp_path: Path) -> None:
    result = run_app("launch", "--nproc", "2", "generate", "--model-path", str(folders["klein"]),
                     "--prompt", "a circle", "--input", str(folders["klein"].parent / "small.png"),
                     "--steps", "2", "--out", str(tmp_path / "x.png"))
    assert result.returncode == 2, result.stderr
    assert "reference image small.png is 56x40; both sides must be at least 64 pixels" in result.stderr
    assert "rank" not in result.stderr.lower()  # refused by the launcher's checks: no rank was started
    assert not (tmp_path / "x.png").exists()


def test_server_image_tab_takes_a_reference_image(folders: dict[str, Path], tmp_path: Path) -> None:
    port = free_port()
    server = AppProcess("launch", "--nproc", "2", "serve", "--port", str(port), "--out", str(tmp_path / "out"),
                        "--model", "flux2-klein-base-4b", "--model-path", str(folders["klein"]), "--cfg-parallel")
    try:
        server.wait_for("serving on", START_SECONDS)
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        assert "cfg-2" in client.predict(api_name="/status")
        reference = handle_file(str(folders["klein"].parent / "reference.png"))
        _, png, settings, *_ = client.predict("a red circle", 4, False, 2, 4.0, 48, 64, reference,
                                              api_name="/generate_image")
        assert settings["model"] == "flux2-klein-base-4b" and settings["condition"] == "reference.png"
        assert Image.open(png).size == (48, 64)
        _, png, settings, *_ = client.predict("a red circle", 4, False, 2, 4.0, 48, 64, api_name="/generate_image")
        assert settings["condition"] is None and Image.open(png).size == (48, 64)
    finally:
        server.stop()


def test_batch_with_a_reference_line(folders: dict[str, Path], tmp_path: Path) -> None:
    root = folders["dev"].parent
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red circle", "input": "reference.png"}) + "\n"
                       + json.dumps({"prompt": "a blue square", "input": "small.png"}) + "\n")
    out = tmp_path / "out"
    result = run_app("batch", str(prompts), "--model", "flux2-dev", "--model-path", str(folders["dev"]),
                     "--out", str(out), "--size", "48x64", "--steps", "2")
    assert result.returncode == 1, result.stderr  # 1: line 2 was bad, line 1 was written
    assert "prompts.jsonl:2" in result.stderr and "small.png is 56x40" in result.stderr
    entries = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert len(entries) == 1 and entries[0]["file"].endswith(".png")
    assert read_png_settings(out / entries[0]["file"])["condition"] == "reference.png"
