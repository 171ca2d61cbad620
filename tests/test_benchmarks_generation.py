"""The whole-generation benchmark's code path (benchmarks/generation.py), tiny on CPU with 2 gloo ranks under torchrun.

Whole generations through the pipelines and the lockstep service: the JSON says what a GPU run will
say, and the image (or video) of every parallel mode equals the 1 GPU one within one level.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import PYTHON, REPO, torchrun

FLUX_ARGS = ["--model", "flux-dev", "--split-vae", "on", "--steps", "2", "--height", "64", "--width", "64",
             "--runs", "2", "--warmup-steps", "1"]
COSMOS_ARGS = ["--model", "cosmos-predict2-2b-video2world", "--cfg", "--steps", "2", "--height", "48", "--width", "64",
               "--frames", "9", "--runs", "1", "--warmup-steps", "1"]


def check_result(path: Path, modes: set[str], runs: int) -> list[dict]:
    """The JSON's fields, and every parallel mode's output equal to its model's 1 GPU one; returns the rows."""
    result = json.loads(path.read_text())
    meta, rows = result["meta"], result["rows"]
    assert meta["world_size"] == 2 and len(meta["devices"]) == 2
    assert meta["command"].startswith("torchrun --nproc-per-node 2 -m benchmarks.generation")
    for key in ("date", "python", "torch", "diffusers", "transformers", "dtype", "backends", "models"):
        assert meta[key], key
    assert {r["mode"] for r in rows} == modes
    for r in rows:
        assert r["error"] is None, r
        assert r["runs"] == runs and r["backend"] == "eager" and r["warmup_s"] > 0
        stages = r["encode_s"] + r["denoise_s"] + r["decode_s"]
        assert 0 < stages <= r["total_s"] * 1.01, r  # medians of separate runs: allow a hair
        assert r["step_ms"] == pytest.approx(r["denoise_s"] / r["steps"] * 1e3)
        assert len(r["step_s"]) == r["steps"] and min(r["step_s"]) > 0 and r["write_s"] > 0
        assert r["split_vae"] == (r["mode"] != "1 GPU")  # the parallel modes' decode split over the 2 ranks
        assert len(r["peak_gib"]) == r["gpus"] == (1 if r["mode"] == "1 GPU" else 2)
        assert r["speedup"] > 0 and r["denoise_speedup"] > 0
    for model in {r["model"] for r in rows}:
        single = np.load(next(r["media"] for r in rows if r["mode"] == "1 GPU" and r["model"] == model))
        single = single.astype(np.int16)
        assert single.std() > 1  # an image, not a flat field: the comparison below means something
        for r in (r for r in rows if r["model"] == model):
            parallel = np.load(r["media"]).astype(np.int16)
            assert parallel.shape == single.shape
            assert np.abs(parallel - single).max() <= 1, (model, r["mode"], np.abs(parallel - single).max())
    return rows


def test_bench_end_to_end_command_tiny_flux(tmp_path: Path) -> None:
    cmd = [PYTHON, "-m", "app", "bench", "--ranks", "2", "--tiny", "--end-to-end", "--out", str(tmp_path),
           "--", *FLUX_ARGS, "--media-dir", str(tmp_path / "media")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = check_result(tmp_path / "e2e.json", {"1 GPU", "ours ulysses-2"}, runs=2)
    assert {(r["shape"], r["steps"]) for r in rows} == {("64x64", 2)}
    assert (tmp_path / "e2e.png").read_bytes()[:4] == b"\x89PNG"
    assert "ours ulysses-2" in proc.stdout  # the table is printed on rank 0


def test_e2e_tiny_cosmos_ulysses_and_cfg(tmp_path: Path) -> None:
    """Cosmos-Predict2, and Wan 2.1 image-to-video, whose request needs an input picture (the benchmark gives a seeded
    noise one) and whose pipeline its CLIP image encoder."""
    out = tmp_path / "e2e.json"
    args = [arg if arg != "cosmos-predict2-2b-video2world" else f"{arg},wan2.1-i2v-14b" for arg in COSMOS_ARGS]
    cmd = torchrun(2, "-m", "benchmarks.generation", "--tiny", *args, "--media-dir", str(tmp_path / "media"),
                   "--out", str(out))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = check_result(out, {"1 GPU", "ours ulysses-2", "ours cfg-2"}, runs=1)
    assert {r["shape"] for r in rows} == {"9x48x64"}
    assert {r["model"] for r in rows} == {"tiny-cosmos", "wan2.1-i2v-14b"}  # --tiny: the embedded model where one is


def test_e2e_tiny_cosmos3_ulysses_and_cfg(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    cmd = torchrun(2, "-m", "benchmarks.generation", "--tiny", "--model", "cosmos3-nano", "--cfg", "--steps", "2",
                   "--height", "64", "--width", "96", "--frames", "9", "--runs", "1", "--warmup-steps", "1",
                   "--backends", "eager", "--media-dir", str(tmp_path / "media"), "--out", str(out))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = check_result(out, {"1 GPU", "ours ulysses-2", "ours cfg-2"}, runs=1)
    assert {r["shape"] for r in rows} == {"9x64x96"}


def test_e2e_tiny_flux2_dev_and_klein(tmp_path: Path) -> None:
    """FLUX.2 ships no embedded model: each checkpoint takes its tokenizer from its pipeline's tiny random one
    (Mistral's chat tokenizer for FLUX.2-dev, Qwen's for Klein)."""
    out = tmp_path / "e2e.json"
    cmd = torchrun(2, "-m", "benchmarks.generation", "--tiny", "--model", "flux2-dev,flux2-klein-4b", "--steps", "2",
                   "--height", "64", "--width", "64", "--split-vae", "on", "--runs", "1", "--warmup-steps", "1",
                   "--backends", "eager", "--media-dir", str(tmp_path / "media"), "--out", str(out))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = check_result(out, {"1 GPU", "ours ulysses-2"}, runs=1)
    assert {(r["model"], r["shape"]) for r in rows} == {("flux2-dev", "64x64"), ("flux2-klein-4b", "64x64")}


def test_baseline_gives_the_speedup_of_a_run_without_1_gpu() -> None:
    from benchmarks.generation import finish

    def row(mode: str, total: float, denoise: float) -> dict:
        return dict(model="m", shape="64x64", backend="eager", mode=mode, total_s=total, denoise_s=denoise)

    rows = finish([row("ours ulysses-2", 2.0, 1.0)], baseline=[row("1 GPU", 3.0, 2.5)])
    assert rows[0]["speedup"] == pytest.approx(1.5) and rows[0]["denoise_speedup"] == pytest.approx(2.5)
    assert finish([row("ours ulysses-2", 2.0, 1.0)], baseline=[])[0]["speedup"] is None


def test_a_video_model_without_an_mp4_writer_is_refused_before_anything_loads(monkeypatch, capsys) -> None:
    """The benchmark writes each result as the app does: where no MP4 can be written, a video model's run
    stops at its arguments instead of failing after its first generation."""
    from benchmarks.generation import parse_args

    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", "/nonexistent/ffmpeg")
    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--model", "wan2.1-t2v-1.3b"])
    assert "makes MP4 videos, which cannot be written here" in capsys.readouterr().err
    assert parse_args(["--tiny", "--model", "flux-dev"]).models == ["flux-dev"]  # images need no ffmpeg


def test_vae_split_benchmark_tiny(tmp_path: Path) -> None:
    """benchmarks/vae_split.py on the tiny VAEs: the whole decode and 2 and 4 parts, their outputs equal."""
    out = tmp_path / "vae-split.json"
    cmd = [PYTHON, "-m", "benchmarks.vae_split", "--tiny", "--runs", "1", "--height", "96", "--width", "80",
           "--frames", "9", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["shape"]) for r in rows] == [("tiny-flux", "96x80"), ("tiny-cosmos", "9x96x80")]
    assert "encode_s" not in rows[0] and rows[1]["encode_s"] > 0  # the Wan 2.1 VAE's input encode
    for r in rows:
        assert r["whole_s"] > 0 and [s["parts"] for s in r["splits"]] == [2, 4]
        for split in r["splits"] + r.get("encode_splits", []):
            assert 0 < split["mean_part_s"] <= split["largest_part_s"] <= split["all_parts_s"]
            assert split["max_abs_difference"] <= 1e-4
    assert "largest part s" in proc.stdout


def test_e2e_tiny_flux_with_a_step_cache_and_quantized_attention(tmp_path: Path) -> None:
    """--cache puts serve's step cache on every mode (agreed over the ranks) and records the steps computed;
    --attention-precision then runs every mode again with quantized attention."""
    out = tmp_path / "cache.json"
    cmd = torchrun(2, "-m", "benchmarks.generation", "--tiny", "--model", "flux-dev", "--steps", "3", "--height", "64",
                   "--width", "64", "--runs", "1", "--warmup-steps", "1", "--cache", "fbcache:1e9",
                   "--attention-precision", "int8", "--out", str(out))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["mode"], r["attention_precision"]) for r in rows} == {
        ("1 GPU", "full"), ("ours ulysses-2", "full"), ("1 GPU attention int8", "int8"),
        ("ours ulysses-2 attention int8", "int8")}
    for r in rows:
        # a threshold no change reaches: step 0 computes, later steps reuse its blocks
        assert r["error"] is None and r["step_cache"] == "fbcache:1e9" and len(r["computed_steps"]) == 1, r
        assert 1 <= r["computed_steps"][0] < 3, r
    refused = subprocess.run([PYTHON, "-m", "benchmarks.generation", "--tiny", "--cache", "nocache"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--cache 'nocache'" in refused.stderr
